"""Memory images of paused sandboxes: a flattened page map over a base image.

A sandbox maps a *base* memory image (its template's, a full image) ``share=off``;
the pages it holds privately are exactly the pages that differ from the base.
A pause stores those pages as a **delta over the base** — not over the previous
pause — so a delta is always one flattened page map (page → chunk) and restore
never walks a chain: base file + one delta. Successive pauses stay incremental
in the store: each page's xxh3 is kept, and a page whose hash did not change
since the previous pause reuses that pause's chunk id (no BLAKE3, no new data).

Local form (``memory.delta``, version 1, little endian)::

    8   magic "AENVMDL1"
    4   version = 1
    4   page size = 4096
    8   memory size (bytes)
    32  base memory manifest id
    8   n = page count
    8n  page numbers (u64, strictly ascending)
    8n  xxh3-64 of each page
    ..  zero padding to a multiple of 4096
    4096n page bytes, in page-number order

Store form: a manifest of media type ``application/vnd.aenv.memory-delta``,
chunk size 4096, parent = the base manifest, one 4 KiB extent per page (data,
or zero for a page that became all zeros); gaps read from the base.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from aenv_store.errors import StoreError
from aenv_store.ids import Digest
from aenv_store.manifest import Extent, Manifest
from aenv_store.store import Store

from ..qemu.errors import VmError
from .pagemap import PAGE, runs
from .vmstate import durable_write

MEMORY_DELTA = "application/vnd.aenv.memory-delta"
MAGIC = b"AENVMDL1"
VERSION = 1
_HEAD = struct.Struct("<8sIIQ32sQ")


class MemoryImageError(VmError):
    """A memory delta is missing, corrupt, or does not fit its base."""


@dataclass(frozen=True)
class Delta:
    base: Digest
    memory_size: int
    pages: np.ndarray           # int64 page numbers, ascending
    hashes: np.ndarray          # uint64 xxh3 per page
    data: memoryview            # len(pages) * 4096 bytes

    @property
    def nbytes(self) -> int:
        return len(self.pages) * PAGE


def page_hashes(data: bytes | bytearray | memoryview) -> np.ndarray:
    mv = memoryview(data)
    n = len(mv) // PAGE
    out = np.empty(n, dtype=np.uint64)
    h = xxhash.xxh3_64_intdigest
    for i in range(n):
        out[i] = h(mv[i * PAGE:(i + 1) * PAGE])
    return out


def _data_offset(n: int) -> int:
    head = _HEAD.size + 16 * n
    return -(-head // PAGE) * PAGE


def write_delta(path: Path, delta: Delta, sync: bool = True) -> None:
    """Write ``delta`` as a whole (tmp → rename: never a torn file under its name).
    ``sync``: fsync file and directory first (else call ``sync_file`` later)."""
    n = len(delta.pages)
    head = _HEAD.pack(MAGIC, VERSION, PAGE, delta.memory_size, bytes(delta.base), n)
    body = head + delta.pages.astype("<u8").tobytes() + delta.hashes.astype("<u8").tobytes()
    body += bytes(_data_offset(n) - len(body))
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(body)
        f.write(delta.data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        sync_file(path.parent)


def sync_file(path: Path) -> None:
    """fsync a file or directory."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_delta(path: Path) -> Delta:
    """A local delta (page data memory-mapped, not copied)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                raise MemoryImageError(f"{path}: truncated header")
            magic, version, page, mem_size, base, n = _HEAD.unpack(head)
            if magic != MAGIC or version != VERSION or page != PAGE:
                raise MemoryImageError(f"{path}: not a version-{VERSION} memory delta")
            if size != _data_offset(n) + n * PAGE or n > mem_size // PAGE:
                raise MemoryImageError(f"{path}: {size} bytes do not match {n} pages")
            idx = f.read(16 * n)
            pages = np.frombuffer(idx[:8 * n], dtype="<u8").astype(np.int64)
            hashes = np.frombuffer(idx[8 * n:], dtype="<u8").astype(np.uint64)
            if n and (np.any(np.diff(pages) <= 0) or pages[0] < 0 or pages[-1] >= mem_size // PAGE):
                raise MemoryImageError(f"{path}: page numbers out of order or out of range")
            data = memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))[_data_offset(n):] if n \
                else memoryview(b"")
    except OSError as e:
        raise MemoryImageError(f"cannot read memory delta {path}: {e}") from None
    return Delta(Digest(base), mem_size, pages, hashes, data)


def page_map(manifest: Manifest) -> tuple[np.ndarray, list[Digest | None]]:
    """(page numbers, chunk per page; None = zero page) of a delta manifest."""
    pages: list[int] = []
    chunks: list[Digest | None] = []
    for e in manifest.extents:
        for off in range(e.offset, e.end, PAGE):
            pages.append(off // PAGE)
            chunks.append(e.chunk)
    return np.asarray(pages, dtype=np.int64), chunks


@dataclass(frozen=True)
class CommitStats:
    pages: int          # pages in the delta
    staged: int         # pages hashed with BLAKE3 and staged (changed since the previous pause)


def stage_delta(ws, delta: Delta, previous: tuple[Delta, Manifest] | None,  # type: ignore[no-untyped-def]
                meta: dict[str, str]) -> tuple[Digest, CommitStats]:
    """Stage ``delta`` as a delta manifest in workspace ``ws``. Pages whose xxh3 equals
    the previous pause's (same page number) reuse its chunk without being read."""
    n = len(delta.pages)
    chunks: list[Digest | None] = [None] * n
    todo = np.ones(n, dtype=bool)
    if previous is not None and n:
        prev_delta, prev_manifest = previous
        pm_pages, pm_chunks = page_map(prev_manifest)
        if len(pm_pages) == len(prev_delta.pages) and np.array_equal(pm_pages, prev_delta.pages):
            pos = np.searchsorted(prev_delta.pages, delta.pages)
            pos_c = np.minimum(pos, max(len(prev_delta.pages) - 1, 0))
            same = (len(prev_delta.pages) > 0) & (prev_delta.pages[pos_c] == delta.pages) \
                & (prev_delta.hashes[pos_c] == delta.hashes)
            for i in np.flatnonzero(same).tolist():
                chunks[i] = pm_chunks[int(pos_c[i])]
            todo &= ~same
    idx = np.flatnonzero(todo).tolist()
    for k in range(0, len(idx), 256):
        part = idx[k:k + 256]
        got = ws.stage_many([delta.data[i * PAGE:(i + 1) * PAGE] for i in part])
        for i, cid in zip(part, got):
            chunks[i] = cid
    extents = [Extent(int(p) * PAGE, PAGE, c) for p, c in zip(delta.pages.tolist(), chunks)]
    manifest = Manifest(MEMORY_DELTA, delta.memory_size, tuple(extents), parent=delta.base, chunk_size=PAGE,
                        meta=tuple(sorted(meta.items())))
    return ws.add_manifest(manifest), CommitStats(n, len(idx))


