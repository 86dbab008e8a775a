"""Directory watching with Linux inotify through ctypes (no third-party code).

``parse_events`` is pure (bytes -> records); ``DirWatcher`` owns one inotify
descriptor on the asyncio loop and turns kernel events into filesystem.proto
``FilesystemEvent`` messages, adding watches for new subdirectories when
recursive.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from typing import Callable

from .libc import libc

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

WATCH_MASK = (
    IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_ONLYDIR
)
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


@dataclass(frozen=True)
class RawEvent:
    wd: int
    mask: int
    cookie: int
    name: str


def parse_events(buf: bytes) -> list[RawEvent]:
    """Decode a read() of an inotify fd (whole records only, as the kernel gives)."""
    out: list[RawEvent] = []
    off = 0
    while off + _HEADER.size <= len(buf):
        wd, mask, cookie, length = _HEADER.unpack_from(buf, off)
        off += _HEADER.size
        if off + length > len(buf):
            raise ValueError("truncated inotify record")
        name = buf[off : off + length].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        off += length
        out.append(RawEvent(wd, mask, cookie, name))
    if off != len(buf):
        raise ValueError("trailing bytes in inotify buffer")
    return out


def event_type(mask: int) -> str | None:
    """filesystem.EventType for a kernel mask, as fsnotify classifies them."""
    if mask & (IN_CREATE | IN_MOVED_TO):
        return "EVENT_TYPE_CREATE"
    if mask & (IN_DELETE | IN_DELETE_SELF):
        return "EVENT_TYPE_REMOVE"
    if mask & IN_MOVED_FROM:
        return "EVENT_TYPE_RENAME"
    if mask & IN_MODIFY:
        return "EVENT_TYPE_WRITE"
    if mask & IN_ATTRIB:
        return "EVENT_TYPE_CHMOD"
    return None




class DirWatcher:
    """Watches ``root`` (optionally recursively); calls ``sink`` per event."""

    def __init__(self, root: str, recursive: bool, sink: Callable[[str, str, int], None]) -> None:
        self.root = root
        self.recursive = recursive
        self._sink = sink
        fd = libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self._fd = fd
        self._dirs: dict[int, str] = {}  # wd -> path relative to root ("" = root)
        self._closed = False
        try:
            self._add(root, "")
            if recursive:
                for dirpath, dirnames, _ in os.walk(root):
                    for d in dirnames:
                        full = os.path.join(dirpath, d)
                        if not os.path.islink(full):
                            self._add(full, os.path.relpath(full, root))
        except OSError:
            os.close(fd)
            raise
        asyncio.get_running_loop().add_reader(fd, self._on_readable)

    def _add(self, path: str, rel: str) -> None:
        wd = libc().inotify_add_watch(self._fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if rel and err in (errno.ENOENT, errno.ENOTDIR):
                return  # vanished before we got to it
            raise OSError(err, os.strerror(err), path)
        self._dirs[wd] = rel

    def _on_readable(self) -> None:
        try:
            buf = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        for ev in parse_events(buf):
            if ev.mask & IN_IGNORED:
                self._dirs.pop(ev.wd, None)
                continue
            base = self._dirs.get(ev.wd)
            if base is None:
                continue
            name = os.path.join(base, ev.name) if ev.name else base
            if self.recursive and ev.mask & IN_ISDIR and ev.mask & (IN_CREATE | IN_MOVED_TO):
                self._add(os.path.join(self.root, name), name)
            kind = event_type(ev.mask)
            if kind is not None and name:
                self._sink(name, kind, ev.mask)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        asyncio.get_running_loop().remove_reader(self._fd)
        os.close(self._fd)
