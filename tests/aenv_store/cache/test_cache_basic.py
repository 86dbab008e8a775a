"""Node cache behaviour in one process: round trip, LRU order, pins, integrity,
persistence across reopen, the free-disk floor, configuration errors."""
from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import sys
from pathlib import Path
from typing import Iterator

import blake3
import lmdb
import pytest

from aenv_store.cache.files import SegmentFiles
from aenv_store.cache.node_cache import Location, NodeCache
from aenv_store.cache.segments import SegmentWriter, read_header
from aenv_store.config import CacheConfig
from aenv_store.errors import ConfigError, StoreError
from aenv_store.formats.ids import Digest
from tests.support import small_tmpfs

S = 65536


def chunk(seed: int, size: int) -> bytes:
    """Deterministic content (the same function as tests/aenv_store/cache/cache_worker.py)."""
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


def cfg(capacity: int, **kw: object) -> CacheConfig:
    kw.setdefault("min_free_disk", 0)
    return CacheConfig(capacity=capacity, **kw)  # type: ignore[arg-type]


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[NodeCache]:
    c = NodeCache(tmp_path / "cache", cfg(10 * S))
    yield c
    c.close()


def chunks(n: int, size: int = S, base: int = 0) -> list[tuple[Digest, bytes]]:
    out = []
    for i in range(n):
        data = chunk(base + i, size)
        out.append((Digest.of(data), data))
    return out


def read_at(loc: Location) -> bytes:
    with open(loc.path, "rb") as f:
        return os.pread(f.fileno(), loc.size, loc.offset)


def segments_by_digest(directory: Path) -> dict[bytes, tuple[str, int]]:
    """digest -> (segment file, offset), from the segments' own headers."""
    out = {}
    for path in (directory / "data").glob("*/*.seg"):
        for item in read_header(str(path)):
            out[item.digest] = (str(path), item.offset)
    return out


def test_put_get_roundtrip_and_counters(cache: NodeCache) -> None:
    (d1, b1), (d2, b2) = chunks(2, 1000)
    assert cache.get(d1) is None
    assert cache.put(d1, b1)
    assert cache.get(d1) == b1
    assert cache.contains(d1) and not cache.contains(d2)
    loc = cache.location_of(d1)
    assert loc is not None and read_at(loc) == b1
    assert cache.location_of(d2) is None
    st = cache.stats()
    assert (st.entries, st.used_bytes, st.hits, st.misses, st.fetches, st.evictions) == (1, 1000, 1, 1, 0, 0)


def test_empty_chunk_and_duplicate_put(cache: NodeCache) -> None:
    empty = Digest.of(b"")
    assert cache.put(empty, b"")
    assert cache.get(empty) == b""
    (d, b), = chunks(1)
    assert cache.put(d, b) and cache.put(d, b)
    st = cache.stats()
    assert (st.entries, st.used_bytes) == (2, S)


def test_lru_order_and_watermarks(cache: NodeCache) -> None:
    # capacity 10 chunks, high 0.95, low 0.80: the 10th put evicts down to 8 chunks incl. itself
    cs = chunks(10)
    for d, b in cs[:9]:
        assert cache.put(d, b)
    assert cache.stats().evictions == 0
    assert cache.get(cs[0][0]) == cs[0][1]  # 0 and 1 become most recently used
    assert cache.get(cs[1][0]) == cs[1][1]
    assert cache.put(*cs[9])
    present = [i for i, (d, _) in enumerate(cs) if cache.contains(d)]
    assert present == [0, 1, 4, 5, 6, 7, 8, 9]
    st = cache.stats()
    assert (st.evictions, st.evicted_bytes, st.used_bytes) == (2, 2 * S, 8 * S)
    assert cache.verify(read_data=True) == []


def test_pinned_entries_survive_eviction(cache: NodeCache) -> None:
    cs = chunks(40)
    late = cs[5]
    cache.pin([cs[0][0], cs[1][0], late[0]])  # late is pinned before it is cached
    for d, b in cs[:5]:
        cache.put(d, b)
    cache.put(*late)
    for d, b in cs[6:]:
        assert cache.put(d, b)
        assert cache.stats().used_bytes <= 10 * S
    for d, b in (cs[0], cs[1], late):
        assert cache.get(d) == b
    st = cache.stats()
    assert (st.pinned, st.pinned_bytes) == (3, 3 * S)
    cache.unpin([cs[0][0]])
    cache.unpin([cs[0][0]])  # an extra unpin is ignored
    for d, b in chunks(12, base=100):
        cache.put(d, b)
    assert not cache.contains(cs[0][0])
    assert cache.contains(cs[1][0]) and cache.contains(late[0])


