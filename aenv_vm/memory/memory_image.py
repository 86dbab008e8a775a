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

Incremental form (version 2, written by a pause whose previous pause is a
version-1 file: only the pages whose xxh3 changed since then are written)::

    8   magic "AENVMDL1"
    4   version = 2
    4   page size = 4096
    8   memory size (bytes)
    32  base memory manifest id
    8   n = page count (all pages of the flattened map)
    8   m = pages stored in this file
    8   parent: seq of the previous pause (its file is ../<seq>/memory.delta, version 1)
    8n  page numbers (u64, strictly ascending)
    8n  xxh3-64 of each page
    8n  where each page is (i64): slot in this file (0..m-1), or -1-slot in the parent
    ..  zero padding to a multiple of 4096
    4096m page bytes of this file, in page-number order

The index is still the whole flattened map (restore reads every page from the
place it names: never a chain walk), and the chain is one link long and short
lived: the pause's background commit rewrites the file as version 1 before the
parent is removed, and resume waits for that commit.

Store form: a manifest of media type ``application/vnd.aenv.memory-delta``,
chunk size 4096, parent = the base manifest, one 4 KiB extent per page (data,
or zero for a page that became all zeros); gaps read from the base.
"""
from __future__ import annotations

import mmap
import os
import threading
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from aenv_store.errors import StoreError
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest
from aenv_store.store import Store
from aenv_store.workspace import Workspace

from ..errors import VmError
from .pagemap import PAGE, runs
from .device_state import durable_write

MEMORY_DELTA = "application/vnd.aenv.memory-delta"
MAGIC = b"AENVMDL1"
VERSION = 1
_HEAD = struct.Struct("<8sIIQ32sQ")
_HEAD2_EXTRA = struct.Struct("<QQ")         # version 2: m, parent seq
INCREMENTAL = 2
SPARE = "spare"     # paused/<sid>/spare: a retired memory.delta the sandbox's next pause overwrites
_IOV_MAX = 1024


class MemoryImageError(VmError):
    """A memory delta is missing, corrupt, or does not fit its base."""


@dataclass(frozen=True)
class Delta:
    base: Digest
    memory_size: int
    pages: np.ndarray           # int64 page numbers, ascending
    hashes: np.ndarray          # uint64 xxh3 per page
    data: memoryview            # len(pages) * 4096 bytes
    # the file mapping ``data`` views (read_delta of a version-1 file) and where in it
    # ``data`` starts: ``release`` drops pages already used from the reader's RSS
    mapped: mmap.mmap | None = None
    mapped_at: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.pages) * PAGE

    def release(self, first: int, end: int) -> None:
        """Drop pages ``first``..``end`` (indexes into ``pages``) of a file-mapped delta
        from this process's resident set (the page cache keeps them: a later read faults
        them back in). A resume writes a delta into the new QEMU window by window and
        releases each window written, so the node's RSS grows by one window, not by the
        delta (tens of MiB for a busy guest)."""
        if self.mapped is None or end <= first:
            return
        try:
            self.mapped.madvise(mmap.MADV_DONTNEED, self.mapped_at + first * PAGE, (end - first) * PAGE)
        except (ValueError, OSError):   # closed or unmapped meanwhile: nothing resident to drop
            pass


_WINDOW = 2048     # pages a windowed pass over a delta reads before releasing them (8 MiB)


def hashes_match(delta: Delta) -> bool:
    """Whether every page of ``delta`` has the xxh3 its index says (a check for a file
    torn by a host crash), read window by window and released (``Delta.release``)."""
    for k in range(0, len(delta.pages), _WINDOW):
        end = min(k + _WINDOW, len(delta.pages))
        ok = (page_hashes(delta.data[k * PAGE:end * PAGE]) == delta.hashes[k:end]).all()
        delta.release(k, end)
        if not ok:
            return False
    return True


def page_hashes(data: bytes | bytearray | memoryview) -> np.ndarray:
    mv = memoryview(data).cast("B")
    n = len(mv) // PAGE
    return np.fromiter(map(xxhash.xxh3_64_intdigest, (mv[k:k + PAGE] for k in range(0, n * PAGE, PAGE))),
                       dtype=np.uint64, count=n)


def _data_offset(n: int, version: int = VERSION) -> int:
    head = _HEAD.size + 16 * n if version == VERSION else _HEAD.size + _HEAD2_EXTRA.size + 24 * n
    return -(-head // PAGE) * PAGE


@dataclass(frozen=True)
class DeltaIndex:
    """The page numbers and hashes of a version-1 delta (what the next pause compares with)."""
    base: Digest
    pages: np.ndarray
    hashes: np.ndarray


def read_index(path: Path) -> DeltaIndex | None:
    """The index of a version-1 delta; None if it is missing or not version 1."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                return None
            magic, version, page, mem_size, base, n = _HEAD.unpack(head)
            if magic != MAGIC or version != VERSION or page != PAGE or n > mem_size // PAGE:
                return None
            idx = f.read(16 * n)
    except OSError:
        return None
    if len(idx) != 16 * n:
        return None
    return DeltaIndex(Digest(base), np.frombuffer(idx[:8 * n], dtype="<u8").astype(np.int64),
                      np.frombuffer(idx[8 * n:], dtype="<u8").astype(np.uint64))


