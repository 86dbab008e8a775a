"""The Backend contract (aenv_store/repository/backends/base.py), checked on every backend:
posix_fs on a temp dir and oss on a real moto S3 server process."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_store.config import RepositoryConfig
from aenv_store.errors import AlreadyExists, BackendError, StoreNotFound
from aenv_store.repository.backends.base import Backend
from aenv_store.repository.backends.factory import open_backend


def test_put_get_overwrite(backend: Backend) -> None:
    backend.put("a/b/c", b"hello")
    assert backend.get("a/b/c") == b"hello"
    backend.put("a/b/c", b"world!")
    assert backend.get("a/b/c") == b"world!"
    info = backend.stat("a/b/c")
    assert info.key == "a/b/c" and info.size == 6 and info.mtime > 0


def test_empty_object(backend: Backend) -> None:
    backend.put("empty", b"")
    assert backend.get("empty") == b""
    assert backend.stat("empty").size == 0
    assert backend.exists("empty")


def test_missing_keys_raise_not_found(backend: Backend) -> None:
    with pytest.raises(StoreNotFound):
        backend.get("nope/x")
    with pytest.raises(StoreNotFound):
        backend.get_range("nope/x", 0, 1)
    with pytest.raises(StoreNotFound):
        backend.stat("nope/x")
    with pytest.raises(StoreNotFound):
        backend.open_stream("nope/x")
    assert not backend.exists("nope/x")
    backend.delete("nope/x")  # deleting a missing key is not an error


def test_get_range(backend: Backend) -> None:
    data = bytes(range(256)) * 40
    backend.put("r", data)
    assert backend.get_range("r", 0, 10) == data[:10]
    assert backend.get_range("r", 1000, 2000) == data[1000:3000]
    assert backend.get_range("r", len(data) - 1, 1) == data[-1:]
    assert backend.get_range("r", 5, 0) == b""
    with pytest.raises(BackendError):
        backend.get_range("r", len(data) - 5, 10)  # runs past the end
    with pytest.raises(BackendError):
        backend.get_range("r", len(data) + 100, 10)  # starts past the end
    with pytest.raises(BackendError):
        backend.get_range("r", -1, 10)


def test_open_stream(backend: Backend) -> None:
    data = os.urandom(300_000)
    backend.put("s/x", data)
    stream = backend.open_stream("s/x")
    try:
        got = b"".join(iter(lambda: stream.read(65536), b""))
    finally:
        stream.close()
    assert got == data


def test_list_and_delete(backend: Backend) -> None:
    for k in ("packs/aa/1", "packs/aa/2", "packs/bb/3", "index/x", "packsx"):
        backend.put(k, k.encode())
    assert sorted(i.key for i in backend.list("packs/")) == ["packs/aa/1", "packs/aa/2", "packs/bb/3"]
    assert sorted(i.key for i in backend.list("packs/aa/")) == ["packs/aa/1", "packs/aa/2"]
    assert sorted(i.key for i in backend.list("packs")) == ["packs/aa/1", "packs/aa/2", "packs/bb/3", "packsx"]
    assert {i.key: i.size for i in backend.list()} == {
        "packs/aa/1": 10, "packs/aa/2": 10, "packs/bb/3": 10, "index/x": 7, "packsx": 6}
    assert list(backend.list("nothing/")) == []
    backend.delete("packs/aa/1")
    assert not backend.exists("packs/aa/1")
    assert sorted(i.key for i in backend.list("packs/")) == ["packs/aa/2", "packs/bb/3"]


def test_create_is_exclusive(backend: Backend) -> None:
    backend.create("catalog/snap-1", b"first")
    with pytest.raises(AlreadyExists):
        backend.create("catalog/snap-1", b"second")
    assert backend.get("catalog/snap-1") == b"first"
    # create leaves nothing else visible (oss claim objects are hidden and withdrawn)
    assert [i.key for i in backend.list()] == ["catalog/snap-1"]
    backend.delete("catalog/snap-1")
    backend.create("catalog/snap-1", b"again")
    assert backend.get("catalog/snap-1") == b"again"


def test_put_file(backend: Backend, tmp_path: Path) -> None:
    src = tmp_path / "pack"
    data = os.urandom(3 * 1024 * 1024 + 123)
    src.write_bytes(data)
    backend.put_file("packs/ab/p", src)
    assert backend.stat("packs/ab/p").size == len(data)
    assert backend.get_range("packs/ab/p", 2 * 1024 * 1024, 4096) == data[2 * 1024 * 1024:2 * 1024 * 1024 + 4096]
    assert backend.get("packs/ab/p") == data


def test_move_file_and_cleanup_are_part_of_every_backend(backend: Backend, tmp_path: Path) -> None:
    """No capability probing: every backend moves a file in (posix_fs by renaming it,
    the others by copying) and cleans up after crashed writers (nothing to do on S3)."""
    src = tmp_path / "pack"
    data = os.urandom(1024 * 1024 + 7)
    src.write_bytes(data)
    backend.move_file("packs/cd/moved", src)
    assert backend.get("packs/cd/moved") == data
    removed = backend.cleanup_tmp(older_than=0.0)
    assert isinstance(removed, int) and removed >= 0
    assert backend.get("packs/cd/moved") == data        # a finished object is not a temp file


def test_invalid_keys_rejected(backend: Backend) -> None:
    for bad in ("", "/abs", "a//b", "a/../b", ".hidden", "a/.tmp", "sp ace"):
        with pytest.raises(ValueError):
            backend.put(bad, b"x")


def test_concurrent_create_threads_one_winner(backend: Backend) -> None:
    """Many threads race create() on the same keys: exactly one wins each key."""
    n_threads, n_keys = 12, 4
    for k in range(n_keys):
        key = f"catalog/race-{k}"
        barrier = threading.Barrier(n_threads)
        wins: list[int] = []
        losses: list[int] = []
        errors: list[BaseException] = []

        def go(i: int) -> None:
            barrier.wait()
            try:
                backend.create(key, f"winner {i}".encode())
                wins.append(i)
            except AlreadyExists:
                losses.append(i)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(wins) == 1, (key, wins)
        assert len(losses) == n_threads - 1
        assert backend.get(key) == f"winner {wins[0]}".encode()


_RACER = """
import dataclasses, json, sys, time
from pathlib import Path
from aenv_store.config import RepositoryConfig
from aenv_store.errors import AlreadyExists
from aenv_store.repository.backends.factory import open_backend
cfg = RepositoryConfig(**json.loads(sys.argv[1]))
b = open_backend(cfg, Path(sys.argv[2]))
b.exists("warm-up")  # connect before the start line
go = Path(sys.argv[4])
while not go.exists():
    time.sleep(0.001)
