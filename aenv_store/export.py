"""Writing a blob into a local file: a restore, ``aenv image export``.

The caller gives the size and a ``read(offset, length)`` (a layered image's, which
reads ahead itself) to ``write_file``, or a ``read_parts(offset, length)`` (a
BlobReader's: a window as the pieces it is made of, not joined, not read ahead) to
``write_parts``. They read the source in BLOCK windows (``write_parts`` on READERS
threads at once: the store's fetches of two windows overlap) and write the file:

- **Sparse**: the file is sized first and all-zero GRAIN pieces stay holes (they
  read back as zeros); a disk image is mostly free space.
- **One copy**: the pieces of a window are copied straight into a reused output
  buffer (joining them first was a second copy of every byte).
- **Past the page cache** (O_DIRECT) from those page-aligned buffers: an exported
  image is written once and read later by something else, and on the VMs this runs
  on, buffered writes cost far more than the bytes suggest. A buffered write larger
  than 64 KiB gets large page-cache folios, made of memory the guest had handed back
  to the host, and every first touch of it faults on the host (4 MiB writes: 3-8x
  the kernel time of 64 KiB ones, docs/benchmarks.md "Cold read-back"); writes of
  64 KiB each would instead cost a GIL hand-over per syscall while the store's
  threads run Python (16k of them for a 1 GiB image).
- **Behind the reads**: the calling thread writes filled buffers while the readers
  fill the next ones (DEPTH buffers beyond one per reader).

A filesystem without O_DIRECT (EINVAL) gets the same pieces written buffered.
Pieces whose length is not a multiple of the 4 KiB O_DIRECT granularity (the tail of
an odd-sized blob) are written through a second, buffered descriptor."""
from __future__ import annotations

import errno
import os
import queue
import threading
from pathlib import Path
from typing import Callable, Sequence

from .aligned import AlignedBuffer, Part

BLOCK = 4 << 20      # bytes read (and written) per window
GRAIN = 64 << 10     # the smallest hole: an all-zero piece of this size is not written
DEPTH = 3            # buffers beyond one per reader: filled, waiting for or being written
READERS = 2          # threads reading windows at once in write_parts
DIRECT_ALIGN = 4096  # O_DIRECT offset and length granularity (logical blocks of every disk here)

Read = Callable[[int, int], bytes]
ReadParts = Callable[[int, int], Sequence[Part]]
_ZERO = bytes(GRAIN)


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
    Windows are read one at a time, in order (so a source that reads ahead sees a
    sequential reader). Errors of reading or writing are raised here; the file is then
    incomplete."""
    return _write(lambda offset, length: (read(offset, length),), size, out, direct, 1)


def write_parts(read_parts: ReadParts, size: int, out: Path, direct: bool = True,
                readers: int = READERS) -> int:
    """``write_file`` from a source that gives a window as pieces, in order; ``readers``
    threads read windows at once (the source must be thread-safe)."""
    if readers < 1:
        raise ValueError(f"readers must be >= 1, got {readers}")
    return _write(read_parts, size, out, direct, readers)


def _write(read_parts: ReadParts, size: int, out: Path, direct: bool, readers: int) -> int:
    output = _Output(Path(out), size, direct)
    free: queue.Queue[AlignedBuffer] = queue.Queue()
    buffers = [AlignedBuffer(BLOCK) for _ in range(readers + DEPTH - 1)]
    for buf in buffers:
        free.put(buf)
    filled: queue.Queue[tuple[AlignedBuffer, int, list[tuple[int, int]]] | None] = queue.Queue()
    failed: list[BaseException] = []
    windows = iter(range(0, size, BLOCK))
    windows_lock = threading.Lock()

    def reader() -> None:
        try:
            while not failed:
                with windows_lock:
                    pos = next(windows, None)
                if pos is None:
                    return
                want = min(BLOCK, size - pos)
                parts = read_parts(pos, want)
                got = sum(len(p) for p in parts)
                if got != want:
                    raise OSError(errno.EIO, f"short read at {pos}: {got} bytes")
                buf = free.get()
                if failed:
                    free.put(buf)
                    return
                filled.put((buf, pos, fill(buf, parts, want)))
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            failed.append(e)
        finally:
            filled.put(None)

    threads = [threading.Thread(target=reader, name=f"aenv-export-read-{k}", daemon=True) for k in range(readers)]
    for thread in threads:
        thread.start()
    written = 0
    finished = 0
    try:
        while finished < readers:
            item = filled.get()
            if item is None:
                finished += 1
                continue
            buf, pos, runs = item
            try:
                if not failed:
                    view = memoryview(buf.map)
                    for a, b in runs:
                        output.write(view[a:b], pos + a)
                        written += b - a
                    view.release()
            except BaseException as e:  # noqa: BLE001 - stops the readers; raised below
                failed.append(e)
            finally:
                free.put(buf)
    finally:
        if finished < readers:   # interrupted: stop the readers and let them finish
            failed.append(OSError(errno.EINTR, "export interrupted"))
            while finished < readers:
                item = filled.get()
                if item is None:
                    finished += 1
                else:
                    free.put(item[0])
        for thread in threads:
            thread.join()
        output.close()
        for buf in buffers:
            buf.close()
    if failed:
        raise failed[0]
    return written


def fill(buf: AlignedBuffer, parts: Sequence[Part], length: int) -> list[tuple[int, int]]:
    """Copy ``parts`` (``length`` bytes in all) into ``buf`` and return its data runs: the
    [start, end) runs of GRAIN pieces (of the joined bytes) that are not all zeros."""
    data = bytearray((length + GRAIN - 1) // GRAIN)   # 1: the grain holds a byte that is not zero
    pos = 0
    for part in parts:
        n = len(part)
        k = 0
        while k < n:
            step = min(GRAIN - (pos + k) % GRAIN, n - k)   # up to the next grain boundary
            g = (pos + k) // GRAIN
            if not data[g] and not _is_zero(part, k, step):
                data[g] = 1
            k += step
        pos += n
    buf.put(parts)
    return _runs(data, length)


def _is_zero(part: Part, start: int, n: int) -> bool:
    # startswith compares in C without copying the piece (a memoryview compare is 80x slower)
    if type(part) is bytes:
        return part.startswith(_ZERO[:n], start)
    return _ZERO.startswith(part[start:start + n])


def _runs(data: bytearray, length: int) -> list[tuple[int, int]]:
    """Runs of consecutive grains marked 1, in bytes (the last clipped at ``length``)."""
    runs: list[tuple[int, int]] = []
    start = data.find(1)
    while start >= 0:
        end = data.find(0, start)
        if end < 0:
            end = len(data)
        runs.append((start * GRAIN, min(end * GRAIN, length)))
        start = data.find(1, end)
    return runs


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