def _open_tmp(path: Path, spare: Path | None) -> tuple[Path, BinaryIO]:
    """The tmp file a delta is written to before its rename: ``spare`` (an old delta
    of the same sandbox, no longer referenced) taken over when there is one.
    Overwriting a file whose pages are in the page cache skips allocating them:
    26 MiB took 4-5 ms that way here, 67-112 ms into a new file at load 10."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    if spare is not None:
        try:
            os.replace(spare, tmp)
            return tmp, open(tmp, "r+b")
        except OSError:
            pass
    return tmp, open(tmp, "wb")


def write_incremental(path: Path, delta: Delta, parent: DeltaIndex, parent_seq: int,
                      spare: Path | None = None) -> int:
    """Write ``delta`` as version 2 over ``parent`` (the previous pause's version-1 file,
    ``../<parent_seq>/memory.delta``): only pages that are new or whose xxh3 changed are
    stored; when none is unchanged, a plain version-1 file is written. tmp → rename, no
    fsync (the background commit syncs). Returns the pages written."""
    if parent.base != delta.base:
        raise MemoryImageError(f"{path}: parent delta is over another base")
    n = len(delta.pages)
    if n == 0 or len(parent.pages) == 0:
        write_delta(path, delta, sync=False, spare=spare)
        return n
    pos_c = np.minimum(np.searchsorted(parent.pages, delta.pages), len(parent.pages) - 1)
    same = (parent.pages[pos_c] == delta.pages) & (parent.hashes[pos_c] == delta.hashes)
    if not same.any():
        write_delta(path, delta, sync=False, spare=spare)
        return n
    own = np.flatnonzero(~same)
    loc = np.where(same, -1 - pos_c, 0).astype(np.int64)
    loc[own] = np.arange(len(own), dtype=np.int64)
    head = _HEAD.pack(MAGIC, INCREMENTAL, PAGE, delta.memory_size, bytes(delta.base), n) + \
        _HEAD2_EXTRA.pack(len(own), parent_seq)
    body = head + delta.pages.astype("<u8").tobytes() + delta.hashes.astype("<u8").tobytes() + \
        loc.astype("<i8").tobytes()
    body += bytes(_data_offset(n, INCREMENTAL) - len(body))
    data = memoryview(delta.data).cast("B")
    first, length, _ = runs(own)         # runs of consecutive delta slots: one iovec each
    iov = [data[i * PAGE:(i + k) * PAGE] for i, k in zip(first.tolist(), length.tolist())]
    tmp, f = _open_tmp(path, spare)
    with f:
        f.write(body)
        f.flush()
        for k in range(0, len(iov), _IOV_MAX):
            part = iov[k:k + _IOV_MAX]
            want = sum(len(v) for v in part)
            done = os.writev(f.fileno(), part)
            if done != want:   # short write: finish it plainly
                f.write(b"".join(bytes(v) for v in part)[done:])
        f.truncate(len(body) + len(own) * PAGE)
    os.replace(tmp, path)
    return len(own)


def write_delta(path: Path, delta: Delta, sync: bool = True, spare: Path | None = None) -> None:
    """Write ``delta`` as a whole (tmp → rename: never a torn file under its name).
    ``sync``: fsync file and directory first (else call ``sync_file`` later).
    ``spare``: an unreferenced old delta file to overwrite instead of a new file."""
    n = len(delta.pages)
    head = _HEAD.pack(MAGIC, VERSION, PAGE, delta.memory_size, bytes(delta.base), n)
    body = head + delta.pages.astype("<u8").tobytes() + delta.hashes.astype("<u8").tobytes()
    body += bytes(_data_offset(n) - len(body))
    tmp, f = _open_tmp(path, spare)
    with f:
        f.write(body)
        f.write(delta.data)
        f.truncate(len(body) + len(delta.data))
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


def is_incremental(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
    except OSError as e:
        raise MemoryImageError(f"cannot read memory delta {path}: {e}") from None
    return len(head) == _HEAD.size and _HEAD.unpack(head)[:2] == (MAGIC, INCREMENTAL)


def parent_seq(path: Path) -> int | None:
    """The pause a version-2 delta takes unchanged pages from (None for version 1)."""
    if not is_incremental(path):
        return None
    with open(path, "rb") as f:
        f.seek(_HEAD.size)
        return int(_HEAD2_EXTRA.unpack(f.read(_HEAD2_EXTRA.size))[1])


def _read_incremental(path: Path, f: BinaryIO, size: int, mem_size: int, base: bytes, n: int) -> Delta:
    """A version-2 delta with its parent's pages filled in (one contiguous copy)."""
    extra = f.read(_HEAD2_EXTRA.size)
    if len(extra) < _HEAD2_EXTRA.size:
        raise MemoryImageError(f"{path}: truncated header")
    m, parent_seq = _HEAD2_EXTRA.unpack(extra)
    if n > mem_size // PAGE or m > n or size != _data_offset(n, INCREMENTAL) + m * PAGE:
        raise MemoryImageError(f"{path}: {size} bytes do not match {n} pages ({m} stored)")
    idx = f.read(24 * n)
    pages = np.frombuffer(idx[:8 * n], dtype="<u8").astype(np.int64)
    hashes = np.frombuffer(idx[8 * n:16 * n], dtype="<u8").astype(np.uint64)
    loc = np.frombuffer(idx[16 * n:], dtype="<i8").astype(np.int64)
    if n and (np.any(np.diff(pages) <= 0) or pages[0] < 0 or pages[-1] >= mem_size // PAGE):
        raise MemoryImageError(f"{path}: page numbers out of order or out of range")
    mine = loc >= 0
    if np.any(loc[mine] >= m) or not np.array_equal(loc[mine], np.arange(int(mine.sum()))):
        raise MemoryImageError(f"{path}: page slots out of order or out of range")
    parent_path = path.parent.parent / str(parent_seq) / path.name
    parent = None
    if not mine.all():
        if is_incremental(parent_path):     # never a chain: a version-2 file's parent is version 1
            raise MemoryImageError(f"{path}: parent {parent_path} is itself incremental")
        parent = read_delta(parent_path)
        if parent.base != Digest(base):
            raise MemoryImageError(f"{path}: parent {parent_path} is over another base")
    out = np.empty((n, PAGE), dtype=np.uint8)
    if m:
        own = np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), dtype=np.uint8,
                            offset=_data_offset(n, INCREMENTAL)).reshape(m, PAGE)
        out[mine] = own
    if parent is not None:
        slots = -1 - loc[~mine]
        if np.any(slots >= len(parent.pages)) or not np.array_equal(parent.pages[slots], pages[~mine]):
            raise MemoryImageError(f"{path}: parent slots do not match {parent_path}")
        out[~mine] = np.frombuffer(parent.data, dtype=np.uint8).reshape(-1, PAGE)[slots]
    return Delta(Digest(base), mem_size, pages, hashes, memoryview(out.reshape(-1)))