try:
    b.create(sys.argv[3], sys.argv[5].encode())
    print("won")
except AlreadyExists:
    print("lost")
b.close()
"""


def test_concurrent_create_processes_one_winner(repository_config: RepositoryConfig, tmp_path: Path) -> None:
    """Separate processes (separate connections, as separate nodes would be) race one key."""
    n = 6
    cfg = json.dumps(dataclasses.asdict(repository_config))
    for round_ in range(2):
        key = f"catalog/proc-race-{round_}"
        go = tmp_path / f"go-{round_}"
        procs = [subprocess.Popen([sys.executable, "-c", _RACER, cfg, str(tmp_path), key, str(go), f"proc {i}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(n)]
        time.sleep(1.5)  # let every racer import and connect
        go.touch()
        results = {}
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
            results[i] = out.decode().strip()
        assert sorted(results.values()).count("won") == 1, results
        assert all(v in ("won", "lost") for v in results.values()), results
        winner = next(w for w, v in results.items() if v == "won")
        b = open_backend(repository_config, tmp_path)
        assert b.get(key) == f"proc {winner}".encode()
        b.close()


_segments = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=_segments.map(lambda s: f"hyp/{s}"),
       data=st.binary(max_size=5000), offset=st.integers(0, 6000), length=st.integers(0, 6000))
def test_range_reads_match_slices(backend: Backend, key: str, data: bytes, offset: int, length: int) -> None:
    backend.put(key, data)
    if offset + length <= len(data):
        assert backend.get_range(key, offset, length) == data[offset:offset + length]
    elif length > 0:
        with pytest.raises(BackendError):
            backend.get_range(key, offset, length)
    backend.delete(key)
