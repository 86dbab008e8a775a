"""Import a raw/ext4 image file or a directory tree as a base disk layer, and
export (flatten) an image to a raw file.

Import streams the file chunk by chunk (never the whole image in memory),
skips holes with SEEK_DATA/SEEK_HOLE and stores no all-zero chunk: zeros
become zero runs in the layer manifest. A directory tree is first turned
into an ext4 image with ``mkfs.ext4 -d`` in the workspace area.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest

from ..childenv import child_env
from .image import BlockImage, flatten_to
from .layer import DISK_LAYER, LAYER_ALIGN, ImageError, coalesce, image_record

if TYPE_CHECKING:
    from aenv_store.store import Store

MiB = 1 << 20
IMPORT_BATCH = 64     # chunks per stage_many call


@dataclass(frozen=True)
class ImportResult:
    name: str
    layer_id: Digest
    size: int
    data_bytes: int       # bytes stored in data extents
    zero_bytes: int
    chunks_added: int
    chunks_deduped: int
    seconds: float


def _data_ranges(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """Allocated ranges of a (possibly sparse) file; the whole file if holes are not reported."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:      # only a hole remains
                return
            yield pos, size
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, min(end, size)
        pos = end


def import_raw(store: "Store", path: Path, name: str, meta: dict[str, str] | None = None,
               exclusive: bool = True) -> ImportResult:
    """``path`` (a raw disk image) becomes base layer + catalog record ``name`` (kind image)."""
    t0 = time.perf_counter()
    path = Path(path)
    if not path.is_file():
        raise ImageError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise ImageError(f"{path}: empty image")
    cs = store.chunk_size
    extents: list[Extent] = []
    data_bytes = 0
    with store.workspace() as ws, open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        # chunks are read in order: a larger kernel read-ahead keeps the disk ahead of hashing
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        batch: list[tuple[int, bytes]] = []

        def stage_batch() -> None:
            # stage_many hashes inline and compresses the batch on the store's pool
            nonlocal data_bytes
            for (off, data), cid in zip(batch, ws.stage_many([d for _, d in batch])):
                extents.append(Extent(off, len(data), cid))
                if cid is not None:
                    data_bytes += len(data)
            batch.clear()

        pos = 0
        for start, end in _data_ranges(fd, size):
            # align the range outward to chunks so data extents stay chunk-aligned
            start -= start % cs
            start = max(start, pos)
            end = min(-(-end // cs) * cs, size)
            if start > pos:
                extents.append(Extent(pos, start - pos, None))
            for off in range(start, end, cs):
                n = min(cs, end - off)
                data = os.pread(fd, n, off)
                if len(data) != n:
                    raise ImageError(f"{path}: changed while importing (short read at {off})")
                batch.append((off, data))
                if len(batch) >= IMPORT_BATCH:
                    stage_batch()
            stage_batch()
            pos = end
        # The virtual size is rounded up to whole 4 KiB blocks (the padding reads
        # as zeros): block clients such as QEMU address whole sectors and would
        # otherwise read past the end of the last partial one.
        vsize = -(-size // LAYER_ALIGN) * LAYER_ALIGN
        if pos < vsize:
            extents.append(Extent(pos, vsize - pos, None))
        extents.sort(key=lambda e: e.offset)
        full_meta = {"source": path.name, **(meta or {})}
        layer = Manifest(DISK_LAYER, vsize, tuple(coalesce(extents)), parent=None, chunk_size=cs,
                         meta=tuple(sorted(full_meta.items())))
        mid = ws.add_manifest(layer)
        res = ws.commit(image_record(name, mid, full_meta, time.time()), exclusive=exclusive)
    return ImportResult(name, mid, vsize, data_bytes, vsize - data_bytes, res.chunks_added, res.chunks_deduped,
                        time.perf_counter() - t0)


def tree_size(directory: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(directory):
        total += 4096 * (len(dirs) + 1)
        for fn in files:
            try:
                total += os.lstat(os.path.join(root, fn)).st_size + 4096
            except OSError:
                pass
    return total


def import_tree(store: "Store", directory: Path, name: str, size: int | None = None,
                meta: dict[str, str] | None = None, exclusive: bool = True) -> ImportResult:
    """A directory tree becomes an ext4 base layer (``mkfs.ext4 -d``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ImageError(f"{directory}: not a directory")
    if shutil.which("mkfs.ext4") is None:
        raise ImageError("mkfs.ext4 not found (install e2fsprogs)")
    if size is None:
        # room for metadata and growth: 1.5x content + 64 MiB, in whole MiB
        size = -(-(tree_size(directory) * 3 // 2 + 64 * MiB) // MiB) * MiB
    tmp_root = store.settings.paths.workspace
    tmp_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tmp_root, prefix="mkfs-") as td:
        img = Path(td) / "rootfs.ext4"
        with open(img, "wb") as f:
            f.truncate(size)
        proc = subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-d", str(directory), str(img)],
                              capture_output=True, text=True, env=child_env())
        if proc.returncode != 0:
            raise ImageError(f"mkfs.ext4 -d {directory} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        return import_raw(store, img, name, {"source": directory.name or "tree", "fs": "ext4", **(meta or {})},
                          exclusive=exclusive)


def export_raw(store: "Store", top: Digest, out: Path) -> int:
    """Flatten the image whose top layer is ``top`` into a raw file; returns the image size."""
    with BlockImage.open(store, top, name="export") as image:
        flatten_to(image, Path(out))
        return image.size
