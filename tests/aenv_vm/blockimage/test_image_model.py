"""BlockImage against a plain in-memory model: random interleavings of writes,
trims, zero-writes, commits, reopens and reads over stacks of 1-20 layers,
on a real Store (posix_fs repository + node cache)."""
from __future__ import annotations

import itertools
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_store.errors import CorruptData
from aenv_store.store import Store
from aenv_vm.blockimage.image import BlockImage
from aenv_vm.blockimage.importer import import_raw
from aenv_vm.blockimage.layer import ImageError, image_top, load_stack
from aenv_vm.blockimage.upper import BLOCK

from .conftest import store_settings

CHUNK = 16 * 1024
SIZE = 8 * CHUNK + 3000          # not a multiple of 4 KiB: exercises the last partial block
_names = itertools.count()


@pytest.fixture(scope="module")
def mstore() -> Iterator[Store]:
    d = Path(tempfile.mkdtemp(prefix="aenv-bi-model-"))
    s = Store.open(store_settings(d / "data", chunk_size=CHUNK), create=True)
    try:
        yield s
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


class Model:
    def __init__(self, data: bytes) -> None:
        self.b = bytearray(data)

    def write(self, off: int, data: bytes) -> None:
        self.b[off:off + len(data)] = data

    def zero(self, off: int, n: int) -> None:
        self.b[off:off + n] = bytes(n)

    def trim(self, off: int, n: int) -> None:
        end = off + n
        a0 = -(-off // BLOCK) * BLOCK
        a1 = end - end % BLOCK if end != len(self.b) else end
        if a1 > a0:
            self.b[a0:a1] = bytes(a1 - a0)


op = st.one_of(
    st.tuples(st.just("write"), st.integers(0, SIZE - 1), st.integers(1, 3 * BLOCK), st.integers(0, 255)),
    st.tuples(st.just("trim"), st.integers(0, SIZE - 1), st.integers(1, 5 * BLOCK), st.just(0)),
    st.tuples(st.just("zero"), st.integers(0, SIZE - 1), st.integers(1, 5 * BLOCK), st.just(0)),
    st.tuples(st.just("read"), st.integers(0, SIZE - 1), st.integers(1, 4 * CHUNK), st.just(0)),
    st.tuples(st.just("commit"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("reopen"), st.just(0), st.just(0), st.just(0)),
)


def _base_bytes(seed: int) -> bytes:
    rnd = random.Random(seed)
    data = bytearray(rnd.randbytes(SIZE))
    for _ in range(3):   # zero holes so the base has zero runs, some chunk-aligned
        a = rnd.randrange(0, SIZE)
        n = min(rnd.choice([BLOCK, CHUNK, 3 * CHUNK]), SIZE - a)
        data[a:a + n] = bytes(n)
    return bytes(data[:SIZE])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.lists(op, min_size=1, max_size=40), st.integers(0, 19))
def test_image_matches_model(mstore: Store, seed: int, ops: list[tuple[str, int, int, int]],
                             extra_layers: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="aenv-bi-ex-"))
    try:
        _run(mstore, work, seed, ops, extra_layers)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(store: Store, work: Path, seed: int, ops: list[tuple[str, int, int, int]], extra_layers: int) -> None:
    base = _base_bytes(seed)
    src = work / "base.raw"
    src.write_bytes(base)
    name = f"m{next(_names)}"
    top = import_raw(store, src, name).layer_id
    model = Model(base)
    committed = bytes(base)
    layers = 1
    rnd = random.Random(seed)
    upper_dir = work / "upper"
    img = BlockImage.open(store, top, name, upper_dir=upper_dir, memory_bytes=4 * CHUNK)
    # pre-build a stack of 1..20 layers with a few random writes each
    for _ in range(extra_layers):
        off = rnd.randrange(0, SIZE)
        data = rnd.randbytes(min(rnd.randrange(1, 2 * CHUNK), SIZE - off))
        img.write(off, data)
        model.write(off, data)
        img.commit(name)
        layers += 1
    committed = bytes(model.b)
    try:
        for kind, off, n, val in ops:
            n = min(n, SIZE - off)
            if kind == "write":
                data = bytes([val]) * n if val % 3 else rnd.randbytes(n)
                img.write(off, data, fua=val % 7 == 0)
                model.write(off, data)
            elif kind == "trim":
                img.trim(off, n)
                model.trim(off, n)
            elif kind == "zero":
                img.write_zeroes(off, n)
                model.zero(off, n)
            elif kind == "read":
                assert img.read(off, n) == bytes(model.b[off:off + n])
            elif kind == "commit":
                if layers >= 20:
                    continue
                img.commit(name)
                layers += 1
                committed = bytes(model.b)
            elif kind == "reopen":
                img.close()        # flushes the upper layer
                img = BlockImage.open(store, image_top(store.get_record(name)), name, upper_dir=upper_dir,
                                      memory_bytes=4 * CHUNK)
        assert img.read(0, SIZE) == bytes(model.b)
        assert len(img.layers) == layers
    finally:
        img.close()
    # committed state alone (no upper), through a fresh chain walk
    top = image_top(store.get_record(name))
    assert len(load_stack(store, top)) == layers
    with BlockImage.open(store, top, name) as ro:
        assert ro.read(0, SIZE) == committed
        with pytest.raises(PermissionError):
            ro.write(0, b"x")
    # the flushed upper layer survives a reopen with uncommitted writes intact
    with BlockImage.open(store, top, name, upper_dir=upper_dir) as again:
        assert again.read(0, SIZE) == bytes(model.b)


