"""A QEMU process's private guest pages, read from /proc without QEMU's help.

A sandbox maps its base memory image ``share=off`` (``MAP_PRIVATE``): pages the
guest never wrote stay the file's page-cache pages, every page it wrote became
an anonymous copy. ``/proc/PID/pagemap`` tells them apart per page (bit 63
present, bit 62 swapped, bit 61 "file page or shared anonymous"), so the set of
pages that differ from the base is exact: no dirty logging, no KVM needed.
Those pages are then read (and, on resume, written back into a new QEMU) through
``/proc/PID/mem`` in coalesced runs: one syscall per run of adjacent pages,
never one per page.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..errors import VmError

PAGE = 4096
_PRESENT = np.uint64(1 << 63)
_SWAPPED = np.uint64(1 << 62)
_FILE = np.uint64(1 << 61)
# Linux caps one read/write on /proc/PID/mem at what fits in a page-sized buffer
# loop internally; runs are split so one call never asks for more than this.
_MAX_IO = 8 << 20


class PagemapError(VmError):
    """The RAM mapping of a QEMU process could not be found or read."""


@dataclass(frozen=True)
class RamMapping:
    start: int          # virtual address of guest RAM offset `file_offset`
    end: int
    file_offset: int

    @property
    def pages(self) -> int:
        return (self.end - self.start) // PAGE


def parse_maps(text: str, path: Path | str) -> RamMapping:
    """The mapping of ``path`` in a /proc/PID/maps text (the largest, if several)."""
    best: RamMapping | None = None
    want = str(path)
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == want:
            a, b = (int(x, 16) for x in parts[0].split("-"))
            m = RamMapping(a, b, int(parts[2], 16))
            if best is None or m.pages > best.pages:
                best = m
    if best is None:
        raise PagemapError(f"{want} is not mapped")
    return best


def ram_mapping(pid: int, path: Path | str) -> RamMapping:
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError as e:
        raise PagemapError(f"cannot read the memory map of pid {pid}: {e}") from None
    return parse_maps(text, path)


def private_mask(entries: np.ndarray) -> np.ndarray:
    """Which pagemap entries are private copies (present anonymous, or swapped)."""
    e = entries.astype(np.uint64, copy=False)
    return (((e & _PRESENT) != 0) & ((e & _FILE) == 0)) | ((e & _SWAPPED) != 0)


def private_pages(pid: int, mapping: RamMapping) -> np.ndarray:
    """Guest page numbers (file offset / 4096, ascending) that the process holds privately."""
    try:
        with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), mapping.pages * 8, (mapping.start // PAGE) * 8)
    except OSError as e:
        raise PagemapError(f"cannot read the pagemap of pid {pid}: {e}") from None
    if len(raw) != mapping.pages * 8:
        raise PagemapError(f"short pagemap read for pid {pid}")
    idx = np.flatnonzero(private_mask(np.frombuffer(raw, dtype="<u8")))
    return idx.astype(np.int64) + mapping.file_offset // PAGE


def runs(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of adjacent page numbers in a sorted array: (first page, length, index of
    the run's first element in ``pages``). Vectorised."""
    if len(pages) == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts_i = np.concatenate(([0], breaks)).astype(np.int64)
    ends_i = np.concatenate((breaks, [len(pages)])).astype(np.int64)
    return pages[starts_i].astype(np.int64), ends_i - starts_i, starts_i


def _io_runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    first, length, at = runs(pages)
    out = []
    step = _MAX_IO // PAGE
    for p, n, i in zip(first.tolist(), length.tolist(), at.tolist()):
        for k in range(0, n, step):
            out.append((p + k, min(step, n - k), i + k))
    return out


_IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                                   ctypes.c_ulong]


