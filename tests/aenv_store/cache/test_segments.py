"""Node-cache segment files (format aenv-node-cache/2, docs/cache.md): the header's
round trip, damage detection, reads of what the writer wrote (O_DIRECT and buffered),
and what happens to a cache directory of the older layout."""
from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest
from hypothesis import given, settings, strategies as st

from aenv_store.cache.lock import FileLock
from aenv_store.cache.node_cache import NodeCache
from aenv_store.cache.segments import (ALIGN, HEAD, ITEM, TRAILER, Found, SegmentFormatError, SegmentItem,
                                       SegmentWriter, decode_header, encode_header, header_length, layout, read_checked,
                                       read_header)
from aenv_store.config import CacheConfig
from aenv_store.errors import StoreError
from aenv_store.formats.ids import Digest

sizes = st.lists(st.integers(0, 3 * ALIGN), max_size=40)


def items_for(sizes_: list[int], seed: int = 0) -> list[SegmentItem]:
    _, offsets = layout(sizes_)
    return [SegmentItem(bytes([(seed + k) % 256]) * 32, off, size, (seed * 7919 + k) & (2**64 - 1))
            for k, (off, size) in enumerate(zip(offsets, sizes_))]


@given(sizes, st.integers(0, 255))
def test_header_round_trip(sizes_: list[int], seed: int) -> None:
    items = items_for(sizes_, seed)
    header = encode_header(items)
    assert len(header) == header_length(len(items)) and len(header) % ALIGN == 0
    assert decode_header(header) == items
    assert encode_header(decode_header(header)) == header  # canonical


@given(sizes.filter(bool), st.data())
def test_any_damaged_header_byte_is_refused(sizes_: list[int], data: st.DataObject) -> None:
    header = bytearray(encode_header(items_for(sizes_)))
    used = HEAD.size + len(sizes_) * ITEM.size + TRAILER.size  # the rest is padding
    pos = data.draw(st.integers(0, used - 1))
    header[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(SegmentFormatError):
        decode_header(bytes(header))


def test_truncated_or_foreign_headers_are_refused() -> None:
    header = encode_header(items_for([100, 5000]))
    for cut in (0, 5, HEAD.size, HEAD.size + ITEM.size):
        with pytest.raises(SegmentFormatError):
            decode_header(header[:cut])
    with pytest.raises(SegmentFormatError, match="not a node-cache segment"):
        decode_header(b"\x89PNG" + header[4:])
    newer = bytearray(header)
    newer[8] = 2  # version 2: not this build's
    with pytest.raises(SegmentFormatError, match="version"):
        decode_header(bytes(newer))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(max_size=3 * ALIGN), min_size=1, max_size=12), st.booleans())
def test_written_segment_reads_back(tmp_path_factory: pytest.TempPathFactory, chunks: list[bytes],
                                    direct: bool) -> None:
    import xxhash
    path = str(tmp_path_factory.mktemp("seg") / "s.seg")
    entries = [(bytes(Digest.of(c)), c, xxhash.xxh3_64_intdigest(c)) for c in chunks]
    offsets = SegmentWriter().write(path, entries, direct=direct)
    assert [(i.digest, i.offset, i.size, i.checksum) for i in read_header(path)] == \
        [(d, off, len(c), x) for (d, c, x), off in zip(entries, offsets)]
    for (d, c, x), off in zip(entries, offsets):
        for mapped in (False, True):
            found, got = read_checked(path, off, len(c), x, mapped)
            assert found is Found.OK and got is not None and bytes(got) == c
        if c:
            assert read_checked(path, off, len(c), x ^ 1, False)[0] is Found.CORRUPT
    os.truncate(path, offsets[-1])
    last = entries[-1]
    if last[1]:
        assert read_checked(path, offsets[-1], len(last[1]), last[2], True) == (Found.CORRUPT, None)


def make_format1(directory: Path) -> Path:
    """A directory as format 1 left it: its LMDB tables and one file per chunk."""
    (directory / "index").mkdir(parents=True)
    env = lmdb.open(str(directory / "index"), max_dbs=8)
    try:
        for name in (b"entries", b"lru", b"pins", b"dying"):
            env.open_db(name)
        with env.begin(write=True) as txn:
            txn.put(b"format", b"aenv-node-cache/1", db=env.open_db(b"meta", txn=txn))
    finally:
        env.close()
    old = directory / "data" / "ab" / ("ab" * 32)
    old.parent.mkdir(parents=True)
    old.write_bytes(b"x" * 4096)
    return old


def test_format1_directory_is_rebuilt_by_its_first_user(tmp_path: Path) -> None:
    old = make_format1(tmp_path / "c")
    with NodeCache(tmp_path / "c", CacheConfig(capacity=1 << 20, min_free_disk=0)) as c:
        assert c.stats().entries == 0 and not old.exists()
        data = b"y" * 5000
        assert c.put(Digest.of(data), data) and c.get(Digest.of(data)) == data
        assert c.verify(read_data=True) == []


def test_format1_directory_in_use_is_refused(tmp_path: Path) -> None:
    old = make_format1(tmp_path / "c")
    user = FileLock(tmp_path / "c" / "users.lock")  # an older build's process has it open
    user.shared()
    try:
        with pytest.raises(StoreError, match="aenv-node-cache/1"):
            NodeCache(tmp_path / "c", CacheConfig(capacity=1 << 20, min_free_disk=0))
        assert old.exists()  # nothing of the other user's was touched
    finally:
        user.close()


def test_a_big_put_many_is_split_into_bounded_segments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv_store.cache import fill
    monkeypatch.setattr(fill, "SEGMENT_MAX", 3 * ALIGN)
    items = [(Digest.of(bytes([i]) * ALIGN), bytes([i]) * ALIGN) for i in range(8)] + [(Digest.of(b""), b"")]
    with NodeCache(tmp_path / "c", CacheConfig(capacity=1 << 20, min_free_disk=0)) as c:
        assert all(c.put_many(items))
        assert len(list((tmp_path / "c" / "data").glob("*/*.seg"))) == 3  # 3 + 3 + 2 chunks (and the empty one)
        assert all(c.get(d) == data for d, data in items) and c.verify(read_data=True) == []
