"""Issue 29: the S3 backend under SIGKILL of a committing process, and a full disk
(bytes, then inodes) during a commit. After each, ``aenv repo verify --read-data``
is clean and every commit that returned reads back byte for byte."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest

from aenv_store.admin.verify import verify
from aenv_store.config import RepositoryConfig
from aenv_store.errors import StoreError
from aenv_store.repository.backends.factory import open_backend
from aenv_store.repository.repository import Repository

from tests.support import small_tmpfs

from .conftest import Repo, open_store, write_config, write_remote_config
from .test_crash import journal_state, start_committer

S3_ROUNDS = 8
# A kill lands inside a commit's publication (packs up, record not yet) about one time in
# four: rounds go on past S3_ROUNDS until one has, so the half-published case is always
# tried (eight rounds missed it once in CI)
S3_MAX_ROUNDS = 40


def test_s3_backend_sigkill_during_commits(moto, aenv, wl, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data_dir = tmp_path / "data"
    remote = moto.repository_config(moto.new_bucket())
    write_remote_config(data_dir, remote)
    open_store(data_dir, create=True).close()
    repo = Repo(data_dir, tmp_path, remote)
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"s3 crash test seed {seed}")
    rng = random.Random(seed)
    journal = tmp_path / "journal"
    script = Path(wl.__file__)
    interrupted = 0   # kills that left a half-published commit (what verify must tell apart from damage)
    rnd = 0
    while rnd < S3_ROUNDS or (not interrupted and rnd < S3_MAX_ROUNDS):
        proc = start_committer(script, data_dir, f"r{rnd}", rng.getrandbits(32), journal)
        # a commit takes 0.1-0.3 s here (staged locally, then published over HTTP): cut in the
        # first ones; a loaded machine stretches the staging, so the window is wide
        proc_wait = rng.uniform(0.1, 2.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=proc_wait)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        before = verify(Repository.open(open_backend(RepositoryConfig(**remote), data_dir), "test"))  # type: ignore[arg-type]
        interrupted += bool(before.unindexed_packs or before.unreferenced_packs or before.unreachable_manifests)
        r = aenv(data_dir, "repo", "verify")     # the data is read back below (and verified at the end)
        assert r.rc == 0, f"round {rnd} (seed {seed}): verify failed:\n{r.out}{r.err}"
        committed, deleting = journal_state(journal)
        lost = committed - deleting - set(repo.read_back())
        assert not lost, f"round {rnd} (seed {seed}): committed records vanished: {sorted(lost)}"
        rnd += 1
    r = aenv(data_dir, "repo", "gc", "--grace", "0")
    assert r.rc == 0, r.out + r.err
    r = aenv(data_dir, "repo", "verify", "--read-data")
    assert r.rc == 0, r.out + r.err
    committed, _ = journal_state(journal)
    print(f"{rnd} kills on S3, {len(committed)} commits journaled, {interrupted} inside a commit")
    assert committed and interrupted, "no kill landed inside a commit"


def fill_until_full(repo: Repo) -> tuple[list[str], Exception]:
    """Commit artifacts until one fails; returns the names committed and the failure."""
    names: list[str] = []
    with repo.store() as store:
        for seed in range(1000, 2000):
            try:
                names.append(repo.commit(store, seed, prefix="full", max_chunks=64))
            except (StoreError, OSError) as e:
                return names, e
    raise AssertionError("the repository never filled up")


BALLAST = 8    # files of 64 KiB the test removes to give the full disk some bytes and inodes back


@pytest.mark.parametrize("limit", ["size=3m", "size=64m,nr_inodes=160"], ids=["bytes", "inodes"])
def test_enospc_during_commit_leaves_a_clean_repository(aenv, tmp_path: Path, limit: str) -> None:  # type: ignore[no-untyped-def]
    with small_tmpfs(tmp_path / "mnt", limit) as mnt:
        ballast = [mnt / f"ballast-{i}" for i in range(BALLAST)]
        for b in ballast:
            b.write_bytes(os.urandom(64 << 10))
        data_dir = tmp_path / "data"
        write_config(data_dir)
        (mnt / "repo").mkdir()
        (data_dir / "repo").symlink_to(mnt / "repo")   # the repository on the small disk, the node cache not
        open_store(data_dir, create=True).close()
        repo = Repo(data_dir, tmp_path)
        names, error = fill_until_full(repo)
        print(f"{limit}: {len(names)} commits, then {type(error).__name__}: {error}")
        assert names, "nothing fitted: the limit is too small for the test"
        assert "No space left" in str(error) or getattr(error, "errno", 0) == 28, error
        # still full: verify reads, but takes the repository's lock (a file): with no inode
        # left it says so and changes nothing
        r = aenv(data_dir, "repo", "verify", "--read-data")
        assert r.rc == 0 or "No space left" in r.err, f"verify on the full repository:\n{r.out}{r.err}"
        assert sorted(repo.read_back(max_chunks=64)) == sorted(names)
        for b in ballast:        # some room again (as an operator would make)
            b.unlink()
        r = aenv(data_dir, "repo", "verify", "--read-data")
        assert r.rc == 0, f"verify after the full disk failed:\n{r.out}{r.err}"
        r = aenv(data_dir, "repo", "gc", "--grace", "0")
        assert r.rc == 0, r.out + r.err
        r = aenv(data_dir, "repo", "verify", "--read-data")
        assert r.rc == 0, r.out + r.err
        assert sorted(repo.read_back(max_chunks=64)) == sorted(names)
        with repo.store() as store:   # and the repository takes commits again
            repo.commit(store, 5000, prefix="after", max_chunks=8)
