"""Manifest and catalog record codecs: canonical round trips, invalid and
corrupt input rejected."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_store.errors import CorruptData
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest

digest_st = st.binary(min_size=32, max_size=32).map(Digest)
text_st = st.text(min_size=1, max_size=20).filter(lambda s: len(s.encode()) <= 255)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    cs = draw(st.sampled_from([4096, 65536]))
    extents = []
    pos = 0
    for _ in range(draw(st.integers(0, 20))):
        pos += draw(st.integers(0, 3)) * 512  # optional gap
        if draw(st.booleans()):
            ln = draw(st.integers(1, 3 * cs))
            extents.append(Extent(pos, ln, None))
        else:
            room = cs - pos % cs
            ln = draw(st.integers(1, room))
            extents.append(Extent(pos, ln, draw(digest_st)))
        pos += ln
    size = pos + draw(st.integers(0, 10_000))
    meta = tuple(sorted(draw(st.dictionaries(text_st, st.text(max_size=30), max_size=4)).items()))
    return Manifest(draw(text_st), size, tuple(extents), draw(st.none() | digest_st), cs, meta)


@settings(max_examples=150, deadline=None)
@given(m=manifests())
def test_manifest_roundtrip(m: Manifest) -> None:
    data = m.encode()
    back = Manifest.decode(data)
    assert back == m
    assert back.encode() == data
    assert back.id == m.id == Digest.of(data)


@settings(max_examples=150, deadline=None)
@given(m=manifests(), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_manifest_corruption_never_decodes_silently_to_same_id(m: Manifest, where: float, bit: int) -> None:
    data = bytearray(m.encode())
    data[int(where * len(data))] ^= 1 << bit
    try:
        back = Manifest.decode(bytes(data))
    except CorruptData:
        return
    # a flip can land in a chunk id or a meta value and still parse: it is then a
    # different manifest, which the repository catches by its id (name != BLAKE3)
    assert back.id != m.id


@settings(max_examples=60, deadline=None)
@given(m=manifests(), cut=st.integers(1, 100))
def test_manifest_truncated_rejected(m: Manifest, cut: int) -> None:
    with pytest.raises(CorruptData):
        Manifest.decode(m.encode()[:-cut])
    with pytest.raises(CorruptData):
        Manifest.decode(m.encode() + b"\0")


@given(junk=st.binary(max_size=200))
def test_manifest_garbage_rejected(junk: bytes) -> None:
    with pytest.raises(CorruptData):
        Manifest.decode(junk)


@pytest.mark.parametrize("extents, why", [
    ((Extent(0, 10, None), Extent(5, 10, None)), "overlap"),
    ((Extent(10, 10, None), Extent(0, 5, None)), "unsorted"),
    ((Extent(0, 0, None),), "empty"),
    ((Extent(65000, 1000, Digest(b"\1" * 32)),), "crosses chunk boundary"),
    ((Extent(0, 200_000, None),), "beyond size"),
])
def test_invalid_manifests_rejected(extents: tuple[Extent, ...], why: str) -> None:
    with pytest.raises(ValueError):
        Manifest("x", 100_000, extents)


def test_bad_chunk_size_and_meta_rejected() -> None:
    with pytest.raises(ValueError):
        Manifest("x", 0, (), chunk_size=3000)
    with pytest.raises(ValueError):
        Manifest("x", 0, (), meta=(("b", "1"), ("a", "2")))
    with pytest.raises(ValueError):
        Manifest("", 0, ())


def test_extents_in() -> None:
    d = Digest(b"\2" * 32)
    m = Manifest("x", 300, (Extent(0, 100, d), Extent(100, 100, None), Extent(250, 50, d)), chunk_size=4096)
    assert [e.offset for e in m.extents_in(0, 300)] == [0, 100, 250]
    assert [e.offset for e in m.extents_in(150, 10)] == [100]
    assert m.extents_in(200, 50) == []
    assert [e.offset for e in m.extents_in(99, 2)] == [0, 100]


# -- catalog records ------------------------------------------------------------

name_st = st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,30}", fullmatch=True)


@st.composite
def records(draw: st.DrawFn) -> CatalogRecord:
    alias = draw(st.booleans())
    roles = draw(st.lists(text_st, unique=True, max_size=3))
    return CatalogRecord(
        name=draw(name_st), kind="alias" if alias else draw(st.sampled_from(["snapshot", "template", "layer"])),
        manifests=tuple((r, draw(digest_st)) for r in roles),
        meta=tuple(sorted(draw(st.dictionaries(text_st, st.text(max_size=20), max_size=3)).items())),
        created=draw(st.floats(0, 4e9)), target=draw(name_st) if alias else None)


@settings(max_examples=150, deadline=None)
@given(r=records())
def test_record_roundtrip(r: CatalogRecord) -> None:
    data = r.encode()
    assert CatalogRecord.decode(data) == r
    assert CatalogRecord.decode(data).encode() == data


@given(junk=st.binary(max_size=200))
def test_record_garbage_rejected(junk: bytes) -> None:
    with pytest.raises(CorruptData):
        CatalogRecord.decode(junk)


def test_record_non_canonical_rejected() -> None:
    r = CatalogRecord("a", "snapshot")
    data = r.encode()
    with pytest.raises(CorruptData):
        CatalogRecord.decode(data.replace(b",", b", "))
    with pytest.raises(CorruptData):
        CatalogRecord.decode(data.replace(b'"v":1', b'"v":2'))


@pytest.mark.parametrize("name", ["", ".hidden", "..", "a/b", "x" * 201, "sp ace"])
def test_record_bad_names(name: str) -> None:
    with pytest.raises(ValueError):
        CatalogRecord(name, "snapshot")


def test_alias_needs_target() -> None:
    with pytest.raises(ValueError):
        CatalogRecord("a", "alias")
    with pytest.raises(ValueError):
        CatalogRecord("a", "snapshot", target="b")
