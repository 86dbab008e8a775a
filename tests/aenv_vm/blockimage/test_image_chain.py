"""BlockImage reads through the store's read chain: node-cache files are mapped only
after they are checked against the cache index, and a cold read consults the node
cache once per chunk. Observers see reads and chunk fetches."""
from __future__ import annotations

import os
import random
from pathlib import Path

from aenv_store.formats.ids import Digest
from aenv_store.store import Store
from aenv_vm.blockimage.extent_map import ExtentMap
from aenv_vm.blockimage.image import BlockImage
from aenv_vm.blockimage.importer import import_raw

from tests.aenv_store.store.test_read_chain import count_repository_reads
from .conftest import store_settings

MiB = 1 << 20
CHUNK = 64 * 1024


def _image(tmp_path: Path, size: int = 2 * MiB) -> tuple[Path, Digest, bytes]:
    repo, src = tmp_path / "repo", tmp_path / "src.raw"
    data = random.Random(3).randbytes(size)
    src.write_bytes(data)
    with Store.open(store_settings(tmp_path / "builder", repo=repo), create=True) as builder:
        top = import_raw(builder, src, "base").layer_id
    return repo, top, data


def test_cold_image_read_consults_the_node_cache_once_per_chunk(tmp_path: Path) -> None:
    repo, top, data = _image(tmp_path)
    with Store.open(store_settings(tmp_path / "node", repo=repo)) as node:
        cache = node.cache
        assert cache is not None
        fetched = count_repository_reads(node)
        with BlockImage.open(node, top, "cold") as img:
            before = cache.lookups
            off, n = CHUNK + 100, 5 * CHUNK
            assert img.read(off, n) == data[off:off + n]
            touched = img.extent_map.chunks_in(off, n)
            assert len(touched) == 6 and len(fetched) == 6
            assert cache.lookups - before == 6
            img.memory.clear()
            before = cache.lookups
            assert img.read(off, n) == data[off:off + n]             # node-cache hits: one lookup each
            assert cache.lookups - before == 6 and len(fetched) == 6


def test_tampered_or_truncated_cache_file_is_never_mapped(tmp_path: Path) -> None:
    repo, top, data = _image(tmp_path)
    with Store.open(store_settings(tmp_path / "node", repo=repo)) as node:
        with BlockImage.open(node, top, "warm") as img:
            assert img.read(0, 4 * CHUNK) == data[:4 * CHUNK]        # chunks 0-3 now in the node cache
            c0, c1 = img.extent_map.chunks_in(0, 1)[0], img.extent_map.chunks_in(CHUNK, 1)[0]
        cache = node.cache
        assert cache is not None
        cs = [img.extent_map.chunks_in(i * CHUNK, 1)[0] for i in range(4)]
        locs = {c: cache.location_of(c, touch=False) for c in cs}
        p0, p1 = locs[c0], locs[c1]
        assert p0 is not None and p1 is not None
        with open(p0.path, "r+b") as f:  # same size, one byte flipped where the read below looks
            f.seek(p0.offset + 10)
            f.write(bytes([data[10] ^ 0x01]))
        os.truncate(p1.path, p1.offset + 100)  # c1 cut short, and what its segment held after it
        cut = {bytes(c) for c, loc in locs.items() if loc is not None and loc.path == p1.path and loc.offset >= p1.offset}
        fetched = count_repository_reads(node)
        with BlockImage.open(node, top, "again") as img:             # fresh chunk memory: maps again
            assert img.read(0, 4 * CHUNK) == data[:4 * CHUNK]
        assert sorted(fetched) == sorted({bytes(c0)} | cut)         # dropped and refetched, the rest mapped
        assert cache.stats().corrupt == 1 + len(cut)
        assert cache.verify(read_data=True) == []


class _Observer:
    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []
        self.chunks: list[Digest] = []
        self.closed = False

    def on_read(self, extent_map: ExtentMap, offset: int, length: int) -> None:
        self.reads.append((offset, length))

    def on_chunk(self, cid: Digest) -> None:
        self.chunks.append(cid)

    def close(self) -> None:
        self.closed = True


def test_observers_see_reads_and_chunk_fetches(tmp_path: Path) -> None:
    repo, top, data = _image(tmp_path)
    obs = _Observer()
    with Store.open(store_settings(tmp_path / "node", repo=repo)) as node:
        with BlockImage.open(node, top, "obs") as img:
            img.add_observer(obs)
            img.read(0, 100)
            img.read(50, 100)                                        # same chunk: from memory
            img.read(3 * CHUNK, CHUNK + 1)
            assert obs.reads == [(0, 100), (50, 100), (3 * CHUNK, CHUNK + 1)]
            assert obs.chunks == img.extent_map.chunks_in(0, 1) + img.extent_map.chunks_in(3 * CHUNK, CHUNK + 1)
    assert obs.closed
