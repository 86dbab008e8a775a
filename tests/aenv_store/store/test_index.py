"""Index files: codec round trip, merged lookup, corrupt-input rejection."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_store.errors import CorruptData
from aenv_store.formats.ids import Digest
from aenv_store.formats.index import IndexEntry, MergedIndex, decode_index, encode_index

digest_st = st.binary(min_size=32, max_size=32).map(Digest)
entry_st = st.builds(
    lambda c, p, off, ln, extra: IndexEntry(c, p, off, ln, ln + extra),
    digest_st, st.sampled_from([Digest(bytes([i]) * 32) for i in range(4)]),
    st.integers(16, 1 << 40), st.integers(1, 1 << 22), st.integers(0, 1 << 20))
entries_st = st.lists(entry_st, max_size=40, unique_by=lambda e: bytes(e.chunk))


@settings(max_examples=80, deadline=None)
@given(entries=entries_st)
def test_roundtrip_and_lookup(entries: list[IndexEntry]) -> None:
    data = encode_index(entries)
    f = decode_index(data)
    assert sorted(f.entries(), key=lambda e: e.chunk) == sorted(entries, key=lambda e: e.chunk)
    assert encode_index(f.entries()) == data  # canonical
    m = MergedIndex()
    m.add_files([f])
    for e in entries:
        assert m.lookup(e.chunk) == e
    assert m.lookup(os.urandom(32)) is None


def test_keys_sharing_a_prefix_are_told_apart() -> None:
    # the numpy table searches on the first 8 bytes; ids equal there must still resolve
    p = Digest(b"\x01" * 32)
    es = [IndexEntry(Digest(b"\xaa" * 8 + bytes([i]) * 24), p, 16 + i, 1, 1) for i in range(5)]
    m = MergedIndex()
    m.add_files([decode_index(encode_index(es[:3])), decode_index(encode_index(es[3:]))])
    for e in es:
        assert m.lookup(e.chunk) == e
    assert m.lookup(b"\xaa" * 8 + b"\x09" * 24) is None


@settings(max_examples=80, deadline=None)
@given(entries=entries_st, overlaid=st.integers(0, 40), strangers=st.lists(digest_st, max_size=8),
       prefix=st.binary(min_size=8, max_size=8), twins=st.integers(0, 4), data=st.data())
def test_lookup_many_answers_as_lookup(entries: list[IndexEntry], overlaid: int, strangers: list[Digest],
                                       prefix: bytes, twins: int, data: st.DataObject) -> None:
    # ids sharing their first 8 bytes (the sort key), some in the table, some in the overlay
    p = Digest(b"\x02" * 32)
    entries = entries + [IndexEntry(Digest(prefix + bytes([i]) * 24), p, 16 + i, 1, 1) for i in range(twins)]
    entries = list({bytes(e.chunk): e for e in entries}.values())
    m = MergedIndex()
    m.add_files([decode_index(encode_index(entries[overlaid:]))])
    m.add_entries(entries[:overlaid])
    asked = [e.chunk for e in entries] + strangers + [Digest(prefix + b"\x77" * 24)]
    asked = data.draw(st.permutations(asked + asked[:3]))
    assert m.lookup_many(asked) == [m.lookup(c) for c in asked]
    for e in entries:
        assert m.lookup_many([e.chunk]) == [e]
    assert MergedIndex().lookup_many(asked) == [None] * len(asked)


def test_overlay_entries() -> None:
    m = MergedIndex()
    e = IndexEntry(Digest.of(b"x"), Digest.of(b"p"), 16, 3, 3)
    m.add_entries([e])
    assert m.lookup(e.chunk) == e and len(m) == 1


@settings(max_examples=80, deadline=None)
@given(entries=entries_st.filter(bool), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_flipped_bit_rejected(entries: list[IndexEntry], where: float, bit: int) -> None:
    data = bytearray(encode_index(entries))
    data[int(where * len(data))] ^= 1 << bit
    with pytest.raises(CorruptData):
        decode_index(bytes(data))


@settings(max_examples=40, deadline=None)
@given(entries=entries_st, cut=st.integers(1, 200))
def test_truncated_rejected(entries: list[IndexEntry], cut: int) -> None:
    data = encode_index(entries)
    with pytest.raises(CorruptData):
        decode_index(data[:-cut])


@given(junk=st.binary(max_size=300))
def test_garbage_rejected(junk: bytes) -> None:
    with pytest.raises(CorruptData):
        decode_index(junk)


def test_late_small_files_go_to_overlay_and_resolve() -> None:
    p = Digest(b"\x02" * 32)
    big = [IndexEntry(Digest(os.urandom(32)), p, 16, 10, 10) for _ in range(70_000)]
    late = [IndexEntry(Digest(os.urandom(32)), p, 16, 10, 10) for _ in range(10)]
    m = MergedIndex()
    m.add_files([decode_index(encode_index(big))])
    m.add_files([decode_index(encode_index(late))])
    assert len(m) == 70_010
    for e in late + big[:100]:
        assert m.lookup(e.chunk) == e


def test_summary_counts_distinct_chunks() -> None:
    p = Digest(b"\x03" * 32)
    es = [IndexEntry(Digest(os.urandom(32)), p, 16, 5, 10 + i) for i in range(20)]
    m = MergedIndex()
    m.add_files([decode_index(encode_index(es[:15])), decode_index(encode_index(es[10:15]))])  # 5 repeated
    m.add_entries(es[15:] + es[:2])
    assert m.summary() == (20, sum(e.raw_length for e in es))


def test_overlay_folds_into_table_when_large(monkeypatch: pytest.MonkeyPatch) -> None:
    import aenv_store.formats.index as index_mod
    monkeypatch.setattr(index_mod, "OVERLAY_MAX", 50)
    p = Digest(b"\x04" * 32)
    es = [IndexEntry(Digest(os.urandom(32)), p, 16, 5, 9) for _ in range(120)]
    m = MergedIndex()
    for i in range(0, 120, 10):
        m.add_entries(es[i:i + 10])
    assert len(m._overlay) <= 50 and len(m) == 120
    for e in es:
        assert m.lookup(e.chunk) == e
