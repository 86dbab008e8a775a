"""The node cache's segment files (format ``aenv-node-cache/2``, spec in docs/cache.md).

A segment holds the chunks of one fill (a batch of misses fetched together, or
one put_many): a versioned header listing them, then each chunk at a 4 KiB
aligned offset, so one fill is one file and one write instead of a file, a
rename and an inode per chunk, and every chunk can still be mapped on its own
(mmap offsets must be page aligned). The LMDB index names an entry's segment
and offset; the header makes a segment self-describing for verification.

Segments are never rewritten: a segment id is random and used once, a file is
complete before any index entry names it, and it is unlinked only when no
entry names it any more. So a checked mapping stays valid for as long as it is
held (an unlinked file's pages live on until the last mapping goes).

Fills a reader takes as bytes are written with O_DIRECT: the reader already has
the bytes, and on a VM whose free pages are handed back to the host, filling
the page cache costs about what the whole restore costs. Fills that are mapped
next (block images) go through the page cache so the mapping finds them there.
"""
from __future__ import annotations

import enum
import errno
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from typing import Sequence

import xxhash

from ..aligned import AlignedBuffer

# A chunk as a reader gets it: bytes, or a read-only mapping of its place in a segment.
ChunkData = bytes | mmap.mmap

MAGIC = b"aenvseg\0"
VERSION = 1
ALIGN = 4096                       # chunk offsets and the header's length: page (and O_DIRECT) aligned
HEAD = struct.Struct("<8sHHII")    # magic, version, flags (0), count, data start
ITEM = struct.Struct("<32sQQQ")    # digest, offset, size, xxh3-64 of the chunk
TRAILER = struct.Struct("<Q")      # xxh3-64 of the header's bytes before it


class SegmentFormatError(ValueError):
    """A segment header that is not one this code writes."""


@dataclass(frozen=True)
class SegmentItem:
    digest: bytes
    offset: int
    size: int
    checksum: int


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def header_length(count: int) -> int:
    return align(HEAD.size + count * ITEM.size + TRAILER.size)


def layout(sizes: Sequence[int]) -> tuple[int, list[int]]:
    """(file length, offset of each chunk) of a segment holding chunks of these sizes."""
    pos = header_length(len(sizes))
    offsets = []
    for size in sizes:
        offsets.append(pos)
        pos += align(size)
    return pos, offsets


def encode_header(items: Sequence[SegmentItem]) -> bytes:
    """The header, padded with zeros to its aligned length."""
    start = header_length(len(items))
    body = HEAD.pack(MAGIC, VERSION, 0, len(items), start) + b"".join(
        ITEM.pack(i.digest, i.offset, i.size, i.checksum) for i in items)
    body += TRAILER.pack(xxhash.xxh3_64_intdigest(body))
    return body + bytes(start - len(body))


def decode_header(data: bytes | memoryview) -> list[SegmentItem]:
    """The items of a header (``data``: at least the header's bytes); SegmentFormatError if
    it is not a well-formed version-1 header whose items fit after it without overlapping."""
    if len(data) < HEAD.size:
        raise SegmentFormatError("segment shorter than its header")
    magic, version, flags, count, start = HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SegmentFormatError("not a node-cache segment")
    if version != VERSION or flags:
        raise SegmentFormatError(f"segment version {version} flags {flags}; this build reads version {VERSION}")
    if start != header_length(count):
        raise SegmentFormatError(f"segment header length {start} does not fit {count} items")
    end = HEAD.size + count * ITEM.size
    if len(data) < end + TRAILER.size:
        raise SegmentFormatError("segment header truncated")
    if TRAILER.unpack_from(data, end)[0] != xxhash.xxh3_64_intdigest(bytes(data[:end])):
        raise SegmentFormatError("segment header checksum mismatch")
    items = [SegmentItem(*ITEM.unpack_from(data, HEAD.size + k * ITEM.size)) for k in range(count)]
    pos = start
    for item in items:
        if item.offset < pos or item.offset % ALIGN:
            raise SegmentFormatError(f"segment item at {item.offset} overlaps or is not aligned")
        pos = item.offset + item.size
    return items


_ZEROS = memoryview(bytes(ALIGN))   # padding after a chunk whose size is not aligned


