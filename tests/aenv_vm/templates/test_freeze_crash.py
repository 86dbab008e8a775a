"""A template build's commit under SIGKILL (issue 29): a process commits templates as
a build's last step does (templates/freeze.py: seal the disk's upper layer, stage the
memory image and device state, write the template record, then its alias) and is
killed at a random moment, again and again. After every kill the repository verifies
clean (`aenv repo verify --read-data`) and gc runs; every template whose commit
returned reads back byte for byte (disk, memory, device state); no alias names a
template that is not there; and a template is never half there (a record whose
manifests are missing)."""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from aenv_vm.blockimage.image import BlockImage
from aenv_vm.blockimage.importer import import_raw
from aenv_vm.templates.template import find_template, list_templates

from ...aenv_store.admin.conftest import open_store, run_aenv, write_config
from . import freeze_committer as committer

ROUNDS = 12
BASE = "crash-base"


def start(data_dir: Path, seed: int, journal: Path, work: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    proc = subprocess.Popen([sys.executable, committer.__file__, "--data-dir", str(data_dir), "--base", BASE,
                             "--seed", str(seed), "--journal", str(journal), "--work", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the committer did not start: {line!r} {err.decode()[-2000:]}")
    return proc


def check(data_dir: Path, base: bytes, committed: set[str], seeds: dict[str, tuple[int, int]],
          read: set[str]) -> None:
    """Every alias names a template that is there, every committed template is there, and
    each template not in ``read`` (then added to it) reads back byte for byte."""
    with open_store(data_dir) as store:
        templates = {t.id: (t, aliases) for t, aliases in list_templates(store)}
        for rec in store.list_records("alias"):
            if rec.target:
                assert rec.target in templates, f"alias {rec.name} names {rec.target}, which is not there"
        assert committed <= set(templates), f"committed templates vanished: {sorted(committed - set(templates))}"
        for tid, (tpl, aliases) in templates.items():
            if tid in read:
                continue
            read.add(tid)
            seed, i = seeds[tid]
            disk, mem, state = committer.files(seed, i)
            want_disk = bytearray(base)
            for off, data in disk:
                want_disk[off:off + len(data)] = data
            with BlockImage.open(store, tpl.disk, f"check-{tid}") as image:
                assert image.read(0, len(want_disk)) == bytes(want_disk), f"{tid}: disk differs"
            want_mem = bytearray(committer.MEM)
            for off, data in mem:
                want_mem[off:off + len(data)] = data
            blob = store.open_blob(tpl.memory)
            assert blob.read(0, blob.size) == bytes(want_mem), f"{tid}: memory image differs"
            blob = store.open_blob(tpl.device_state)
            assert blob.read(0, blob.size) == state, f"{tid}: device state differs"
            if tid in committed:
                assert find_template(store, f"crash-{tid[4:]}").id == tid     # its alias was written too


def test_sigkill_during_template_commits(tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"freeze crash test seed {seed}")
    rng = random.Random(seed)
    data_dir = tmp_path / "node"
    write_config(data_dir)
    base = random.Random(seed).randbytes(1 << 20)
    (tmp_path / "base.raw").write_bytes(base)
    with open_store(data_dir, create=True) as store:
        import_raw(store, tmp_path / "base.raw", BASE)
    journal = tmp_path / "journal"
    seeds: dict[str, tuple[int, int]] = {}
    read: set[str] = set()
    for rnd in range(ROUNDS):
        round_seed = rng.getrandbits(32)
        seeds.update({committer.template_id(round_seed, i): (round_seed, i) for i in range(10_000)})
        proc = start(data_dir, round_seed, journal, tmp_path / f"work-{rnd}")
        time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, f"round {rnd} (seed {seed}): the committer failed:\n" \
            f"{err.decode(errors='replace')[-3000:]}"
        r = run_aenv(data_dir, "repo", "verify", "--read-data")
        assert r.rc == 0, f"round {rnd} (seed {seed}): verify failed:\n{r.out}{r.err}"
        committed = {line.split()[1] for line in journal.read_text().splitlines()} if journal.exists() else set()
        check(data_dir, base, committed, seeds, read)
        r = run_aenv(data_dir, "repo", "gc", "--grace", "0")
        assert r.rc == 0, f"round {rnd} (seed {seed}): gc failed:\n{r.out}{r.err}"
        check(data_dir, base, committed, seeds, set())       # gc removed nothing a template needs
    committed = set(journal.read_text().split()[1::2]) if journal.exists() else set()
    print(f"{ROUNDS} kills, {len(committed)} templates committed")
    assert len(committed) >= ROUNDS // 2, "too few commits finished to have tested anything"
