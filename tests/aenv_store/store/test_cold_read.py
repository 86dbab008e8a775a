"""The cold read path: a pack run decoded in parts on a pool (every chunk still
checked against its BLAKE3 id), and BlobReader's read-ahead of sequential reads
(same read chain: node cache, single flight, verification; errors reach the caller)."""
from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_store import store as store_mod
from aenv_store.errors import CorruptData, StoreNotFound
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest
from aenv_store.repository.repository import coalesce, pack_key
from aenv_store.store import Store

from .conftest import make_settings
from .test_read_chain import count_repository_reads
from .test_repository import write_blob

CHUNK = 4096


def _chunk(kind: int, seed: int) -> bytes:
    """A 4 KiB chunk: 0 compressible text, 1 random (stored raw), 2 short (a tail)."""
    rnd = os.urandom(CHUNK)
    if kind == 0:
        return (b"%d:" % seed + bytes(rnd[:32].hex(), "ascii")) * (CHUNK // 66) + b"x" * (CHUNK % 66)
    if kind == 1:
        return rnd
    return rnd[: 1 + seed % (CHUNK - 1)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.integers(0, 1), min_size=1, max_size=40), tail=st.booleans(),
       part_bytes=st.sampled_from([1, CHUNK, 3 * CHUNK + 1, 1 << 20]),
       corrupt=st.one_of(st.none(), st.integers(0, 10_000)))
def test_run_decoded_in_parts_equals_sequential_decode(kinds: list[int], tail: bool, part_bytes: int,
                                                        corrupt: int | None) -> None:
    data = b"".join(_chunk(k, i) for i, k in enumerate(kinds)) + (_chunk(2, len(kinds)) if tail else b"")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(3) as pool:
        tmp_path = Path(tmp)
        with Store.open(make_settings(tmp_path / "w", tmp_path / "repo"), create=True) as store:
            mid = write_blob(store, data)
        with Store.open(make_settings(tmp_path / "r", tmp_path / "repo")) as cold:
            repo = cold.repository
            cids = [e.chunk for e in cold.load_manifest(mid).extents if e.chunk is not None]
            entries = [repo.lookup(c) for c in dict.fromkeys(cids)]
            assert all(e is not None for e in entries)
            runs = coalesce([e for e in entries if e is not None])
            want = {bytes(e.chunk): got for run in runs for e, got in zip(run, repo.read_run(run))}
            bad: bytes | None = None
            # Flip one payload byte: that chunk fails with CorruptData naming it and its pack,
            # or, where the flip lands on a bit zstd does not use (seen: byte 16 of a 4 KiB
            # text chunk's frame), decodes to exactly its bytes; wrong bytes never come back.
            if corrupt is not None:
                victim = entries[corrupt % len(entries)]
                assert victim is not None
                path = tmp_path / "repo" / pack_key(victim.pack)
                raw = bytearray(path.read_bytes())
                raw[victim.offset + corrupt % victim.length] ^= 0x20
                path.write_bytes(bytes(raw))
                bad = bytes(victim.chunk)
            for run in runs:
                try:
                    got = repo.read_run(run, pool=pool, part_bytes=part_bytes)
                except CorruptData as err:
                    assert bad is not None and any(bytes(e.chunk) == bad for e in run)
                    assert bad.hex() in str(err) and bytes(run[0].pack).hex() in str(err)
                    continue
                assert [type(g) for g in got] == [bytes] * len(run)
                assert got == [want[bytes(e.chunk)] for e in run]
                assert all(Digest.of(g) == e.chunk for g, e in zip(got, run))


def _blob(settings_factory, chunks: int) -> tuple[Digest, bytes]:  # type: ignore[no-untyped-def]
    data = os.urandom(chunks * CHUNK)
    with Store.open(settings_factory(), create=True) as store:
        return write_blob(store, data), data