class SegmentWriter:
    """Writes segment files; O_DIRECT where the filesystem supports it (else buffered).
    Thread-safe: each thread builds its segments in its own aligned buffer."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.direct_ok = hasattr(os, "O_DIRECT")

    def _buffer(self, n: int) -> AlignedBuffer:
        buf: AlignedBuffer | None = getattr(self._local, "buf", None)
        if buf is None or buf.size < n:
            if buf is not None:
                buf.close()
            buf = self._local.buf = AlignedBuffer(max(n, 1 << 20))   # kept for the next fill
        return buf

    def write(self, path: str, chunks: Sequence[tuple[bytes, bytes, int]], direct: bool) -> list[int]:
        """Write a new segment (O_EXCL) holding ``chunks`` (digest, data, xxh3); returns each
        chunk's offset. The file is complete when this returns; OSError otherwise (the
        caller unlinks it)."""
        length, offsets = layout([len(data) for _, data, _ in chunks])
        header = encode_header([SegmentItem(d, off, len(data), c) for (d, data, c), off in zip(chunks, offsets)])
        parts: list[bytes | memoryview] = [header]
        for data, off, nxt in zip((c[1] for c in chunks), offsets, offsets[1:] + [length]):
            parts.append(data)
            if nxt - off - len(data):
                parts.append(_ZEROS[:nxt - off - len(data)])
        if direct and self.direct_ok:
            buf = self._buffer(length)
            buf.put(parts)
            view = memoryview(buf.map)
            try:
                if self._write_direct(path, view[:length]):
                    return offsets
            finally:
                view.release()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, parts)
        finally:
            os.close(fd)
        return offsets

    def _write_direct(self, path: str, view: memoryview) -> bool:
        """False if this filesystem refuses O_DIRECT (then writes are buffered from now on)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct_ok = False
            return False
        try:
            _write_all(fd, [view])
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            os.ftruncate(fd, 0)
            os.close(fd)
            os.unlink(path)
            self.direct_ok = False
            return False
        os.close(fd)
        return True


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    # writev in groups (IOV_MAX is 1024 on Linux); a short write continues where it stopped
    for k in range(0, len(parts), 512):
        views = [memoryview(p) for p in parts[k:k + 512]]
        while views:
            n = os.writev(fd, views)
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]


class Found(enum.Enum):
    OK = "ok"
    GONE = "gone"           # no file (evicted by another process between two steps, or a crash)
    CORRUPT = "corrupt"     # a file too short for the entry, or bytes whose xxh3 is not the entry's


def read_checked(path: str, offset: int, size: int, checksum: int, mapped: bool) -> tuple[Found, ChunkData | None]:
    """A chunk's place in its segment checked against its index entry (size and xxh3,
    a mapping too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Found.GONE, None
    data: ChunkData | None = None
    try:
        if os.fstat(fd).st_size < offset + size:
            pass  # truncated: mapping past the end would fault (SIGBUS) on access
        elif not mapped or not size:
            data = os.pread(fd, size, offset)
        elif offset % mmap.ALLOCATIONGRANULARITY == 0:
            data = mmap.mmap(fd, size, prot=mmap.PROT_READ, offset=offset)
    finally:
        os.close(fd)
    if data is None or len(data) != size or xxhash.xxh3_64_intdigest(data) != checksum:
        if isinstance(data, mmap.mmap):
            data.close()
        return Found.CORRUPT, None
    return Found.OK, data


def map_exact(path: str, offset: int, size: int) -> mmap.mmap | None:
    """A read-only mapping of a chunk this process has just written and verified (only the
    file's length is checked); None if it is gone already or too short."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if not size or os.fstat(fd).st_size < offset + size:
            return None
        return mmap.mmap(fd, size, prot=mmap.PROT_READ, offset=offset)
    finally:
        os.close(fd)


def read_header(path: str) -> list[SegmentItem]:
    """The items of a segment file's header (OSError, SegmentFormatError)."""
    with open(path, "rb") as f:
        head = f.read(HEAD.size)
        if len(head) < HEAD.size:
            raise SegmentFormatError("segment shorter than its header")
        start = HEAD.unpack(head)[4]
        if start > 64 << 20:
            raise SegmentFormatError(f"segment header length {start} is implausible")
        return decode_header(head + f.read(start - HEAD.size))
