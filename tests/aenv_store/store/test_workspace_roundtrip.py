"""Acceptance 1: bytes written through a workspace, committed, and read back
from a cold node cache (a fresh Store on another data dir, same repository)
are identical, whole and by random ranges; recommitting adds no packs."""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_store.errors import StoreNotFound
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Manifest
from aenv_store.store import Store

from .conftest import make_settings

CS = 4096
_counter = itertools.count()

data_st = st.one_of(
    st.binary(min_size=1, max_size=3 * CS),
    st.integers(1, 3 * CS).map(bytes),                                  # zeros
    st.builds(lambda b, n: (b * n)[: 5 * CS], st.binary(min_size=1, max_size=64), st.integers(1, 400)),
)
write_op = st.tuples(st.just("write"), st.integers(0, 12 * CS), data_st)
zeros_op = st.tuples(st.just("zeros"), st.integers(0, 12 * CS), st.integers(1, 3 * CS))
op_st = st.one_of(write_op, st.tuples(st.just("append"), st.just(0), data_st), zeros_op)
delta_op_st = st.one_of(write_op, zeros_op)  # appends make no sense over a fixed-size parent
HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def apply_ops(writer, ops, model: bytearray, mask: bytearray) -> None:
    for kind, off, arg in ops:
        if kind == "append":
            off = len(model)
        if kind == "zeros":
            data = bytes(arg)
            writer.write_zeros(off, arg)
        else:
            data = arg
            if kind == "append":
                writer.append(data)
            else:
                writer.write(off, data)
        end = off + len(data)
        if end > len(model):
            model.extend(bytes(end - len(model)))
            mask.extend(bytes(end - len(mask)))
        model[off:end] = data
        mask[off:end] = b"\1" * len(data)


def packs(repo: Path) -> set[str]:
    return {p.name for p in (repo / "packs").rglob("*") if p.is_file()}


def check_reads(store: Store, mid: Digest, expected: bytes, rng: random.Random) -> None:
    reader = store.open_blob(mid)
    assert reader.size == len(expected)
    assert reader.read(0, len(expected) + 100) == expected
    for _ in range(20):
        a = rng.randrange(0, len(expected) + 1)
        n = rng.randrange(0, 3 * CS)
        assert reader.read(a, n) == expected[a:a + n], (a, n)


