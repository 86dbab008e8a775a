"""Acceptance 3 — gc concurrent with commits: committer processes keep committing,
deleting and re-committing artifacts (re-commits reuse chunks that gc may just
have removed) while gc runs again and again with no grace period. No committed
artifact may ever lose data, and verify stays clean."""
from __future__ import annotations

import importlib.util
import os
import random
import signal
import time
from pathlib import Path

from aenv_store.admin.gc import gc
from aenv_store.admin.verify import verify
from aenv_store.errors import LockError, StoreNotFound
from aenv_store.repository.backends.posix_fs import PosixFsBackend
from aenv_store.repository.repository import Repository

ROUNDS = 3
ROUND_SECONDS = 6.0
COMMITTERS = 2


def _crash_helpers():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("aenv_admin_test_crash", Path(__file__).with_name("test_crash.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_committed(repo, journals: list[Path], helpers) -> int:  # type: ignore[no-untyped-def]
    """Every record whose commit returned and that no committer started deleting
    must exist and read back exactly (records may come and go meanwhile)."""
    present = set(repo.read_back())
    must = set()
    for j in journals:
        committed, deleting = helpers.journal_state(j)
        must |= committed - deleting
    # Records committed after read_back listed the catalog: check them one by one. One may
    # also be deleted meanwhile; that is not a loss if its committer journaled the deletion.
    for name in sorted(must - present):
        try:
            repo.read_back([name])
        except StoreNotFound:
            deleting = set().union(*(helpers.journal_state(j)[1] for j in journals))
            assert name in deleting, f"committed record lost: {name}"
    return len(must)


def test_gc_concurrent_with_committers(repo, aenv, wl) -> None:  # type: ignore[no-untyped-def]
    helpers = _crash_helpers()
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"gc concurrency seed {seed}")
    rng = random.Random(seed)
    script = Path(wl.__file__)
    journals = [repo.tmp / f"journal-{i}" for i in range(COMMITTERS)]
    gcs = freed = busy = 0
    for rnd in range(ROUNDS):
        procs = [helpers.start_committer(script, repo.data_dir, f"c{rnd}{i}", rng.getrandbits(32), journals[i],
                                         "--delete-prob", "0.4", "--recommit-prob", "0.6", "--pause", "0.3")
                 for i in range(COMMITTERS)]
        try:
            deadline = time.monotonic() + ROUND_SECONDS
            while time.monotonic() < deadline:
                try:
                    report = gc(Repository.open(PosixFsBackend(repo.path), "gc"), grace=0, lock_wait=1.0)
                except LockError:
                    busy += 1
                    continue
                gcs += 1
                freed += report.freed_bytes
                _check_committed(repo, journals, helpers)
                for p in procs:
                    assert p.poll() is None, p.communicate()[1].decode()[-3000:]
        finally:
            for p in procs:
                p.send_signal(signal.SIGKILL)
                p.communicate()
        r = aenv(repo.data_dir, "repo", "verify", "--read-data")
        assert r.rc == 0, f"round {rnd} (seed {seed}):\n{r.out}{r.err}"
        n = _check_committed(repo, journals, helpers)
    r = aenv(repo.data_dir, "repo", "gc", "--grace", "0")
    assert r.rc == 0, r.err
    report = verify(Repository.open(PosixFsBackend(repo.path), "v"), read_data=True)
    assert report.ok and report.unreferenced_packs == 0
    _check_committed(repo, journals, helpers)
    print(f"{gcs} gc runs ({busy} lock waits timed out) freed {freed} bytes next to {COMMITTERS} committers; "
          f"{n} live committed records checked")
    assert gcs >= 2 * ROUNDS and freed > 0