def test_put_refused_when_everything_is_pinned(cache: NodeCache) -> None:
    cs = chunks(11)
    for d, b in cs[:10]:
        cache.pin([d])
        cache.put(d, b)
    assert cache.stats().used_bytes <= 10 * S
    assert not cache.put(*cs[10])  # no room: nothing evictable
    assert cache.stats().used_bytes <= 10 * S
    assert cache.get_or_fetch(cs[10][0], lambda: cs[10][1]) == cs[10][1]  # still served
    big = chunk(999, 11 * S)
    assert not cache.put(Digest.of(big), big)  # larger than the whole cache


def test_reopen_keeps_entries_and_counters(tmp_path: Path) -> None:
    cs = chunks(5, 5000)
    with NodeCache(tmp_path / "c", cfg(10 * S)) as c:
        for d, b in cs:
            c.put(d, b)
        c.get(cs[0][0])
        c.get(Digest.of(b"missing"))
        c.pin([cs[1][0]])  # released by close
    with NodeCache(tmp_path / "c", cfg(10 * S)) as c:
        assert all(c.get(d) == b for d, b in cs)
        st = c.stats()
        assert (st.entries, st.used_bytes, st.pinned) == (5, 25000, 0)
        assert (st.hits, st.misses) == (6, 1)  # counters are persisted
        assert c.verify(read_data=True) == []


def test_lower_capacity_on_reopen_evicts(tmp_path: Path) -> None:
    with NodeCache(tmp_path / "c", cfg(10 * S)) as c:
        for d, b in chunks(9):
            c.put(d, b)
    with NodeCache(tmp_path / "c", cfg(4 * S)) as c:
        st = c.stats()
        assert st.used_bytes <= 0.8 * 4 * S and st.evictions == 6


def test_corrupt_or_truncated_file_is_a_miss(cache: NodeCache) -> None:
    (d1, b1), (d2, b2) = chunks(2)
    cache.put(d1, b1)
    cache.put(d2, b2)
    l1, l2 = cache.location_of(d1), cache.location_of(d2)
    assert l1 is not None and l2 is not None
    with open(l1.path, "r+b") as f:  # same size, one byte flipped
        f.seek(l1.offset + 100)
        f.write(bytes([b1[100] ^ 1]))
    os.truncate(l2.path, l2.offset + 10)
    assert cache.get(d1) is None and cache.get(d2) is None
    assert not cache.contains(d1) and not Path(l1.path).exists()  # its segment had no other chunk
    st = cache.stats()
    assert (st.corrupt, st.entries, st.used_bytes) == (2, 0, 0)
    assert cache.get_or_fetch(d1, lambda: b1) == b1  # refetched and cached again
    assert cache.get(d1) == b1


def test_missing_file_is_a_miss_and_heals(cache: NodeCache) -> None:
    (d, b), = chunks(1)
    cache.put(d, b)
    loc = cache.location_of(d)
    assert loc is not None
    os.unlink(loc.path)
    assert cache.get(d) is None
    assert cache.stats().entries == 0
    assert cache.put(d, b) and cache.get(d) == b


def test_two_instances_in_one_process_share_the_directory(cache: NodeCache) -> None:
    (d1, b1), (d2, b2) = chunks(2)
    other = NodeCache(cache.path, cfg(10 * S))
    try:
        cache.put(d1, b1)
        assert other.get(d1) == b1
        other.pin([d2])
        assert cache.stats().pinned == 0 and other.put(d2, b2)
        assert cache.stats().pinned == 1
        cache.unpin([d2])  # not pinned by this instance: ignored
        assert other.stats().pinned == 1
    finally:
        other.close()
    assert cache.stats().pinned == 0  # released by close
    assert cache.get(d2) == b2  # the shared environment is still open
    closed = NodeCache(cache.path.parent / "other", cfg(S))
    closed.close()
    closed.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        closed.get(Digest.of(b"x"))


