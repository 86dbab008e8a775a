"""The read chain (aenv_store/chunks.py): node cache -> chunk sources -> repository
for every read, batched ones included; single flight across threads and
processes; the node cache consulted once per chunk; sources checked."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Mapping

import pytest

from aenv_store.formats.ids import Digest
from aenv_store.formats.index import IndexEntry
from aenv_store.store import Store

from tests.aenv_store.cache.cache_worker import release_and_collect
from .test_repository import write_blob

REPO_ROOT = Path(__file__).resolve().parents[3]


def count_repository_reads(store: Store, delay: float = 0.0) -> list[bytes]:
    """Every chunk ``store`` reads from its repository from now on (single and batched)."""
    fetched: list[bytes] = []
    lock = threading.Lock()
    repository = store.repository
    read_chunk, read_run = repository.read_chunk, repository.read_run

    def counting_read_chunk(chunk, *a, **k):  # type: ignore[no-untyped-def]
        with lock:
            fetched.append(bytes(chunk))
        threading.Event().wait(delay)
        return read_chunk(chunk, *a, **k)

    def counting_read_run(run: list[IndexEntry], *a, **k):  # type: ignore[no-untyped-def]
        with lock:
            fetched.extend(bytes(e.chunk) for e in run)
        threading.Event().wait(delay)
        return read_run(run, *a, **k)

    repository.read_chunk = counting_read_chunk  # type: ignore[method-assign]
    repository.read_run = counting_read_run  # type: ignore[method-assign]
    return fetched


@pytest.fixture
def blob(settings_factory) -> tuple[Digest, bytes, list[Digest]]:  # type: ignore[no-untyped-def]
    data = os.urandom(40 * 4096)
    with Store.open(settings_factory(), create=True) as store:
        mid = write_blob(store, data)
        cids = [e.chunk for e in store.load_manifest(mid).extents if e.chunk is not None]
    return mid, data, cids


def test_cold_batched_read_consults_the_node_cache_once_per_chunk(settings_factory, blob) -> None:  # type: ignore[no-untyped-def]
    mid, data, cids = blob
    with Store.open(settings_factory("cold")) as cold:
        cache = cold.cache
        assert cache is not None
        fetched = count_repository_reads(cold)
        before = cache.lookups
        assert cold.open_blob(mid).read(0, len(data)) == data
        assert cache.lookups - before == len(set(cids))              # once each, no second probe
        assert sorted(fetched) == sorted(bytes(c) for c in cids)
        st = cache.stats()
        assert (st.misses, st.fetches, st.entries) == (len(cids), len(cids), len(cids))
        before = cache.lookups
        assert cold.read_chunk(cids[0]) == data[:4096]               # a hit: one lookup
        assert cache.lookups - before == 1 and len(fetched) == len(cids)


def test_batched_reads_single_flight_across_threads(settings_factory, blob) -> None:  # type: ignore[no-untyped-def]
    mid, data, cids = blob
    with Store.open(settings_factory("cold")) as cold:
        fetched = count_repository_reads(cold, delay=0.05)
        results: list[bool] = []
        barrier = threading.Barrier(6)

        def reader(i: int) -> None:
            order = cids[::-1] if i % 2 else cids[:]
            barrier.wait()
            got = [d for lo in range(0, len(order), 8) for d in cold.read_chunks(order[lo:lo + 8])]
            results.append([Digest.of(d) for d in got] == order)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results == [True] * 6
        assert sorted(fetched) == sorted(bytes(c) for c in cids)     # each chunk once, for all six


def test_batched_reads_single_flight_across_processes(settings_factory, blob, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    mid, data, cids = blob
    node, log = tmp_path / "node", tmp_path / "reads.log"
    Store.open(settings_factory("node")).close()   # the node's data dir and cache exist
    log.touch()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.aenv_store.store.read_worker", str(node), str(tmp_path / "repo"),
                               mid.hex(), str(log), "2", "0.2"], cwd=REPO_ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    outs = release_and_collect(procs, timeout=120)
    assert [o.strip() for o in outs] == ["ok", "ok"]
    assert sorted(log.read_text().split()) == sorted(c.hex() for c in cids)   # each chunk once, both processes


class _Source:
    """A chunk source answering from a dict, one chunk with wrong content."""

    def __init__(self, chunks: Mapping[Digest, bytes], bad: Digest) -> None:
        self.chunks = dict(chunks)
        self.chunks[bad] = b"not this chunk"
        self.asked: list[list[Digest]] = []
        self.closed = False

    def fetch_many(self, cids: list[Digest]) -> dict[Digest, bytes]:
        self.asked.append(list(cids))
        return {c: self.chunks[c] for c in cids if c in self.chunks}

    def close(self) -> None:
        self.closed = True


def test_sources_come_before_the_repository_and_are_checked(settings_factory, blob) -> None:  # type: ignore[no-untyped-def]
    mid, data, cids = blob
    with Store.open(settings_factory("ref")) as ref:
        truth = dict(zip(cids, ref.read_chunks(cids)))
    have = {c: truth[c] for c in cids[:20]}
    with Store.open(settings_factory("cold")) as cold:
        source = _Source(have, bad=cids[5])
        cold.add_chunk_source(source)
        assert cold.chunk_sources == (source,)
        fetched = count_repository_reads(cold)
        assert cold.open_blob(mid).read(0, len(data)) == data
        assert source.asked and {c for batch in source.asked for c in batch} == set(cids)
        # the repository gave what the source lacked, and the chunk it got wrong
        assert sorted(fetched) == sorted(bytes(c) for c in cids[20:] + [cids[5]])
        assert cold.cache.get(cids[5]) == truth[cids[5]]  # type: ignore[union-attr]
    assert source.closed                                     # the store closes its sources


def test_uncached_reads_use_the_cache_but_do_not_fill_it(settings_factory, blob) -> None:  # type: ignore[no-untyped-def]
    mid, data, cids = blob
    with Store.open(settings_factory("cold")) as cold:
        assert cold.read_chunk(cids[0]) == data[:4096]
        fetched = count_repository_reads(cold)
        assert b"".join(cold.read_chunks(cids, cache=False)) == data
        assert cold.read_chunk_uncached(cids[1]) == data[4096:8192]
        assert bytes(cids[0]) not in fetched and cold.cache.stats().entries == 1  # type: ignore[union-attr]


def test_map_chunks_maps_node_cache_files_and_drops_bad_ones(settings_factory, blob) -> None:  # type: ignore[no-untyped-def]
    import mmap

    mid, data, cids = blob
    with Store.open(settings_factory("cold")) as cold:
        first = cold.map_chunks(cids[:3])
        assert all(isinstance(m, mmap.mmap) for m in first) and b"".join(first) == data[:3 * 4096]
        cache = cold.cache
        assert cache is not None
        loc = cache.location_of(cids[1])
        assert loc is not None
        with open(loc.path, "r+b") as f:   # tampered in place: same size, one byte flipped
            f.seek(loc.offset)
            f.write(bytes([data[4096] ^ 0xFF]))
        fetched = count_repository_reads(cold)
        again = cold.map_chunks(cids[:3])
        assert b"".join(again) == data[:3 * 4096]
        assert fetched == [bytes(cids[1])] and cache.stats().corrupt == 1
