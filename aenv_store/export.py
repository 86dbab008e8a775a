"""Writing a blob into a local file: a restore, ``aenv image export``.

The caller gives a ``read(offset, length)`` (a BlobReader's, or a layered image's)
and the size; ``write_file`` reads it front to back in BLOCK windows (so a
BlobReader reads ahead) and writes the file:

- **Sparse**: the file is sized first and all-zero GRAIN pieces stay holes (they
  read back as zeros); a disk image is mostly free space.
- **Past the page cache** (O_DIRECT) from a few page-aligned buffers that are
  reused: an exported image is written once and read later by something else, and
  on the VMs this runs on, buffered writes cost far more than the bytes suggest. A
  buffered write larger than 64 KiB gets large page-cache folios, made of memory the
  guest had handed back to the host, and every first touch of it faults on the host
  (4 MiB writes: 3-8x the kernel time of 64 KiB ones, docs/benchmarks.md "Cold
  read-back"); writes of 64 KiB each would instead cost a GIL hand-over per syscall
  while the store's read-ahead threads run Python (16k of them for a 1 GiB image).
- **Behind the reads**: a writer thread takes filled buffers (DEPTH of them), so
  the reader's next window overlaps the disk write of the last one.

A filesystem without O_DIRECT (EINVAL) gets the same pieces written buffered.
Pieces whose length is not a multiple of the 4 KiB O_DIRECT granularity (the tail of
an odd-sized blob) are written through a second, buffered descriptor."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
from pathlib import Path
from typing import Callable

BLOCK = 4 << 20      # bytes read (and written) per window
GRAIN = 64 << 10     # the smallest hole: an all-zero piece of this size is not written
DEPTH = 3            # windows filled and waiting for (or being written by) the writer thread
DIRECT_ALIGN = 4096  # O_DIRECT offset and length granularity (logical blocks of every disk here)

Read = Callable[[int, int], bytes]


def data_runs(data: bytes, grain: int = GRAIN) -> list[tuple[int, int]]:
    """[start, end) runs of ``data`` made of grain pieces that are not all zeros."""
    zero = bytes(grain)
    runs: list[tuple[int, int]] = []
    start = -1
    n = len(data)
    for off in range(0, n, grain):
        # startswith compares in C without copying the piece (a memoryview compare is 80x slower)
        if data.startswith(zero[:min(grain, n - off)], off):
            if start >= 0:
                runs.append((start, off))
                start = -1
        elif start < 0:
            start = off
    if start >= 0:
        runs.append((start, n))
    return runs


class _Output:
    """The file: an O_DIRECT descriptor when the filesystem takes it, and a buffered one."""

    def __init__(self, path: Path, size: int, direct: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.direct_fd = -1
        try:
            os.ftruncate(self.fd, size)
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self.direct_fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, data: memoryview, offset: int) -> None:
        if self.direct_fd >= 0 and offset % DIRECT_ALIGN == 0 and len(data) % DIRECT_ALIGN == 0:
            try:
                _pwrite_all(self.direct_fd, data, offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.close(self.direct_fd)   # refused after all: buffered from now on
                self.direct_fd = -1
        for k in range(0, len(data), GRAIN):   # 64 KiB pieces: small page-cache folios
            _pwrite_all(self.fd, data[k:k + GRAIN], offset + k)

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1


def write_file(read: Read, size: int, out: Path, direct: bool = True) -> int:
    """Write bytes [0, size) of ``read`` into the file ``out`` (created or truncated);
    returns the bytes written (holes not counted). ``direct=False``: buffered writes.
    Errors of reading or writing are raised here; the file is then incomplete."""
    output = _Output(Path(out), size, direct)
    free: queue.Queue[mmap.mmap] = queue.Queue()
    for _ in range(DEPTH):
        free.put(mmap.mmap(-1, BLOCK))   # anonymous mappings are page aligned, as O_DIRECT needs
    filled: queue.Queue[tuple[mmap.mmap, int, list[tuple[int, int]]] | None] = queue.Queue()
    failed: list[BaseException] = []
    written = 0

    def writer() -> None:
        nonlocal written
        while (item := filled.get()) is not None:
            buf, pos, runs = item
            try:
                if not failed:
                    view = memoryview(buf)
                    for a, b in runs:
                        output.write(view[a:b], pos + a)
                        written += b - a
                    view.release()
            except BaseException as e:  # noqa: BLE001 - handed to the reading thread
                failed.append(e)
            finally:
                free.put(buf)

    thread = threading.Thread(target=writer, name="aenv-export-write", daemon=True)
    thread.start()
    try:
        for pos in range(0, size, BLOCK):
            data = read(pos, min(BLOCK, size - pos))
            if len(data) != min(BLOCK, size - pos):
                raise OSError(errno.EIO, f"short read at {pos}: {len(data)} bytes")
            runs = data_runs(data)
            buf = free.get()
            if failed:
                free.put(buf)
                break
            base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            src = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
            for a, b in runs:
                # ctypes calls release the GIL: the store's threads go on during the copy
                ctypes.memmove(base + a, src + a, b - a)
            filled.put((buf, pos, runs))
    finally:
        filled.put(None)
        thread.join()
        output.close()
        while not free.empty():
            free.get().close()
    if failed:
        raise failed[0]
    return written


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
