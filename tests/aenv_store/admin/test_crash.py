"""Acceptance 2 — crash safety: SIGKILL a committing process at a random moment,
again and again; after every kill `aenv repo verify --read-data` is clean,
`aenv repo gc` runs, and every artifact committed so far reads back byte for byte."""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from aenv_store.admin.verify import verify
from aenv_store.repository.backends.posix_fs import PosixFsBackend
from aenv_store.repository.repository import Repository

ROUNDS = 32


def start_committer(script: Path, data_dir: Path, prefix: str, seed: int, journal: Path,
                    *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(script), "--data-dir", str(data_dir), "--prefix", prefix, "--seed", str(seed),
         "--journal", str(journal), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"committer did not start: {line!r} {err.decode()[-2000:]}")
    return proc


def journal_state(journal: Path) -> tuple[set[str], set[str]]:
    """(names whose commit returned, names whose deletion was started)."""
    committed, deleting = set(), set()
    if journal.exists():
        for line in journal.read_text().splitlines():
            op, _, name = line.partition(" ")
            (committed if op == "C" else deleting).add(name)
    return committed, deleting


def test_sigkill_during_commit_loop(repo, aenv, wl) -> None:  # type: ignore[no-untyped-def]
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"crash test seed {seed}")
    rng = random.Random(seed)
    journal = repo.tmp / "journal"
    script = Path(wl.__file__)
    interrupted = 0  # rounds whose kill left a half-published commit behind
    for rnd in range(ROUNDS):
        proc = start_committer(script, repo.data_dir, f"r{rnd}", rng.getrandbits(32), journal)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL

        before = verify(Repository.open(PosixFsBackend(repo.path), "test"))
        if before.unindexed_packs or before.unreferenced_packs or before.unreachable_manifests:
            interrupted += 1

        r = aenv(repo.data_dir, "repo", "verify", "--read-data")
        assert r.rc == 0, f"round {rnd} (seed {seed}): verify failed:\n{r.out}{r.err}"
        r = aenv(repo.data_dir, "repo", "gc", "--grace", "0")
        assert r.rc == 0, f"round {rnd} (seed {seed}): gc failed:\n{r.out}{r.err}"

        committed, deleting = journal_state(journal)
        present = set(repo.read_back())  # every record in the catalog reads back exactly
        lost = committed - deleting - present
        assert not lost, f"round {rnd} (seed {seed}): committed records vanished: {sorted(lost)}"

    after = verify(Repository.open(PosixFsBackend(repo.path), "test"), read_data=True)
    assert after.ok and after.unreferenced_packs == 0 and after.unreachable_manifests == 0
    committed, _ = journal_state(journal)
    print(f"{ROUNDS} kills, {len(committed)} commits journaled, {interrupted} kills interrupted a commit")
    assert len(committed) >= ROUNDS // 2
    assert interrupted >= 3, "kills never landed inside a commit: the test is not testing crash safety"
