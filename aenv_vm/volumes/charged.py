"""A volume's tree as the volume content API writes it: every change that can grow the
tree is charged to the volume's quota (quota.py) and checked against the node's
free-disk floor first, as the node's answers to guests are (channel.py).

What a change costs is measured around it: the components of a path that do not exist
yet (the inodes a forced write or make will create), a file's allocated blocks before
and after each chunk written, a subtree's entries and blocks before it is removed.
A guest changing the same paths at the same instant can make the count drift by what
it changed meanwhile; the next node start scans the volume afresh.
"""
from __future__ import annotations

import os
import stat as st
from pathlib import Path

from aenv_store.diskfloor import DiskFloor

from .quota import VolumeUsage, charged_bytes, scan, write_estimate
from .tree import Entry, VolumeTree, split_path


class ChargedTree(VolumeTree):
    def __init__(self, root: Path, usage: VolumeUsage | None, floor: DiskFloor) -> None:
        super().__init__(root)
        self.usage = usage
        self.floor = floor

    def _missing(self, rel: str) -> int:
        """How many components of ``rel`` do not exist (each one a new inode if made)."""
        parts = split_path(rel)
        fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, p in enumerate(parts):
                try:
                    nfd = os.open(p, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except FileNotFoundError:
                    return len(parts) - i
                except OSError:
                    return 0          # the operation itself will fail with its own error
                os.close(fd)
                fd = nfd
            return 0
        finally:
            os.close(fd)

    def _old_bytes(self, rel: str) -> int:
        try:
            fd = self.open_beneath(rel, os.O_PATH)
        except OSError:
            return 0
        try:
            return charged_bytes(os.fstat(fd))
        finally:
            os.close(fd)

    def open_write(self, rel: str, force: bool = False, mode: int | None = None, uid: int | None = None,
                   gid: int | None = None) -> int:
        missing = self._missing(rel)
        self.floor.check(self.root, new_inodes=missing)
        if self.usage is None:
            return super().open_write(rel, force, mode, uid, gid)
        old = self._old_bytes(rel) if force and not missing else 0
        with self.usage.reserved(inodes=missing):
            fd = super().open_write(rel, force, mode, uid, gid)
        if old:
            self.usage.settle(-old)       # O_TRUNC freed what the file held
        return fd

    def write_chunk(self, fd: int, data: bytes) -> None:
        self.floor.check(self.root, new_bytes=len(data))
        if self.usage is None:
            super().write_chunk(fd, data)
            return
        with self.usage.file_lock(os.fstat(fd).st_ino):
            before = os.fstat(fd)
            estimate = write_estimate(before, os.lseek(fd, 0, os.SEEK_CUR), len(data))
            self.usage.reserve(estimate)
            try:
                super().write_chunk(fd, data)
            finally:
                self.usage.settle(charged_bytes(os.fstat(fd)) - charged_bytes(before) - estimate)

    def make_dir(self, rel: str, force: bool = False, mode: int | None = None, uid: int | None = None,
                 gid: int | None = None) -> Entry:
        missing = self._missing(rel)
        self.floor.check(self.root, new_inodes=missing)
        if self.usage is None:
            return super().make_dir(rel, force, mode, uid, gid)
        with self.usage.reserved(inodes=missing):
            return super().make_dir(rel, force, mode, uid, gid)

    def remove(self, rel: str) -> None:
        if self.usage is None:
            super().remove(rel)
            return
        gone_bytes, gone_inodes = 0, 0
        try:
            fd = self.open_beneath(rel, os.O_PATH)
        except OSError:
            fd = -1                       # remove answers the error
        if fd >= 0:
            try:
                s = os.fstat(fd)
                gone_bytes, gone_inodes = charged_bytes(s), 1
                if st.S_ISDIR(s.st_mode):
                    sub_bytes, sub_inodes = scan(Path(f"/proc/self/fd/{fd}"))
                    gone_bytes, gone_inodes = gone_bytes + sub_bytes, gone_inodes + sub_inodes
            finally:
                os.close(fd)
        super().remove(rel)
        self.usage.settle(-gone_bytes, -gone_inodes)