def test_upper_map_of_other_image_refused(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "a.raw"
    src.write_bytes(os.urandom(64 * 1024))
    a = import_raw(store, src, "a").layer_id
    src.write_bytes(os.urandom(64 * 1024))
    b = import_raw(store, src, "b").layer_id
    with BlockImage.open(store, a, "a", upper_dir=tmp_path / "up") as img:
        img.write(0, b"x" * 4096)
    with pytest.raises(CorruptData):
        BlockImage.open(store, b, "b", upper_dir=tmp_path / "up")


def test_max_layers_enforced(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv_vm.blockimage import image as image_mod
    src = tmp_path / "a.raw"
    src.write_bytes(os.urandom(8192))
    top = import_raw(store, src, "a").layer_id
    with BlockImage.open(store, top, "a", upper_dir=tmp_path / "up") as img:
        img.write(0, b"y")
        monkeypatch.setattr(image_mod, "MAX_LAYERS", 1)
        with pytest.raises(ImageError):
            img.commit("a")


def test_commit_stores_only_written_blocks(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "a.raw"
    src.write_bytes(os.urandom(1 << 20))
    top = import_raw(store, src, "a").layer_id
    with BlockImage.open(store, top, "a", upper_dir=tmp_path / "up") as img:
        img.write(100, b"z" * 10)                 # one 4 KiB block (read-modify-write)
        img.write_zeroes(65536, 3 * 65536)       # zero run, no data
        img.write(512 * 1024, bytes(8192))        # written zeros: stored as a zero run too
        info = img.commit("a")
        assert info.data_bytes == 4096
        exts = info.layer.extents
        assert [(e.offset, e.length, e.chunk is None) for e in exts] == [
            (0, 4096, False), (65536, 3 * 65536, True), (512 * 1024, 8192, True)]
        assert info.layer.parent == top
        assert not img.upper.touched()           # continues on a fresh upper layer
        assert img.read(0, 200)[100:110] == b"z" * 10


def test_upper_durable_on_flush_only(store: Store, tmp_path: Path) -> None:
    """What a crash leaves: the map as of the last flush (never ahead of the data)."""
    src = tmp_path / "a.raw"
    base = os.urandom(256 * 1024)
    src.write_bytes(base)
    top = import_raw(store, src, "a").layer_id
    img = BlockImage.open(store, top, "a", upper_dir=tmp_path / "up")
    img.write(0, b"A" * 8192)
    img.write_zeroes(65536, 65536)
    img.flush()
    img.write(131072, b"B" * 4096)            # not flushed
    # "crash": a second opener reads what is on disk while the first never flushed again
    with BlockImage.open(store, top, "a", upper_dir=tmp_path / "up") as after:
        assert after.read(0, 8192) == b"A" * 8192
        assert after.read(65536, 65536) == bytes(65536)
        assert after.read(131072, 4096) == base[131072:135168]
    img.upper.close()    # drop without flushing