@pytest.mark.parametrize("bad, key", [
    (dict(capacity=0), "capacity"),
    (dict(capacity=S, low_watermark=0.9, high_watermark=0.5), "watermark"),
    (dict(capacity=S, high_watermark=1.5), "watermark"),
    (dict(capacity=S, min_free_disk=-1), "min_free_disk"),
])
def test_bad_config_is_a_clear_error(tmp_path: Path, bad: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        NodeCache(tmp_path / "c", CacheConfig(**bad))


def test_unusable_index_is_rebuilt_when_alone(tmp_path: Path) -> None:
    with NodeCache(tmp_path / "c", cfg(10 * S)) as c:
        for d, b in chunks(3):
            c.put(d, b)
    (tmp_path / "c" / "index" / "data.mdb").write_bytes(b"garbage" * 1000)
    with NodeCache(tmp_path / "c", cfg(10 * S)) as c:  # a cache may always start empty
        assert c.stats().entries == 0
        assert c.verify() == []


def test_usable_from_asyncio(cache: NodeCache) -> None:
    cs = chunks(8, 4096)

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(None, cache.get_or_fetch, d, (lambda b=b: b))
                                      for d, b in cs))

    assert asyncio.run(main()) == [b for _, b in cs]
    assert cache.stats().entries == 8


def test_free_disk_floor(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "size=8m") as mnt:
        floor = 4 << 20
        # capacity is far above what the disk holds: only the floor can bound the cache
        with NodeCache(mnt / "c", cfg(64 << 20, min_free_disk=floor)) as c:
            cs = chunks(80, base=500)
            for d, b in cs:
                c.put(d, b)
                st = os.statvfs(mnt)
                assert st.f_bavail * st.f_frsize >= floor - S
            st2 = c.stats()
            assert st2.evictions > 0 and st2.entries > 0
            assert c.contains(cs[-1][0])  # the newest are kept
            assert c.verify() == []


WORKER = Path(__file__).with_name("cache_worker.py")


def leave_dirty(directory: Path, n: int) -> list[tuple[Digest, bytes]]:
    """A process that puts n chunks of 4 KiB, pins the first and dies without closing."""
    subprocess.run([sys.executable, str(WORKER), "dirty", str(directory), str(10 * S), str(n)],
                   check=True, timeout=60)
    return [(Digest.of(chunk(i, 4096)), chunk(i, 4096)) for i in range(n)]


