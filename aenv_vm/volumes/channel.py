"""The node's end of a volume channel: answers a guest's filesystem requests
(envd/volwire.py frames) against one volume's ``VolumeTree``.

The guest is hostile. What keeps it inside the volume:

* Every path a request names goes through the tree's ``open_beneath`` /
  ``open_parent_beneath`` (tree.py): ``..`` and NUL are refused, every component
  is walked ``O_NOFOLLOW`` from the volume root, so no symlink the guest made --
  ``/etc``, ``../../..`` -- is ever followed here. The final name is only used
  with ``*at`` calls that do not follow it either.
* Only regular files are read or written (FIFOs and device nodes are never
  opened: the guest cannot make them, and the tree refuses them anyway).
* setuid/setgid bits are never set on the host (a guest could otherwise leave a
  setuid-root binary in the node's data dir); owners are what the guest asks
  (its uids are its own, as on an NFS export without root squash).
* Sizes are bounded: one READ at most ``MAX_IO`` bytes, one listing page at most
  ``PAGE`` names; at most ``MAX_INFLIGHT`` requests of one channel are worked on
  at a time (the rest wait in the socket: back pressure to the guest).
* The server holds no state between requests (no fds, no handles): a request
  for a path that does not exist is ENOENT, never a stale host object, and a
  channel re-dialled after a resume or for a fork child needs nothing restored.

``VolumeServer.answer`` is a plain function of a frame (tests send crafted frames
straight to it); ``serve`` moves frames between a stream and it.
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import stat as st
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable

from envd import volwire as W

from .tree import VolumeTree

log = logging.getLogger(__name__)

MAX_IO = 1 << 20
PAGE = 512
LISTING_TTL = 5.0                    # seconds later pages reuse a listing
MAX_LISTING = 1_000_000
MAX_INFLIGHT = 8
MAX_TARGET = 4095
_NO_SETID = ~(st.S_ISUID | st.S_ISGID) & 0o7777
_RENAME_FLAGS = 0x1 | 0x2            # RENAME_NOREPLACE, RENAME_EXCHANGE

Reply = tuple[int, dict[str, Any], bytes]


class MalformedRequest(Exception):
    """A request whose fields have the wrong type (answered EINVAL)."""


def attr(s: os.stat_result) -> dict[str, int]:
    return {"ino": s.st_ino, "mode": s.st_mode, "nlink": s.st_nlink, "uid": s.st_uid, "gid": s.st_gid,
            "size": s.st_size, "blocks": s.st_blocks, "atime": s.st_atime_ns, "mtime": s.st_mtime_ns,
            "ctime": s.st_ctime_ns}


def _int(meta: dict[str, Any], key: str, lo: int = 0, hi: int = (1 << 63) - 1, default: int | None = None) -> int:
    v = meta.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MalformedRequest(f"{key} must be an integer in {lo}..{hi}")
    return v


def _str(meta: dict[str, Any], key: str) -> str:
    v = meta.get(key)
    if not isinstance(v, str):
        raise MalformedRequest(f"{key} must be a string")
    return v


_libc: ctypes.CDLL | None = None


def _renameat2(olddir: int, old: str, newdir: int, new: str, flags: int) -> None:
    global _libc
    if flags == 0:
        os.rename(old, new, src_dir_fd=olddir, dst_dir_fd=newdir)
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.renameat2(olddir, os.fsencode(old), newdir, os.fsencode(new), ctypes.c_uint(flags)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class VolumeServer:
    """Answers one volume's requests. Thread-safe (each request is its own syscalls)."""

    def __init__(self, tree: VolumeTree, read_only: bool = False, min_free: int = 0) -> None:
        """``min_free``: bytes a guest's writes must leave free on the tree's filesystem
        (ENOSPC otherwise): a volume shares the node's disk, so one guest filling it would
        stop every sandbox's disk writes and the node's own."""
        self.tree = tree
        self.read_only = read_only
        self.min_free = min_free
        self._ops: dict[int, Callable[[dict[str, Any], bytes], Reply]] = {
            W.Op.STAT: self._stat, W.Op.READDIR: self._readdir, W.Op.MKDIR: self._mkdir,
            W.Op.UNLINK: self._unlink, W.Op.RMDIR: self._rmdir, W.Op.RENAME: self._rename,
            W.Op.SYMLINK: self._symlink, W.Op.READLINK: self._readlink, W.Op.CREATE: self._create,
            W.Op.OPEN: self._open, W.Op.READ: self._read, W.Op.WRITE: self._write,
            W.Op.SETATTR: self._setattr, W.Op.STATFS: self._statfs, W.Op.FSYNC: self._fsync,
        }
        self._lock = threading.Lock()
        self._listings: dict[str, tuple[float, list[tuple[str, str, int]]]] = {}
        self._writes = {W.Op.MKDIR, W.Op.UNLINK, W.Op.RMDIR, W.Op.RENAME, W.Op.SYMLINK, W.Op.CREATE,
                        W.Op.WRITE, W.Op.SETATTR}

    # ------------------------------------------------------------ one request

    def answer(self, frame: W.Frame) -> bytes:
        """The encoded reply to one request frame (never raises for what a guest sends)."""
        if frame.kind is not W.Kind.REQUEST:
            return W.reply(frame.id, errno.EPROTO)
        op = self._ops.get(frame.code)
        if op is None:
            return W.reply(frame.id, errno.ENOSYS)
        if self.read_only and frame.code in self._writes:
            return W.reply(frame.id, errno.EROFS)
        if self.min_free and frame.code in self._writes and frame.code not in (W.Op.UNLINK, W.Op.RMDIR) \
                and self._free() - len(frame.data) < self.min_free:
            return W.reply(frame.id, errno.ENOSPC)
        try:
            code, meta, data = op(frame.meta, frame.data)
        except MalformedRequest:
            code, meta, data = errno.EINVAL, {}, b""
        except OSError as e:
            code, meta, data = (e.errno or errno.EIO), {}, b""
        except (ValueError, TypeError, UnicodeError, OverflowError):
            code, meta, data = errno.EINVAL, {}, b""
        return W.reply(frame.id, code if 0 <= code < 1 << 16 else errno.EIO, meta, data)

    def _free(self) -> int:
        try:
            v = os.statvfs(self.tree.root)
        except OSError:
            return 0
        return v.f_bavail * v.f_frsize

    def _parent(self, meta: dict[str, Any], key: str = "path") -> tuple[int, str]:
        return self.tree.open_parent_beneath(_str(meta, key))

    def _lstat(self, rel: str) -> os.stat_result:
        fd = self.tree.open_beneath(rel, os.O_PATH)      # a symlink: the link itself
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _stat(self, meta: dict[str, Any], data: bytes) -> Reply:
        return 0, attr(self._lstat(_str(meta, "path"))), b""

    def _readdir(self, meta: dict[str, Any], data: bytes) -> Reply:
        offset = _int(meta, "offset", default=0)
        rel = _str(meta, "path")
        listing = self._listing(rel, fresh=offset == 0)
        page = listing[offset:offset + PAGE]
        return 0, {"entries": [list(e) for e in page], "more": offset + PAGE < len(listing)}, b""

    def _listing(self, rel: str, fresh: bool) -> list[tuple[str, str, int]]:
        """The directory's entries by name. Later pages of one listing reuse the first's
        (a few seconds): a guest paging through a huge directory costs one scan, not one
        per page. At most ``MAX_LISTING`` names (ENOSPC-free bound on node memory: E2BIG)."""
        key = rel.strip("/")
        with self._lock:
            hit = self._listings.get(key)
            if hit is not None and not fresh and time.monotonic() - hit[0] < LISTING_TTL:
                return hit[1]
        fd = self.tree.open_beneath(rel, os.O_RDONLY | os.O_DIRECTORY)
        out: list[tuple[str, str, int]] = []
        try:
            with os.scandir(fd) as it:
                for e in it:
                    if len(out) >= MAX_LISTING:
                        raise OSError(errno.E2BIG, "directory too large to list")
                    try:
                        kind = "d" if e.is_dir(follow_symlinks=False) else "l" if e.is_symlink() else \
                            "f" if e.is_file(follow_symlinks=False) else "o"
                        out.append((e.name, kind, e.inode()))
                    except OSError:
                        continue
        finally:
            os.close(fd)
        out.sort()
        with self._lock:
            self._listings[key] = (time.monotonic(), out)
            while len(self._listings) > 4:
                self._listings.pop(next(iter(self._listings)))
        return out

    def _mkdir(self, meta: dict[str, Any], data: bytes) -> Reply:
        mode = _int(meta, "mode", 0, 0o7777, 0o755) & _NO_SETID
        dfd, name = self._parent(meta)
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
            return 0, attr(self._own_new(dfd, name, mode, meta)), b""
        finally:
            os.close(dfd)

    def _own_new(self, dfd: int, name: str, mode: int | None, meta: dict[str, Any]) -> os.stat_result:
        """chown (to the guest caller) and chmod a fresh entry through an O_PATH fd of it."""
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            s = os.fstat(fd)
            uid, gid = meta.get("uid"), meta.get("gid")
            if st.S_ISLNK(s.st_mode):
                if isinstance(uid, int) and isinstance(gid, int):
                    os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
            else:
                if isinstance(uid, int) and isinstance(gid, int) and 0 <= uid < 1 << 32 and 0 <= gid < 1 << 32:
                    os.chown(f"/proc/self/fd/{fd}", uid, gid)
                if mode is not None:
                    os.chmod(f"/proc/self/fd/{fd}", mode)
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _unlink(self, meta: dict[str, Any], data: bytes) -> Reply:
        return self._in_parent(meta, os.unlink)

    def _rmdir(self, meta: dict[str, Any], data: bytes) -> Reply:
        return self._in_parent(meta, os.rmdir)

    def _in_parent(self, meta: dict[str, Any], op: Callable[..., None]) -> Reply:
        """``op(name, dir_fd=parent)`` on the request's path, beneath the volume."""
        dfd, name = self._parent(meta)
        try:
            op(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        return 0, {}, b""

    def _rename(self, meta: dict[str, Any], data: bytes) -> Reply:
        flags = _int(meta, "flags", 0, 0xFFFFFFFF, 0)
        if flags & ~_RENAME_FLAGS:
            return errno.EINVAL, {}, b""
        src_dfd, src = self._parent(meta, "path")
        try:
            dst_dfd, dst = self._parent(meta, "to")
            try:
                _renameat2(src_dfd, src, dst_dfd, dst, flags)
            finally:
                os.close(dst_dfd)
        finally:
            os.close(src_dfd)
        return 0, {}, b""

    def _symlink(self, meta: dict[str, Any], data: bytes) -> Reply:
        target = _str(meta, "target")
        if not target or "\x00" in target or len(os.fsencode(target)) > MAX_TARGET:
            return errno.EINVAL, {}, b""
        dfd, name = self._parent(meta)
        try:
            # stored as text, never resolved on the host: every walk here is O_NOFOLLOW
            os.symlink(target, name, dir_fd=dfd)
            return 0, attr(self._own_new(dfd, name, None, meta)), b""
        finally:
            os.close(dfd)

    def _readlink(self, meta: dict[str, Any], data: bytes) -> Reply:
        dfd, name = self._parent(meta)
        try:
            return 0, {"target": os.readlink(name, dir_fd=dfd)}, b""
        finally:
            os.close(dfd)

    def _create(self, meta: dict[str, Any], data: bytes) -> Reply:
        mode = _int(meta, "mode", 0, 0o7777, 0o644) & _NO_SETID
        rel = _str(meta, "path")
        try:
            os.close(self.tree.open_beneath(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            if meta.get("excl"):
                raise
            fd = self.tree.open_beneath(rel, os.O_RDONLY)    # an existing regular file (never a link)
            try:
                s = os.fstat(fd)
            finally:
                os.close(fd)
            return (errno.EISDIR, {}, b"") if st.S_ISDIR(s.st_mode) else (0, attr(s), b"")
        dfd, name = self._parent(meta)
        try:
            return 0, attr(self._own_new(dfd, name, mode, meta)), b""
        finally:
            os.close(dfd)

    def _open(self, meta: dict[str, Any], data: bytes) -> Reply:
        rel = _str(meta, "path")
        fd = self.tree.open_beneath(rel, os.O_WRONLY if meta.get("write") else os.O_RDONLY)
        try:
            s = os.fstat(fd)
        finally:
            os.close(fd)
        if st.S_ISDIR(s.st_mode):
            return errno.EISDIR, {}, b""
        return 0, attr(s), b""

    def _read(self, meta: dict[str, Any], data: bytes) -> Reply:
        offset = _int(meta, "offset")
        size = min(_int(meta, "size", 0, 1 << 31), MAX_IO)
        fd = self.tree.open_beneath(_str(meta, "path"), os.O_RDONLY)
        try:
            if st.S_ISDIR(os.fstat(fd).st_mode):
                return errno.EISDIR, {}, b""
            return 0, {}, os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def _write(self, meta: dict[str, Any], data: bytes) -> Reply:
        offset = _int(meta, "offset")
        fd = self.tree.open_beneath(_str(meta, "path"), os.O_WRONLY)
        try:
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)
        return 0, {"size": done}, b""

    def _setattr(self, meta: dict[str, Any], data: bytes) -> Reply:
        rel = _str(meta, "path")
        if "size" in meta:
            size = _int(meta, "size")
            fd = self.tree.open_beneath(rel, os.O_WRONLY)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        fd = self.tree.open_beneath(rel, os.O_PATH)
        try:
            s = os.fstat(fd)
            link = st.S_ISLNK(s.st_mode)
            if "uid" in meta or "gid" in meta:
                uid = _int(meta, "uid", 0, 0xFFFFFFFE, s.st_uid)
                gid = _int(meta, "gid", 0, 0xFFFFFFFE, s.st_gid)
                if link:
                    dfd, name = self.tree.open_parent_beneath(rel)
                    try:
                        os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
                    finally:
                        os.close(dfd)
                else:
                    os.chown(f"/proc/self/fd/{fd}", uid, gid)
            if "mode" in meta and not link:
                os.chmod(f"/proc/self/fd/{fd}", _int(meta, "mode", 0, 0o7777) & _NO_SETID)
            if "atime" in meta or "mtime" in meta:
                now = time.time_ns()
                times = []
                for key, old in (("atime", s.st_atime_ns), ("mtime", s.st_mtime_ns)):
                    v = meta.get(key, old)
                    times.append(now if v == "now" else _int({key: v}, key))
                dfd, name = self.tree.open_parent_beneath(rel) if rel.strip("/") else (-1, "")
                try:
                    if dfd < 0:
                        os.utime(f"/proc/self/fd/{fd}", ns=(times[0], times[1]))
                    else:
                        os.utime(name, ns=(times[0], times[1]), dir_fd=dfd, follow_symlinks=False)
                finally:
                    if dfd >= 0:
                        os.close(dfd)
            return 0, attr(os.fstat(fd)), b""
        finally:
            os.close(fd)

    def _statfs(self, meta: dict[str, Any], data: bytes) -> Reply:
        fd = self.tree.open_beneath("", os.O_RDONLY | os.O_DIRECTORY)
        try:
            v = os.fstatvfs(fd)
        finally:
            os.close(fd)
        return 0, {"blocks": v.f_blocks, "bfree": v.f_bfree, "bavail": v.f_bavail, "files": v.f_files,
                   "ffree": v.f_ffree, "bsize": v.f_bsize, "frsize": v.f_frsize, "namelen": v.f_namemax}, b""

    def _fsync(self, meta: dict[str, Any], data: bytes) -> Reply:
        rel = _str(meta, "path")
        fd = self.tree.open_beneath(rel, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return 0, {}, b""

    # ------------------------------------------------------------ a stream

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    executor: Executor | None = None) -> None:
        """Answer requests from ``reader`` on ``writer`` until EOF; WireError when the
        guest sends something that is not a frame (the caller closes the channel).
        ``executor``: where the blocking calls run (the node gives volume channels their
        own, so a guest's slow requests never hold the threads the node's other work uses)."""
        slots = asyncio.Semaphore(MAX_INFLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def one(frame: W.Frame) -> None:
            try:
                out = await asyncio.get_running_loop().run_in_executor(executor, self.answer, frame)
                writer.write(out)     # one write per reply: replies never interleave
                await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                slots.release()

        try:
            while True:
                try:
                    header = await reader.readexactly(W.HEADER_LEN)
                except asyncio.IncompleteReadError:
                    return
                meta_len, data_len = W.header_lengths(header)
                frame = W.decode_one(header, await reader.readexactly(meta_len + data_len))
                await slots.acquire()
                t = asyncio.get_running_loop().create_task(one(frame))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        finally:
            for t in list(tasks):
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