def _until(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_sequential_reads_read_ahead_through_the_cache(settings_factory) -> None:  # type: ignore[no-untyped-def]
    window = 8 * CHUNK
    mid, data = _blob(settings_factory, 8 * 8 + 3)  # 8 windows and a short last one
    with Store.open(settings_factory("cold")) as cold:
        fetched = count_repository_reads(cold)
        reader = cold.open_blob(mid)
        cids = [e.chunk for e in reader.extents() if e.chunk is not None]
        assert reader.read(0, window) == data[:window]
        assert not reader._ahead  # one read is not a sequential reader yet
        assert reader.read(window, window) == data[window:2 * window]
        ahead = cids[16:16 + 8 * store_mod.READ_AHEAD]
        # the next READ_AHEAD windows arrive in the node cache without being asked for ...
        assert _until(lambda: all(cold.cache.contains(c) for c in ahead))  # type: ignore[union-attr]
        assert not any(cold.cache.contains(c) for c in cids[16 + 8 * store_mod.READ_AHEAD:])  # type: ignore[union-attr]
        # ... and the whole sequential read fetches every chunk exactly once
        for off in range(2 * window, len(data), window):
            assert reader.read(off, window) == data[off:off + window]
        assert reader.read(len(data), window) == b""
        assert sorted(fetched) == sorted(bytes(c) for c in cids)


def test_a_seek_drops_the_windows_read_ahead(settings_factory) -> None:  # type: ignore[no-untyped-def]
    window = 4 * CHUNK
    mid, data = _blob(settings_factory, 64)
    with Store.open(settings_factory("cold")) as cold:
        reader = cold.open_blob(mid)
        assert reader.read(0, window) == data[:window]
        assert reader.read(40 * CHUNK + 5, window) == data[40 * CHUNK + 5:44 * CHUNK + 5]  # a seek
        assert set(reader._ahead) == set()  # not sequential: nothing is read ahead of it
        assert reader.read(44 * CHUNK + 5, window) == data[44 * CHUNK + 5:48 * CHUNK + 5]
        assert {k[0] for k in reader._ahead} == {48 * CHUNK + 5 + i * window for i in range(store_mod.READ_AHEAD)}
        assert reader.read(10, 100) == data[10:110]
        assert set(reader._ahead) == set()


def test_uncached_reader_reads_ahead_without_filling_the_cache(settings_factory) -> None:  # type: ignore[no-untyped-def]
    mid, data = _blob(settings_factory, 32)
    with Store.open(settings_factory("cold")) as cold:
        reader = cold.open_blob(mid, cache=False)
        out = b"".join(reader.read(off, 4 * CHUNK) for off in range(0, len(data), 4 * CHUNK))
        assert out == data
        assert cold.cache.stats().entries == 0  # type: ignore[union-attr]


def test_an_error_read_ahead_is_retried_by_the_caller(settings_factory) -> None:  # type: ignore[no-untyped-def]
    """A window that failed in the background is read again on the caller's thread:
    a passing failure is not the caller's, a lasting one is raised there."""
    window = 4 * CHUNK
    mid, data = _blob(settings_factory, 16)
    with Store.open(settings_factory("cold")) as cold:
        repo = cold.repository
        read_run = repo.read_run
        main = threading.get_ident()
        failed: list[int] = []

        def flaky(run, *a, **k):  # type: ignore[no-untyped-def]
            if threading.get_ident() != main and not failed:
                failed.append(run[0].offset)
                raise OSError("transient")
            return read_run(run, *a, **k)

        repo.read_run = flaky  # type: ignore[method-assign]
        reader = cold.open_blob(mid)
        out = b"".join(reader.read(off, window) for off in range(0, len(data), window))
        assert out == data and failed


def test_delta_gap_is_raised_to_the_caller_even_when_read_ahead(settings_factory) -> None:  # type: ignore[no-untyped-def]
    mid, data = _blob(settings_factory, 16)
    with Store.open(settings_factory("cold")) as cold:
        full = cold.load_manifest(mid)
        # a delta holding chunks 0-3 and 8-15: [4, 8) is the parent's
        extents = tuple(e for e in full.extents if not 4 * CHUNK <= e.offset < 8 * CHUNK)
        delta = Manifest(full.media_type, full.size, extents, parent=mid, chunk_size=full.chunk_size)
        reader = cold.open_blob(delta)
        assert reader.read(0, 4 * CHUNK) == data[:4 * CHUNK]
        with pytest.raises(StoreNotFound, match="delta manifest"):
            reader.read(4 * CHUNK, 4 * CHUNK)
        assert reader.read(8 * CHUNK, 4 * CHUNK) == data[8 * CHUNK:12 * CHUNK]


def test_close_with_reads_ahead_in_flight(settings_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    mid, data = _blob(settings_factory, 64)
    monkeypatch.setattr(store_mod, "READ_AHEAD", 4)
    cold = Store.open(settings_factory("cold"))
    fetched = count_repository_reads(cold, delay=0.2)  # slow repository: the windows are still queued
    reader = cold.open_blob(mid)
    assert reader.read(0, 4 * CHUNK) == data[:4 * CHUNK]
    assert reader.read(4 * CHUNK, 4 * CHUNK) == data[4 * CHUNK:8 * CHUNK]
    assert len(reader._ahead) == 4
    t0 = time.monotonic()
    cold.close()
    assert time.monotonic() - t0 < 5          # queued windows are cancelled, running ones finish
    assert len(fetched) < 64                   # not the whole blob
    assert cold._read_ahead(lambda: b"") is None


def test_extents_of_zero_runs_are_not_read(settings_factory) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(4 * CHUNK) + bytes(16 * CHUNK) + os.urandom(4 * CHUNK)
    with Store.open(settings_factory(), create=True) as store:
        mid = write_blob(store, data)
    with Store.open(settings_factory("cold")) as cold:
        fetched = count_repository_reads(cold)
        reader = cold.open_blob(mid)
        assert b"".join(reader.read(off, 3 * CHUNK) for off in range(0, len(data), 3 * CHUNK)) == data
        assert len(fetched) == 8 and all(isinstance(e, Extent) for e in reader.extents())


def test_an_export_of_read_parts_is_the_blob_and_fills_the_cache(settings_factory, tmp_path,  # type: ignore[no-untyped-def]
                                                                  monkeypatch) -> None:
    """write_parts over BlobReader.read_parts (two reader threads, windows of several
    chunks, a short last one): the file is the blob, every chunk was fetched once and
    is in the node cache afterwards; read_parts itself reads nothing ahead."""
    from aenv_store import export
    monkeypatch.setattr(export, "BLOCK", 8 * CHUNK)
    mid, data = _blob(settings_factory, 8 * 8 + 3)
    with Store.open(settings_factory("cold")) as cold:
        fetched = count_repository_reads(cold)
        reader = cold.open_blob(mid)
        assert b"".join(reader.read_parts(CHUNK + 7, 3 * CHUNK)) == data[CHUNK + 7:4 * CHUNK + 7]
        assert reader.read_parts(len(data), 10) == [] and not reader._ahead
        with pytest.raises(ValueError):
            reader.read_parts(-1, 10)
        out = tmp_path / "blob.raw"
        export.write_parts(reader.read_parts, reader.size, out, readers=2)
        assert out.read_bytes() == data
        cids = [e.chunk for e in reader.extents() if e.chunk is not None]
        assert sorted(fetched) == sorted(set(bytes(c) for c in cids))
        cold.cache.drain()  # type: ignore[union-attr]
        assert all(cold.cache.contains(c) for c in cids)  # type: ignore[union-attr]