def test_first_user_after_a_crash_reconciles(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    items = leave_dirty(directory, 6)
    data_dir = directory / "data"
    segs = segments_by_digest(directory)
    os.unlink(segs[items[1][0]][0])                                      # entry without file
    os.truncate(segs[items[2][0]][0], segs[items[2][0]][1] + 100)        # too short for the entry
    orphan = chunk(77, 4096)
    orphan_path = SegmentFiles(str(data_dir)).path(0x1234_5678_9ABC_DEF0)
    SegmentWriter().write(orphan_path, [(Digest.of(orphan), orphan, 0)], direct=False)  # file without entry
    (data_dir / "00" / "not-a-segment").write_bytes(b"junk")
    with NodeCache(directory, cfg(10 * S)) as c:
        assert c.verify(read_data=True) == []
        st = c.stats()
        assert (st.entries, st.used_bytes, st.pinned) == (4, 4 * 4096, 0)  # the dead user's pin is gone
        assert not Path(orphan_path).exists() and not (data_dir / "00" / "not-a-segment").exists()
        for i, (d, b) in enumerate(items):
            assert c.get(d) == (None if i in (1, 2) else b)


def set_meta(directory: Path, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(directory / "index"), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(b"meta", txn=txn))
    finally:
        env.close()


def test_host_restart_after_unclean_stop_starts_empty(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    leave_dirty(directory, 3)
    set_meta(directory, b"boot_id", b"an-earlier-boot")  # as if the host went down meanwhile
    with NodeCache(directory, cfg(10 * S)) as c:
        assert c.stats().entries == 0
        assert c.verify() == []
    assert not [f for f in (directory / "data").rglob("*") if f.is_file()]


def test_host_restart_after_clean_close_keeps_entries(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    items = chunks(3, 4096)
    with NodeCache(directory, cfg(10 * S)) as c:
        for d, b in items:
            c.put(d, b)
    set_meta(directory, b"boot_id", b"an-earlier-boot")
    with NodeCache(directory, cfg(10 * S)) as c:
        assert all(c.get(d) == b for d, b in items)


def test_instance_inherited_across_fork_refuses_work(cache: NodeCache) -> None:
    (d, b), = chunks(1)
    cache.put(d, b)
    pid = os.fork()
    if pid == 0:  # child: the inherited instance must refuse to touch the parent's LMDB handles
        code = 1
        try:
            try:
                cache.get(d)
            except StoreError as e:
                if "fork" in str(e):
                    cache.close()  # a no-op for an inherited instance
                    try:  # py-lmdb cannot reopen the parent's environment: a clear error, no damage
                        NodeCache(cache.path, cfg(10 * S)).close()
                        code = 2
                    except StoreError as e2:
                        code = 0 if "fork" in str(e2) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert cache.get(d) == b  # the parent's instance is unaffected
    assert cache.verify() == []


def test_a_batch_is_one_segment_evicted_together_unless_pinned(tmp_path: Path) -> None:
    """Format 2: a put_many (or one fill of misses) is one segment file; eviction takes the
    unpinned chunks of a segment together, and a pinned one keeps the file (and itself)."""
    with NodeCache(tmp_path / "c", cfg(8 * S)) as c:
        a, b = chunks(3), chunks(3, base=100)
        assert all(c.put_many(a)) and all(c.put_many(b))
        segs = {c.location_of(d, touch=False).path for d, _ in a}  # type: ignore[union-attr]
        assert len(segs) == 1 and len(list((c.path / "data").glob("*/*.seg"))) == 2
        c.pin([a[1][0]])
        c.get(b[0][0])  # b is more recent than a
        assert all(c.put_many(chunks(3, base=200)))  # above the high watermark: a's segment goes first
        st = c.stats()
        assert c.contains(a[1][0]) and not c.contains(a[0][0]) and not c.contains(a[2][0])
        assert Path(segs.pop()).exists()  # its pinned member keeps the file
        assert c.get(a[1][0]) == a[1][1] and c.verify(read_data=True) == []
        path = c.location_of(a[1][0], touch=False).path  # type: ignore[union-attr]
        c.unpin([a[1][0]])
        for base in (300, 400, 500):
            assert all(c.put_many(chunks(3, base=base)))
        assert not c.contains(a[1][0]) and not Path(path).exists()  # its last member gone: unlinked
        assert c.verify(read_data=True) == []


def test_put_many_one_batch_with_duplicates_oversize_and_eviction(tmp_path: Path) -> None:
    with NodeCache(tmp_path / "c", cfg(4 * S)) as c:
        items = chunks(6)
        big = b"x" * (5 * S)
        batch = [items[0], items[1], items[0], (Digest.of(big), big), *items[2:]]
        ok = c.put_many(batch)
        # duplicate stored once; too big: no; a batch never evicts itself: what does not fit
        # next to the first ones is not stored
        assert ok == [True, True, True, False, True, True, False, False]
        st = c.stats()
        assert (st.used_bytes, st.entries, st.evictions) == (4 * S, 4, 0)
        for d, data in items[:4]:
            assert c.get(d) == data
        assert all(c.put_many(items[4:]))  # the next batch evicts the first (LRU) segment
        st = c.stats()
        assert st.evictions == 4 and st.entries == 2 and c.verify(read_data=True) == []


def test_a_get_does_not_miss_a_chunk_indexed_while_it_looks(cache: NodeCache, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A chunk handed to the write-behind is in its memory until indexed, then in the
    index: a get whose index lookup comes just before the indexing must still find it
    (this race failed test_read_chain's get-after-read once in a full run)."""
    (digest, data), = chunks(1)
    gate = threading.Event()
    real_store = cache._writes._store

    def store(items):  # type: ignore[no-untyped-def]
        assert gate.wait(10)       # the write-behind indexes only when the test says
        return real_store(items)

    monkeypatch.setattr(cache._writes, "_store", store)
    assert cache.get_or_fetch_many([digest], lambda missing: [data]) == [data]   # handed over, not indexed
    real_lookup = cache._lookup

    def lookup_then_index(digests):  # type: ignore[no-untyped-def]
        found = real_lookup(digests)   # not indexed yet ...
        gate.set()
        cache.drain()                  # ... indexed now, and gone from the write-behind's memory
        return found

    monkeypatch.setattr(cache, "_lookup", lookup_then_index)
    assert cache.get(digest) == data