def _vm_readv(pid: int, mapping: RamMapping, pages: np.ndarray, view: memoryview) -> None:
    """All runs of ``pages`` into ``view`` with process_vm_readv: up to 1024 runs per
    system call (one /proc/PID/mem read per run gave the GIL up and back per run, which
    a busy event loop thread turned into waits)."""
    first, length, at = runs(pages)
    if not len(first):
        return
    local = (ctypes.c_char * len(view)).from_buffer(view)
    dst = np.empty((len(first), 2), dtype=np.uint64)
    dst[:, 0] = ctypes.addressof(local) + at.astype(np.uint64) * PAGE
    dst[:, 1] = length.astype(np.uint64) * PAGE
    src = dst.copy()
    src[:, 0] = np.uint64(mapping.start - mapping.file_offset) + first.astype(np.uint64) * PAGE
    for k in range(0, len(first), _IOV_MAX):
        n = min(_IOV_MAX, len(first) - k)
        want = int(dst[k:k + n, 1].sum())
        got = _libc.process_vm_readv(pid, dst[k:].ctypes.data, n, src[k:].ctypes.data, n, 0)
        if got != want:
            err = ctypes.get_errno() if got < 0 else 0
            raise PagemapError(f"short read of guest memory from pid {pid} ({got} of {want} bytes"
                               f"{', ' + os.strerror(err) if err else ''})")
    del local


PageBuffer = bytearray | mmap.mmap


def read_and_hash(pid: int, mapping: RamMapping, pages: np.ndarray,
                  buffer: PageBuffer | None = None) -> tuple[memoryview, np.ndarray]:
    """The current bytes of ``pages`` (sorted guest page numbers) in pid's RAM mapping, and
    each page's xxh3.

    The bytes land in ``buffer`` when it is large enough (callers keep it across
    pauses: a fresh buffer costs a page fault per 4 KiB on first touch, 26 MiB
    took 25-35 ms here instead of 8), else in a new one with headroom, so that a
    delta that grew by a few pages still fits next time."""
    need = len(pages) * PAGE
    if buffer is None or len(buffer) < need:
        # an anonymous mapping, not a bytearray (which zero-fills, making the headroom
        # resident): only the pages read into are resident, the headroom costs nothing
        buffer = mmap.mmap(-1, -(-(need + need // 4 + (4 << 20)) // (1 << 20)) << 20, flags=mmap.MAP_PRIVATE)
    view = memoryview(buffer)[:need]
    _vm_readv(pid, mapping, pages, view)
    h = xxhash.xxh3_64_intdigest
    hashes = np.fromiter(map(h, (view[k:k + PAGE] for k in range(0, need, PAGE))), dtype=np.uint64,
                         count=len(pages))
    return view, hashes


def write_pages(pid: int, mapping: RamMapping, pages: np.ndarray, data: bytes | bytearray | memoryview,
                written: Callable[[int, int], None] | None = None) -> None:
    """Write ``data`` (len(pages) pages) into pid's RAM mapping: in a ``share=off``
    mapping this makes private copies, exactly what the paused VM had.
    ``written(first, end)``: called after each window of at most 8 MiB with the indexes
    (into ``pages``) it wrote, in order (the caller may drop them from memory)."""
    view = memoryview(data)
    if len(view) != len(pages) * PAGE:
        raise PagemapError(f"{len(view)} bytes for {len(pages)} pages")
    base = mapping.start - mapping.file_offset
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    except OSError as e:
        raise PagemapError(f"cannot open the memory of pid {pid}: {e}") from None
    try:
        done = 0
        for p, n, i in _io_runs(pages):
            if os.pwritev(fd, [view[i * PAGE:(i + n) * PAGE]], base + p * PAGE) != n * PAGE:
                raise PagemapError(f"short write of guest pages {p}..{p + n} to pid {pid}")
            if written is not None and (i + n - done) * PAGE >= _MAX_IO:
                written(done, i + n)
                done = i + n
        if written is not None and done < len(pages):
            written(done, len(pages))
    finally:
        os.close(fd)
