"""posix_fs specifics beyond the shared backend contract (tests/aenv_store/backends):
key validation, temp files invisible and cleaned, move_file, create races."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from aenv_store.errors import AlreadyExists, BackendError, StoreNotFound
from aenv_store.repository.backends.posix_fs import PosixFsBackend


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../x", "a/../b", ".hidden", "a/.tmp-x", "sp ace", "a/"])
def test_bad_keys_rejected(tmp_path: Path, key: str) -> None:
    b = PosixFsBackend(tmp_path / "r")
    with pytest.raises(ValueError):
        b.put(key, b"x")


def test_tmp_files_are_invisible_and_cleaned(tmp_path: Path) -> None:
    b = PosixFsBackend(tmp_path / "r")
    b.put("packs/ab/x", b"data")
    stray = tmp_path / "r" / "packs" / "ab" / ".tmp-dead"
    stray.write_bytes(b"half")
    assert [i.key for i in b.list("packs/")] == ["packs/ab/x"]
    assert b.cleanup_tmp(older_than=3600) == 0  # young: maybe a live writer
    old = time.time() - 7200
    os.utime(stray, (old, old))
    assert b.cleanup_tmp(older_than=3600) == 1 and not stray.exists()


def test_move_file_consumes_source(tmp_path: Path) -> None:
    b = PosixFsBackend(tmp_path / "r")
    src = tmp_path / "pack"
    src.write_bytes(b"pack bytes")
    b.move_file("packs/00/p", src)
    assert not src.exists() and b.get("packs/00/p") == b"pack bytes"
    with pytest.raises(StoreNotFound):
        b.move_file("packs/00/q", src)


def test_get_range_bounds_and_list_prefix(tmp_path: Path) -> None:
    b = PosixFsBackend(tmp_path / "r")
    b.put("catalog/a", b"0123456789")
    b.put("catalog/ab", b"x")
    b.put("cat", b"y")
    assert b.get_range("catalog/a", 2, 3) == b"234"
    with pytest.raises(BackendError):
        b.get_range("catalog/a", 8, 5)
    assert sorted(i.key for i in b.list("catalog/a")) == ["catalog/a", "catalog/ab"]
    assert sorted(i.key for i in b.list("cat")) == ["cat", "catalog/a", "catalog/ab"]
    assert list(b.list("nothing/")) == []


def test_create_race_threads(tmp_path: Path) -> None:
    b = PosixFsBackend(tmp_path / "r")
    wins: list[int] = []
    start = threading.Barrier(8)

    def go(i: int) -> None:
        start.wait()
        try:
            b.create("catalog/x", str(i).encode())
            wins.append(i)
        except AlreadyExists:
            pass

    ts = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(wins) == 1 and b.get("catalog/x") == str(wins[0]).encode()
    assert [p.name for p in (tmp_path / "r" / "catalog").iterdir()] == ["x"]  # no temp left behind
