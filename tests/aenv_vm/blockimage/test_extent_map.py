"""Flattened extent map vs a per-byte model of the layer stack."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_store.formats.ids import Digest
from aenv_vm.blockimage.extent_map import ExtentMap, LayerExtent

SIZE = 256


@st.composite
def layer(draw: st.DrawFn, idx: int) -> list[LayerExtent]:
    cuts = sorted(set(draw(st.lists(st.integers(0, SIZE), max_size=12))) | {0, SIZE})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        kind = draw(st.sampled_from(["gap", "zero", "data"]))
        if kind == "zero":
            out.append(LayerExtent(a, b - a, None))
        elif kind == "data":
            out.append(LayerExtent(a, b - a, Digest.of(f"{idx}:{a}".encode())))
    return out


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8).flatmap(lambda n: st.tuples(*[layer(i) for i in range(n)])), st.integers(1, SIZE))
def test_flattened_map_matches_model(layers: tuple[list[LayerExtent], ...], size: int) -> None:
    # model: for each byte, (chunk, offset in chunk) of the topmost layer covering it
    model: list[tuple[Digest | None, int]] = [(None, 0)] * SIZE
    for ext in layers:
        for e in ext:
            for i in range(e.length):
                model[e.offset + i] = (e.chunk, i if e.chunk is not None else 0)
    m = ExtentMap.from_layers(size, list(layers))
    segs = list(m.segments())
    assert segs[0].start == 0 and segs[-1].end == size
    assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
    got: list[tuple[Digest | None, int]] = []
    for pos, n, c, off in m.lookup(0, size):
        got += [(c, off + i if c is not None else 0) for i in range(n)]
    assert got == model[:size]
    # random sub-range lookups agree too
    for a in range(0, size, 37):
        sub = []
        for pos, n, c, off in m.lookup(a, 50):
            sub += [(c, off + i if c is not None else 0) for i in range(n)]
        assert sub == model[a:min(a + 50, size)]


def test_with_layer_equals_rebuild() -> None:
    d = [Digest.of(bytes([i])) for i in range(4)]
    base = [LayerExtent(0, 100, d[0]), LayerExtent(100, 100, d[1])]
    top = [LayerExtent(50, 10, None), LayerExtent(150, 80, d[2])]
    a = ExtentMap.from_layers(256, [base]).with_layer(top, 1)
    b = ExtentMap.from_layers(256, [base, top])
    assert list(a.segments()) == list(b.segments())
    assert a.chunks_in(0, 256) == [d[0], d[1], d[2]]
    assert a.stats()["zero_bytes"] == 10 + 26


def test_overlapping_input_rejected() -> None:
    from aenv_vm.blockimage.extent_map import Segment
    with pytest.raises(ValueError):
        ExtentMap(100, [Segment(0, 50, None), Segment(40, 60, None)])


def test_stack_maps_build_each_stack_once_and_stay_bounded() -> None:
    from aenv_store.formats.ids import Digest
    from aenv_store.formats.manifest import Extent
    from aenv_vm.blockimage.extent_map import ExtentMap, StackMaps

    def layer(i: int, n: int) -> tuple[Digest, list[Extent]]:
        return Digest.of(b"layer %d" % i), [Extent(k * 4096, 4096, Digest.of(b"%d/%d" % (i, k))) for k in range(n)]
    maps = StackMaps(max_segments=25)
    a, b, c = layer(1, 8), layer(2, 8), layer(3, 30)
    first = maps.get(1 << 20, [a])
    assert maps.get(1 << 20, [a]) is first                      # built once
    assert maps.get(1 << 20, [a, b]) is not first               # another stack, another map
    want = ExtentMap.from_layers(1 << 20, [a[1], b[1]])
    assert list(maps.get(1 << 20, [a, b]).segments()) == list(want.segments())
    assert maps.get(2 << 20, [a]) is not first                  # the size is part of the name
    assert len(maps) == 2                                       # [a] fell out: 9 + 9 + 9 > 25
    big = maps.get(1 << 20, [c])                                # bigger than the bound: never kept
    assert maps.get(1 << 20, [c]) is not big and len(maps) == 2
    assert first.chunks() is first.chunks() and len(first.chunks()) == 8


def test_stack_maps_build_a_stack_once_when_many_open_it_at_once() -> None:
    import threading

    from aenv_store.formats.ids import Digest
    from aenv_store.formats.manifest import Extent
    from aenv_vm.blockimage import extent_map
    from aenv_vm.blockimage.extent_map import StackMaps

    builds = []
    real = extent_map.ExtentMap.from_layers

    def counted(size, layers):  # type: ignore[no-untyped-def]
        builds.append(size)
        return real(size, layers)
    stack = [(Digest.of(b"l"), [Extent(k * 4096, 4096, Digest.of(b"%d" % k)) for k in range(2000)])]
    maps = StackMaps()
    got: list[object] = []
    extent_map.ExtentMap.from_layers = counted  # type: ignore[method-assign]
    try:
        threads = [threading.Thread(target=lambda: got.append(maps.get(1 << 30, stack))) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        extent_map.ExtentMap.from_layers = real  # type: ignore[method-assign]
    assert len(builds) == 1 and len(got) == 16 and all(g is got[0] for g in got)
