"""The free-disk floor: what every writer on the node leaves free on its filesystem,
in bytes and in inodes (``[cache] min_free_disk``, ``min_free_inodes``).

Bytes alone are not enough: a guest creating millions of empty files in a volume, or
an image of many small files being flattened, uses no bytes to speak of and can still
exhaust the filesystem's inodes, after which nothing on the node -- a pause, a cache
fill, a log line -- can create a file. A filesystem that reports no inode count
(``f_files`` 0: btrfs, some network filesystems) has no inode floor.

Writers ask ``check`` before they write (an ``OSError(ENOSPC)`` naming the setting
when the write would cross the floor) or ``shortage`` for a message without raising.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FreeSpace:
    bytes: int                  # free to an unprivileged writer (f_bavail)
    inodes: int | None          # free inodes (f_favail); None: the filesystem does not count them


def free_space(path: str | os.PathLike[str]) -> FreeSpace:
    """Free bytes and inodes of the filesystem holding ``path`` (OSError if it is gone)."""
    v = os.statvfs(path)
    return FreeSpace(v.f_bavail * v.f_frsize, v.f_favail if v.f_files > 0 else None)


class FloorReached(OSError):
    """A write would leave its filesystem below the node's free-disk floor (ENOSPC)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass(frozen=True)
class DiskFloor:
    """Bytes and inodes a filesystem keeps free (0: that bound is off)."""
    min_free_bytes: int = 0
    min_free_inodes: int = 0

    @property
    def active(self) -> bool:
        return self.min_free_bytes > 0 or self.min_free_inodes > 0

    def shortage(self, path: str | os.PathLike[str], new_bytes: int = 0, new_inodes: int = 0) -> str | None:
        """Why writing ``new_bytes`` in ``new_inodes`` new files under ``path`` would cross
        the floor, or None. A filesystem that cannot be asked (``path`` gone) is no shortage:
        the write itself then fails with its own error."""
        if not self.active:
            return None
        try:
            free = free_space(path)
        except OSError:
            return None
        if self.min_free_bytes and free.bytes - new_bytes < self.min_free_bytes:
            return (f"{Path(path)} has {free.bytes >> 20} MiB free; the node keeps "
                    f"{self.min_free_bytes >> 20} MiB free on it ([cache] min_free_disk)")
        if self.min_free_inodes and free.inodes is not None and free.inodes - new_inodes < self.min_free_inodes:
            return (f"{Path(path)} has {free.inodes} inodes free; the node keeps "
                    f"{self.min_free_inodes} free on it ([cache] min_free_inodes)")
        return None

    def check(self, path: str | os.PathLike[str], new_bytes: int = 0, new_inodes: int = 0) -> None:
        """``FloorReached`` (ENOSPC) when ``shortage`` finds one."""
        why = self.shortage(path, new_bytes, new_inodes)
        if why is not None:
            raise FloorReached(why)
