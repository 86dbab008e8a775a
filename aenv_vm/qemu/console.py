"""A QEMU's serial console as the node keeps it: the newest bytes, bounded.

A guest may write its console without end (an agent printing in a loop, kernel
messages from a broken driver, or on purpose). QEMU's ``file`` chardev would write
all of it (up to the jail's file-size limit: guest RAM + 64 MiB per QEMU). Instead
QEMU's serial port is one end of a socket pair (``-chardev socket,fd=N``); the node
reads the other end on its guest-facing loop (aenv_vm/guestio.py) into a
``ConsoleRing``: a file of at most ``capacity`` bytes holding the newest part of
everything the guest wrote, byte for byte in order. When a write would take the file
past ``capacity``, the newest ``capacity / 2`` bytes are moved to its start and the
rest is cut (one copy of half the ring per half a ring written).

The file stays at its old place (the QEMU's ``serial.log``) so what reads it by path
-- a failed boot's diagnostics (``QemuProcess.log_tail``), the accelerator probe --
reads it as before; the logs API reads through ``ConsoleRing.read``, which knows
where in the guest's whole output the file starts. If the node does not keep up, the
socket's buffer fills and QEMU's serial port drops bytes after a few retries: the
guest is never stopped by its console.

The file is the node's (opened by the node, not by QEMU, after QEMU got its run dir),
written through its descriptor only: a confined QEMU that replaces the name changes
nothing the node writes.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from ..guestio import on_guest_loop

CONSOLE_BYTES = 1 << 20         # default capacity of a console ring ([vm] console_kib)
READ_CHUNK = 64 << 10


@dataclass(frozen=True)
class ConsoleSlice:
    """``data`` is the guest's console output from byte ``start`` of all it wrote;
    ``skipped`` bytes before it (asked for, no longer kept) are gone."""
    start: int
    data: bytes
    skipped: int = 0


class ConsoleRing:
    """The newest ``capacity`` bytes (at most) of a console in the file ``path``.

    ``write`` (the reader's thread) and ``read`` (any thread) take one lock."""

    def __init__(self, path: Path, capacity: int = CONSOLE_BYTES) -> None:
        if capacity < 2 * READ_CHUNK:
            raise ValueError(f"a console ring holds at least {2 * READ_CHUNK} bytes, not {capacity}")
        self.path = path
        self.capacity = capacity
        path.unlink(missing_ok=True)    # whatever an earlier QEMU of this run dir left there
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._lock = threading.Lock()
        self.total = 0                  # bytes the guest wrote, all told
        self.base = 0                   # where in them the file starts

    @property
    def size(self) -> int:
        return self.total - self.base

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._fd < 0:
                return
            if self.size + len(data) > self.capacity:
                keep = self.capacity // 2
                if len(data) >= keep:
                    tail = data[-keep:]
                else:
                    tail = os.pread(self._fd, keep - len(data), self.size - (keep - len(data))) + data
                os.pwrite(self._fd, tail, 0)
                os.ftruncate(self._fd, len(tail))
                self.total += len(data)
                self.base = self.total - len(tail)
                return
            os.pwrite(self._fd, data, self.size)
            self.total += len(data)

    def read(self, offset: int, limit: int) -> ConsoleSlice:
        """Up to ``limit`` bytes from ``offset`` of the guest's output; when more than
        ``limit`` was written since (or part of it is no longer kept), the oldest part is
        skipped and counted."""
        with self._lock:
            if self._fd < 0 or offset > self.total:
                return ConsoleSlice(min(offset, self.total), b"")
            start = max(offset, self.base, self.total - limit)
            data = os.pread(self._fd, min(limit, self.total - start), start - self.base)
            return ConsoleSlice(start, data, start - offset)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class ConsoleReader:
    """The node's end of a QEMU's console socket, read into a ``ConsoleRing`` on the
    guest-facing loop. ``qemu_fd`` is the descriptor QEMU inherits; ``handed_over``
    once it has it, with the ring it is read into; ``start`` reads; ``close`` stops."""

    def __init__(self) -> None:
        self.ring: ConsoleRing | None = None
        self._node_end, self._qemu_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._node_end.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def qemu_fd(self) -> int:
        return self._qemu_end.fileno()

    def handed_over(self, ring: ConsoleRing) -> None:
        """QEMU holds its end now (it was spawned): the node's copy of it goes."""
        self.ring = ring
        self._qemu_end.close()

    async def start(self) -> None:
        await on_guest_loop(self._start())

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._node_end.fileno(), self._readable)

    def discard(self) -> None:
        """Close everything of a reader that was never started (its QEMU never ran)."""
        self._qemu_end.close()
        self._node_end.close()
        if self.ring is not None:
            self.ring.close()

    def _readable(self) -> None:
        try:
            data = self._node_end.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:        # QEMU is gone
            self._stop_reading()
            return
        try:
            if self.ring is not None:
                self.ring.write(data)
        except OSError:     # the disk refused: the console is lost, the node goes on
            self._stop_reading()

    def _stop_reading(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._node_end.fileno())
            self._loop = None

    async def close(self) -> None:
        """Read what QEMU left in the socket (a dying guest's last words), then stop."""
        await on_guest_loop(self._close())

    async def _close(self) -> None:
        self._stop_reading()
        with contextlib.suppress(OSError):
            self._qemu_end.close()
        for _ in range(64):     # at most a socket buffer's worth
            try:
                data = self._node_end.recv(READ_CHUNK)
            except OSError:
                break
            if not data:
                break
            if self.ring is not None:
                with contextlib.suppress(OSError):
                    self.ring.write(data)
        self._node_end.close()
        if self.ring is not None:
            self.ring.close()