def read_delta(path: Path) -> Delta:
    """A local delta (version 1: page data memory-mapped, not copied; version 2: the
    pages of this file and of its parent gathered into memory)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                raise MemoryImageError(f"{path}: truncated header")
            magic, version, page, mem_size, base, n = _HEAD.unpack(head)
            if magic == MAGIC and version == INCREMENTAL and page == PAGE:
                return _read_incremental(path, f, size, mem_size, base, n)
            if magic != MAGIC or version != VERSION or page != PAGE:
                raise MemoryImageError(f"{path}: not a version-{VERSION} memory delta")
            if size != _data_offset(n) + n * PAGE or n > mem_size // PAGE:
                raise MemoryImageError(f"{path}: {size} bytes do not match {n} pages")
            idx = f.read(16 * n)
            pages = np.frombuffer(idx[:8 * n], dtype="<u8").astype(np.int64)
            hashes = np.frombuffer(idx[8 * n:], dtype="<u8").astype(np.uint64)
            if n and (np.any(np.diff(pages) <= 0) or pages[0] < 0 or pages[-1] >= mem_size // PAGE):
                raise MemoryImageError(f"{path}: page numbers out of order or out of range")
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if n else None
            data = memoryview(mapped)[_data_offset(n):] if mapped is not None else memoryview(b"")
    except OSError as e:
        raise MemoryImageError(f"cannot read memory delta {path}: {e}") from None
    return Delta(Digest(base), mem_size, pages, hashes, data, mapped, _data_offset(n))


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


def stage_delta(ws: Workspace, delta: Delta, previous: tuple[Delta, Manifest] | None,
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
        delta.release(part[0], part[-1] + 1)
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


def consolidate(base_file: Path, delta: Delta, out: Path, sync: bool = True) -> None:
    """A full memory file: the base (holes kept) with the delta's pages written over it.
    ``sync`` False: not flushed to disk (the caller syncs it, ``sync_file``, before
    anything that outlives a crash names it)."""
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
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
        if sync:
            os.fsync(dst.fileno())
    os.replace(tmp, out)


__all__ = ["Delta", "DeltaIndex", "MEMORY_DELTA", "MemoryImageError", "page_hashes", "write_delta", "read_delta",
           "read_index", "write_incremental", "is_incremental", "parent_seq",
           "stage_delta", "fetch_delta", "consolidate", "durable_write", "sync_file", "CommitStats"]