class Writer:
    """One writer Store per test function (hypothesis runs many examples in it);
    every example reads back through a brand-new Store with an empty cache."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.repo = base / "repo"
        self.store = Store.open(make_settings(base / "writer", self.repo), create=True)

    def cold(self) -> Store:
        return Store.open(make_settings(self.base / f"cold{next(_counter)}", self.repo))


@pytest.fixture
def writer(tmp_path: Path):
    w = Writer(tmp_path)
    yield w
    w.store.close()


# Examples leave their cold data dirs under tmp_path (pytest removes it): each node
# cache pre-creates its fan-out directories and removing them per example costs more
# than the example itself.
@settings(max_examples=30, deadline=None, suppress_health_check=HC)
@given(ops=st.lists(op_st, min_size=1, max_size=12), seed=st.integers(0, 2**32))
def test_full_blob_roundtrip_cold_cache(writer: Writer, ops, seed: int) -> None:
    store, repo = writer.store, writer.repo
    name = f"blob{next(_counter)}"
    model, mask = bytearray(), bytearray()
    with store.workspace() as ws:
        w = ws.blob_writer("application/vnd.aenv.blob")
        apply_ops(w, ops, model, mask)
        mid = w.close()
        first = ws.commit(CatalogRecord(name, "layer", (("data", mid),)))
    assert first.manifests == (mid,)
    before = packs(repo)
    # the same data again, through a new workspace: dedup adds no pack
    with store.workspace() as ws:
        w = ws.blob_writer("application/vnd.aenv.blob")
        apply_ops(w, ops, bytearray(), bytearray())
        assert w.close() == mid
        again = ws.commit()
    assert again.packs_added == 0 and again.chunks_added == 0
    assert packs(repo) == before
    # a fresh node (empty cache) on the same repository
    with writer.cold() as cold:
        assert cold.cache is None or cold.cache.stats().entries == 0
        m = cold.load_manifest(cold.resolve(name).manifest("data"))
        assert m.id == mid and m.parent is None
        assert sum(e.length for e in m.extents) == m.size  # full blob: extents cover [0, size)
        assert all(e.chunk is None or e.length <= CS for e in m.extents)
        check_reads(cold, mid, bytes(model), random.Random(seed))
        if cold.cache is not None and any(e.chunk for e in m.extents):
            assert cold.cache.stats().entries > 0  # came from the repository, then cached


@settings(max_examples=20, deadline=None, suppress_health_check=HC)
@given(ops=st.lists(delta_op_st, min_size=1, max_size=10))
def test_delta_blob_keeps_gaps(writer: Writer, ops) -> None:
    model, mask = bytearray(), bytearray()
    with writer.store.workspace() as ws:
        parent_w = ws.blob_writer("application/vnd.aenv.disk-layer", size=20 * CS)
        parent_w.write(0, b"P" * (20 * CS))
        parent = parent_w.close()
        w = ws.blob_writer("application/vnd.aenv.disk-layer", size=20 * CS, parent=parent)
        apply_ops(w, ops, model, mask)
        mid = w.close()
        ws.commit()
    with writer.cold() as cold:
        m = cold.load_manifest(mid)
        assert m.parent == parent and m.size == 20 * CS
        covered = bytearray(m.size)
        for e in m.extents:
            covered[e.offset:e.end] = b"\1" * e.length
        mask.extend(bytes(m.size - len(mask)))
        assert covered == mask  # exactly the written ranges, nothing more
        reader = cold.open_blob(mid)
        for e in m.extents:
            assert reader.read(e.offset, e.length) == bytes(model[e.offset:e.end])
        if 0 in mask:
            with pytest.raises(StoreNotFound):
                reader.read(0, m.size)


def test_sparse_huge_blob_stays_cheap(settings_factory) -> None:
    size = 1 << 40  # 1 TiB logical, three small writes
    with Store.open(settings_factory(), create=True) as store:
        with store.workspace() as ws:
            w = ws.blob_writer(size=size)
            w.write(5, b"head")
            w.write(size // 2, b"x" * 10_000)
            w.write(size - 3, b"end")
            mid = w.close()
            ws.commit()
        r = store.open_blob(mid)
        assert r.read(0, 10) == b"\0" * 5 + b"head" + b"\0"
        assert r.read(size // 2 - 1, 10_002) == b"\0" + b"x" * 10_000 + b"\0"
        assert r.read(size - 4, 100) == b"\0end"
        assert len(store.load_manifest(mid).extents) <= 9


def test_rewrite_of_sealed_chunk_is_read_modify_write(settings_factory) -> None:
    with Store.open(settings_factory(), create=True) as store:
        with store.workspace() as ws:
            w = ws.blob_writer()
            w.append(b"a" * CS * 3)        # three sealed chunks
            w.write(CS + 10, b"BBB")       # patch the middle one
            w.write_zeros(2 * CS, CS)      # and zero the last
            mid = w.close()
            ws.commit()
        r = store.open_blob(mid)
        assert r.read(0, 3 * CS) == b"a" * (CS + 10) + b"BBB" + b"a" * (CS - 13) + bytes(CS)
        m = store.load_manifest(mid)
        assert m.extents[-1].chunk is None


def test_parent_of_chunk_in_repository_dedups_across_commits(settings_factory) -> None:
    import os
    data = os.urandom(10 * CS)
    with Store.open(settings_factory(), create=True) as store:
        with store.workspace() as ws:
            w = ws.blob_writer()
            w.append(data)
            ws.commit(CatalogRecord("v1", "layer", (("d", w.close()),)))
        with store.workspace() as ws:
            w = ws.blob_writer()
            w.append(data[:5 * CS] + b"changed!" + data[5 * CS + 8:])
            res = ws.commit(CatalogRecord("v2", "layer", (("d", w.close()),)))
        assert res.chunks_added == 1 and res.chunks_deduped == 9


def test_manifest_validates_staged_chunks(settings_factory) -> None:
    from aenv_store.formats.manifest import Extent
    with Store.open(settings_factory(), create=True) as store:
        with store.workspace() as ws:
            cid = ws.put_chunk(b"q" * 100)
            mid = ws.add_manifest(Manifest("x", 100, (Extent(0, 100, cid),), chunk_size=CS))
            with pytest.raises(StoreNotFound):
                ws.add_manifest(Manifest("x", 100, (Extent(0, 100, Digest.of(b"nope")),), chunk_size=CS))
            ws.commit()
        assert store.open_blob(mid).read(0, 100) == b"q" * 100


def test_reopen_same_data_dir_reads_cold(settings_factory) -> None:
    import os
    data = os.urandom(9 * CS + 123)
    settings = settings_factory()
    with Store.open(settings, create=True) as store:
        with store.workspace() as ws:
            w = ws.blob_writer()
            w.append(data)
            mid = w.close()
            ws.commit(CatalogRecord("again", "layer", (("d", mid),)))
    with Store.open(settings) as fresh:  # same data dir: committing never filled its cache
        assert fresh.cache.stats().entries == 0
        assert fresh.open_blob(mid).read(0, len(data)) == data
        assert fresh.cache.stats().entries == 10


def test_writer_misuse_is_refused(settings_factory) -> None:
    from aenv_store.errors import StoreError
    with Store.open(settings_factory(), create=True) as store:
        with store.workspace() as ws:
            w = ws.blob_writer(size=100)
            with pytest.raises(ValueError):
                w.write(90, b"x" * 11)
            with pytest.raises(ValueError):
                w.write(-1, b"x")
            with pytest.raises(StoreError, match="still open"):
                ws.commit()
            w.close()
            with pytest.raises(StoreError):
                w.write(0, b"x")
            ws.commit()
            with pytest.raises(StoreError):
                ws.blob_writer()


def test_uncached_reader_leaves_cache_alone(settings_factory) -> None:
    import os
    data = os.urandom(6 * CS)
    with Store.open(settings_factory(), create=True) as store:
        with store.workspace() as ws:
            w = ws.blob_writer()
            w.append(data)
            mid = w.close()
            ws.commit()
    with Store.open(settings_factory("cold")) as cold:
        cold.read_chunk(cold.load_manifest(mid).extents[0].chunk)  # one chunk cached
        assert cold.open_blob(mid, cache=False).read(0, len(data)) == data
        assert cold.cache.stats().entries == 1
        assert cold.open_blob(mid).read(0, len(data)) == data
        assert cold.cache.stats().entries == 6
