"""The decoded-manifest cache (aenv_store/manifest_cache.py): one decode per id while
it fits, least recently used out by extents, a manifest bigger than the bound never
kept; and a decoded manifest keeps the id it was stored under."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest
from aenv_store.manifest_cache import ManifestCache


def manifest(n_extents: int, tag: int) -> Manifest:
    ext = tuple(Extent(i * 4096, 4096, Digest.of(b"%d-%d" % (tag, i))) for i in range(n_extents))
    return Manifest("application/x-test", max(n_extents, 1) * 4096, ext, meta=(("tag", str(tag)),))


def test_hits_return_the_same_object_and_loads_happen_once() -> None:
    m = manifest(3, 1)
    loads: list[Digest] = []

    def load(mid: Digest) -> Manifest:
        loads.append(mid)
        return m
    cache = ManifestCache(max_extents=100)
    assert cache.get(m.id, load) is m and cache.get(m.id, load) is m
    assert loads == [m.id] and (cache.hits, cache.misses) == (1, 1)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30),
       order=st.lists(st.integers(0, 29), max_size=60), bound=st.integers(1, 120))
def test_bounded_by_extents_least_recently_used_out(sizes: list[int], order: list[int], bound: int) -> None:
    ms = [manifest(n, i) for i, n in enumerate(sizes)]
    cache = ManifestCache(max_extents=bound)
    recent: list[int] = []          # the model: most recent last
    for i in [*range(len(ms)), *(o % len(ms) for o in order)]:
        got = cache.get(ms[i].id, lambda _mid, i=i: ms[i])
        assert got is ms[i]
        if i in recent:
            recent.remove(i)
        if len(ms[i].extents) + 1 <= bound:
            recent.append(i)
        while sum(len(ms[j].extents) + 1 for j in recent) > bound:
            recent.pop(0)
        assert cache.extents == sum(len(ms[j].extents) + 1 for j in recent) <= bound
        assert len(cache) == len(recent)


def test_a_decoded_manifest_keeps_the_id_it_was_stored_under() -> None:
    m = manifest(5, 2)
    data = m.encode()
    stored = Digest.of(data)
    got = Manifest.decode(data, stored_as=stored)
    assert got.id == stored == m.id and got == m
