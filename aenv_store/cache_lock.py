"""flock(2)-based locks for the node cache, shared by every process using one
cache directory. The kernel drops a flock when its holder dies, so a crashed
process never leaves a lock behind."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path


class FileLock:
    """A lock file held open; ``flock`` locks belong to this open file description,
    so two instances conflict even inside one process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def exclusive(self, blocking: bool = True) -> bool:
        return self._flock(fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))

    def shared(self) -> None:
        self._flock(fcntl.LOCK_SH)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _flock(self, op: int) -> bool:
        try:
            fcntl.flock(self.fd, op)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class InflightLock:
    """Exclusive lock on ``<dir>/<name>.lock`` for the duration of one fetch.

    The file is unlinked on release so the directory does not fill up. That
    opens the classic race (a waiter locks a file that the holder already
    unlinked, while a newcomer creates and locks a fresh one); acquire() closes
    it by checking, after locking, that the path still names the locked inode."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # releases the GIL while it waits
                held = os.fstat(fd)
                try:
                    now = os.stat(self.path)
                except FileNotFoundError:
                    now = None
            except BaseException:
                os.close(fd)
                raise
            if now is not None and (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev):
                self.fd = fd
                return
            os.close(fd)  # we locked a file the previous holder already removed: retry

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.unlink(self.path)  # while still locked, so no one can lock this path's inode afterwards
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "InflightLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
