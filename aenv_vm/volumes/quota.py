"""A volume's quota: the bytes and inodes its tree may use on the node's disk.

A volume shares the node's filesystem with every sandbox's disk, the node cache and
every other volume, so one guest filling its volume -- with data, or with millions of
empty files -- must stop at its own bound (``EDQUOT``), well before the node's
free-disk floor (``ENOSPC``, aenv_store/diskfloor.py), which protects everyone else.

What is counted (the same by the scan and by every change since):

* **bytes**: the space allocated to the volume's regular files (``st_blocks`` × 512):
  a sparse file costs what it holds, not its size. Directories and symlinks are
  counted as inodes only (their few blocks are bounded by the inode quota);
* **inodes**: every entry beneath the volume's root (files, directories, symlinks).

The usage is scanned from the tree once per node process, at the volume's first use
(a thread: ~1 s per 300 000 entries here), and kept up to date by the writers: the
node's answers to guests (channel.py) and the volume content API (tree.py). A change
that grows the volume *reserves* its growth first (``EDQUOT`` beyond the quota, so two
concurrent writers cannot both pass the last free byte), then settles on what it really
changed. Changes to one file are serialised by a lock striped over inode numbers, so
the before/after sizes of concurrent writes to one file never overlap.
"""
from __future__ import annotations

import errno
import os
import stat as st
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BLOCK = 512                 # st_blocks unit
PAGE = 4096
_STRIPES = 64


@dataclass(frozen=True)
class VolumeQuota:
    """Bounds of one volume (0: that bound is off)."""
    max_bytes: int = 0
    max_inodes: int = 0

    @property
    def active(self) -> bool:
        return self.max_bytes > 0 or self.max_inodes > 0


class QuotaExceeded(OSError):
    """A change would take the volume past its quota (``EDQUOT``: the guest sees
    "Disk quota exceeded", the content API a 507)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EDQUOT, message)

    def __str__(self) -> str:
        return str(self.strerror)


def scan(root: Path) -> tuple[int, int]:
    """(bytes, inodes) of the tree under ``root``, counted as the module says; symlinks
    are never followed, entries that vanish meanwhile are skipped. Memory: one scandir
    per directory level at a time."""
    total_bytes = 0
    inodes = 0
    stack = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        while stack:
            dfd = stack.pop()
            try:
                with os.scandir(dfd) as it:
                    for e in it:
                        try:
                            s = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        inodes += 1
                        if st.S_ISREG(s.st_mode):
                            total_bytes += s.st_blocks * BLOCK
                        elif st.S_ISDIR(s.st_mode):
                            try:
                                stack.append(os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                                     | os.O_CLOEXEC, dir_fd=dfd))
                            except OSError:
                                continue
            finally:
                os.close(dfd)
    finally:
        for fd in stack:
            os.close(fd)
    return total_bytes, inodes


def charged_bytes(s: os.stat_result) -> int:
    """What an entry's stat counts against the byte quota."""
    return s.st_blocks * BLOCK if st.S_ISREG(s.st_mode) else 0


def write_estimate(s: os.stat_result, offset: int, size: int) -> int:
    """At most how many bytes a write of ``size`` at ``offset`` can allocate in the
    file ``s``: nothing inside a file whose every block is allocated, else its size
    rounded up to pages plus one page (a partial page at either end)."""
    if size <= 0:
        return 0
    if offset + size <= s.st_size and s.st_blocks * BLOCK >= s.st_size:
        return 0
    return -(-size // PAGE) * PAGE + PAGE


class VolumeUsage:
    """The bytes and inodes one volume uses, shared by every writer of it on the node.
    Thread-safe."""

    def __init__(self, root: Path, quota: VolumeQuota) -> None:
        self.root = Path(root)
        self.quota = quota
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._bytes = 0
        self._inodes = 0
        self._scanned = False

    def _ensure(self) -> None:
        if self._scanned:
            return
        with self._scan_lock:
            if self._scanned:
                return
            used_bytes, inodes = scan(self.root)     # every writer waits for it (reserve, settle)
            with self._lock:
                self._bytes, self._inodes = used_bytes, inodes
                self._scanned = True

    def used(self) -> tuple[int, int]:
        """(bytes, inodes) now."""
        self._ensure()
        with self._lock:
            return self._bytes, self._inodes

    def reserve(self, nbytes: int = 0, inodes: int = 0) -> None:
        """Count ``nbytes`` and ``inodes`` as used now, or ``QuotaExceeded`` (nothing
        counted) when that would pass the quota. Give back with ``settle``."""
        self._ensure()
        q = self.quota
        with self._lock:
            if q.max_inodes and inodes > 0 and self._inodes + inodes > q.max_inodes:
                raise QuotaExceeded(f"the volume holds {self._inodes} of its {q.max_inodes} files and directories")
            if q.max_bytes and nbytes > 0 and self._bytes + nbytes > q.max_bytes:
                raise QuotaExceeded(f"the volume uses {self._bytes} of its {q.max_bytes} bytes")
            self._bytes += nbytes
            self._inodes += inodes

    def settle(self, nbytes: int = 0, inodes: int = 0) -> None:
        """Add (or with negative values take away) a change already made."""
        self._ensure()
        with self._lock:
            self._bytes = max(0, self._bytes + nbytes)
            self._inodes = max(0, self._inodes + inodes)

    @contextmanager
    def reserved(self, nbytes: int = 0, inodes: int = 0) -> Iterator[None]:
        """``reserve`` for the block, given back when it raises (the change failed)."""
        self.reserve(nbytes, inodes)
        try:
            yield
        except BaseException:
            self.settle(-nbytes, -inodes)
            raise

    def file_lock(self, ino: int) -> threading.Lock:
        """The lock that serialises size changes of inode ``ino``."""
        return self._stripes[ino % _STRIPES]