def fetch_delta(store: Store, mid: Digest) -> tuple[Delta, Manifest]:
    """A delta from the store (node cache → peers → repository), hashes recomputed."""
    try:
        manifest = store.load_manifest(mid)
        if manifest.media_type != MEMORY_DELTA or manifest.parent is None:
            raise MemoryImageError(f"{mid.short()} is a {manifest.media_type}, not a memory delta")
        pages, chunks = page_map(manifest)
        data = bytearray(len(pages) * PAGE)
        want = [(i, c) for i, c in enumerate(chunks) if c is not None]
        for k in range(0, len(want), 1024):
            part = want[k:k + 1024]
            for (i, _), blob in zip(part, store.read_chunks([c for _, c in part])):
                if len(blob) != PAGE:
                    raise MemoryImageError(f"memory delta {mid.short()}: chunk of {len(blob)} bytes")
                data[i * PAGE:(i + 1) * PAGE] = blob
    except StoreError as e:
        raise MemoryImageError(f"memory delta {mid.short()} cannot be read from the store: {e}") from None
    return Delta(manifest.parent, manifest.size, pages, page_hashes(data), memoryview(data)), manifest


def consolidate(base_file: Path, delta: Delta, out: Path) -> None:
    """A full memory file: the base (holes kept) with the delta's pages written over it."""
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    size = os.path.getsize(base_file)
    if size != delta.memory_size:
        raise MemoryImageError(f"base {base_file} has {size} bytes, delta wants {delta.memory_size}")
    with open(base_file, "rb") as src, open(tmp, "wb") as dst:
        dst.truncate(size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(src.fileno(), pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            while start < end:
                n = os.copy_file_range(src.fileno(), dst.fileno(), end - start, start, start)
                if n <= 0:
                    raise MemoryImageError(f"copy of {base_file} stopped at {start}")
                start += n
            pos = end
        first, length, at = runs(delta.pages)
        for p, n, i in zip(first.tolist(), length.tolist(), at.tolist()):
            os.pwrite(dst.fileno(), delta.data[i * PAGE:(i + n) * PAGE], p * PAGE)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, out)


__all__ = ["Delta", "MEMORY_DELTA", "MemoryImageError", "page_hashes", "write_delta", "read_delta",
           "stage_delta", "fetch_delta", "consolidate", "durable_write", "sync_file", "CommitStats"]
