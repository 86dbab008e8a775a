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
  one frame's meta (dirpage.py: pages cut by encoded size, resumed by cookie); at
  most ``MAX_INFLIGHT`` requests of one channel are worked on at a time (the rest
  wait in the socket: back pressure to the guest).
* Every request is answered: a failure of any kind is an errno (EIO when nothing
  more precise is known), a request whose meta is not JSON is EINVAL, an oversized
  one is skipped and answered E2BIG; only bytes that are not a frame at all close
  the channel (the guest's requests then wait for the next one, as on a hard NFS
  mount). A silent request would hang every guest process that touches the path.
* The volume's quota (quota.py: bytes and inodes, EDQUOT) and the node's free-disk
  floor (bytes and inodes, ENOSPC) hold for every change that can grow the tree.
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

from aenv_store.diskfloor import DiskFloor
from envd import volwire as W

from .dirpage import read_page
from .quota import QuotaExceeded, VolumeUsage, charged_bytes, write_estimate
from .tree import VolumeTree

log = logging.getLogger(__name__)

MAX_IO = 1 << 20
MAX_INFLIGHT = 8
RESUME_POINTS = 64                   # count-paged listings (older guests) resumed by cookie
DISCARD = 1 << 20                    # bytes read at a time of an oversized frame's body
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


def _pwrite_all(fd: int, data: bytes, offset: int) -> int:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


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

    def __init__(self, tree: VolumeTree, read_only: bool = False, min_free: int = 0,
                 floor: DiskFloor | None = None, usage: VolumeUsage | None = None) -> None:
        """``floor``: bytes and inodes a guest's writes must leave free on the tree's
        filesystem (ENOSPC otherwise; ``min_free``: its bytes alone): a volume shares the
        node's disk, so one guest filling it would stop every sandbox's disk writes and
        the node's own. ``usage``: the volume's quota and what it uses (EDQUOT beyond)."""
        self.tree = tree
        self.read_only = read_only
        self.floor = floor if floor is not None else DiskFloor(min_free_bytes=min_free)
        self.usage = usage
        self._ops: dict[int, Callable[[dict[str, Any], bytes], Reply]] = {
            W.Op.STAT: self._stat, W.Op.READDIR: self._readdir, W.Op.MKDIR: self._mkdir,
            W.Op.UNLINK: self._unlink, W.Op.RMDIR: self._rmdir, W.Op.RENAME: self._rename,
            W.Op.SYMLINK: self._symlink, W.Op.READLINK: self._readlink, W.Op.CREATE: self._create,
            W.Op.OPEN: self._open, W.Op.READ: self._read, W.Op.WRITE: self._write,
            W.Op.SETATTR: self._setattr, W.Op.STATFS: self._statfs, W.Op.FSYNC: self._fsync,
        }
        self._lock = threading.Lock()
        # (path, entries listed so far) -> the cookie there, for guests that page by count
        self._resume: dict[tuple[str, int], int] = {}
        self._writes = {W.Op.MKDIR, W.Op.UNLINK, W.Op.RMDIR, W.Op.RENAME, W.Op.SYMLINK, W.Op.CREATE,
                        W.Op.WRITE, W.Op.SETATTR}
        self._creates = {W.Op.MKDIR, W.Op.SYMLINK, W.Op.CREATE}

    # ------------------------------------------------------------ one request

    def answer(self, frame: W.Frame) -> bytes:
        """The encoded reply to one request frame: never raises, whatever a guest sends
        or whatever fails here (EIO then), so no request goes unanswered."""
        try:
            return self._answer(frame)
        except Exception as e:      # a bug here must cost the guest an errno, not a hung process
            log.warning("volume request %s failed: %r", frame.code, e)
            return W.reply(frame.id, errno.EIO)

    def _answer(self, frame: W.Frame) -> bytes:
        if frame.kind is not W.Kind.REQUEST:
            return W.reply(frame.id, errno.EPROTO)
        op = self._ops.get(frame.code)
        if op is None:
            return W.reply(frame.id, errno.ENOSYS)
        if self.read_only and frame.code in self._writes:
            return W.reply(frame.id, errno.EROFS)
        if self.floor.active and frame.code in self._writes and frame.code not in (W.Op.UNLINK, W.Op.RMDIR) \
                and self.floor.shortage(self.tree.root, len(frame.data),
                                        1 if frame.code in self._creates else 0) is not None:
            return W.reply(frame.id, errno.ENOSPC)
        try:
            code, meta, data = op(frame.meta, frame.data)
        except MalformedRequest:
            code, meta, data = errno.EINVAL, {}, b""
        except OSError as e:
            code, meta, data = (e.errno or errno.EIO), {}, b""
        except (ValueError, TypeError, UnicodeError, OverflowError):
            code, meta, data = errno.EINVAL, {}, b""
        try:
            return W.reply(frame.id, code if 0 <= code < 1 << 16 else errno.EIO, meta, data)
        except W.WireError:       # an answer no frame can carry (never a listing: its pages fit)
            return W.reply(frame.id, errno.EOVERFLOW)

    def _reserve_inode(self) -> None:
        if self.usage is not None:
            self.usage.reserve(inodes=1)

    def _unreserve_inode(self) -> None:
        if self.usage is not None:
            self.usage.settle(inodes=-1)

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
        key = rel.strip("/")
        skip = 0
        if "cookie" in meta:
            cookie = _int(meta, "cookie")
        else:                         # a guest that pages by count: resume where its last page ended
            with self._lock:
                hit = self._resume.pop((key, offset), None)
            cookie, skip = (hit, 0) if hit is not None else (0, offset)
        fd = self.tree.open_beneath(rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            page = read_page(fd, cookie, skip)
        finally:
            os.close(fd)
        if "cookie" not in meta and page.more:
            with self._lock:
                self._resume[(key, offset + len(page.entries))] = page.cookie
                while len(self._resume) > RESUME_POINTS:
                    self._resume.pop(next(iter(self._resume)))
        return 0, {"entries": [list(e) for e in page.entries], "more": page.more, "cookie": page.cookie}, b""

    def _mkdir(self, meta: dict[str, Any], data: bytes) -> Reply:
        mode = _int(meta, "mode", 0, 0o7777, 0o755) & _NO_SETID
        dfd, name = self._parent(meta)
        try:
            self._reserve_inode()
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
            except BaseException:
                self._unreserve_inode()
                raise
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
        """``op(name, dir_fd=parent)`` on the request's path, beneath the volume; what the
        entry was charged comes off the volume's usage."""
        dfd, name = self._parent(meta)
        try:
            self._removing(dfd, name, lambda: op(name, dir_fd=dfd))
        finally:
            os.close(dfd)
        return 0, {}, b""

    def _removing(self, dfd: int, name: str, remove: Callable[[], None]) -> None:
        """Run ``remove`` (which drops the entry ``name`` of ``dfd``) and take the entry
        off the usage; under the entry's file lock, so no write to it settles after."""
        if self.usage is None:
            remove()
            return
        try:
            s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            remove()          # gone meanwhile (or never there): its own error, nothing to take off
            return
        with self.usage.file_lock(s.st_ino):
            remove()
            self.usage.settle(-charged_bytes(s), -1)

    def _rename(self, meta: dict[str, Any], data: bytes) -> Reply:
        flags = _int(meta, "flags", 0, 0xFFFFFFFF, 0)
        if flags & ~_RENAME_FLAGS:
            return errno.EINVAL, {}, b""
        src_dfd, src = self._parent(meta, "path")
        try:
            dst_dfd, dst = self._parent(meta, "to")
            try:
                if flags & 0x2:           # an exchange: both entries stay
                    _renameat2(src_dfd, src, dst_dfd, dst, flags)
                else:                     # the entry replaced at ``dst``, if any, is gone
                    src_ino = os.stat(src, dir_fd=src_dfd, follow_symlinks=False).st_ino
                    if self._replaces(dst_dfd, dst, src_ino):
                        self._removing(dst_dfd, dst, lambda: _renameat2(src_dfd, src, dst_dfd, dst, flags))
                    else:
                        _renameat2(src_dfd, src, dst_dfd, dst, flags)
            finally:
                os.close(dst_dfd)
        finally:
            os.close(src_dfd)
        return 0, {}, b""

    @staticmethod
    def _replaces(dfd: int, name: str, ino: int) -> bool:
        """Whether ``name`` exists in ``dfd`` as another entry than inode ``ino``."""
        try:
            return os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino != ino
        except FileNotFoundError:
            return False

    def _symlink(self, meta: dict[str, Any], data: bytes) -> Reply:
        target = _str(meta, "target")
        if not target or "\x00" in target or len(os.fsencode(target)) > MAX_TARGET:
            return errno.EINVAL, {}, b""
        dfd, name = self._parent(meta)
        try:
            self._reserve_inode()
            try:
                # stored as text, never resolved on the host: every walk here is O_NOFOLLOW
                os.symlink(target, name, dir_fd=dfd)
            except BaseException:
                self._unreserve_inode()
                raise
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
        reserved = True
        try:
            self._reserve_inode()
        except QuotaExceeded:         # no inode left: still fine for a file that exists
            if meta.get("excl") or not self.tree.exists(rel):
                raise
            reserved = False
        try:
            os.close(self.tree.open_beneath(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            if reserved:
                self._unreserve_inode()
            if meta.get("excl"):
                raise
            fd = self.tree.open_beneath(rel, os.O_RDONLY)    # an existing regular file (never a link)
            try:
                s = os.fstat(fd)
            finally:
                os.close(fd)
            return (errno.EISDIR, {}, b"") if st.S_ISDIR(s.st_mode) else (0, attr(s), b"")
        except BaseException:
            if reserved:
                self._unreserve_inode()
            raise
        if not reserved:              # made meanwhile by someone else's unlink: count it now
            self.usage.settle(inodes=1) if self.usage is not None else None
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
            if self.usage is None:
                return 0, {"size": _pwrite_all(fd, data, offset)}, b""
            before = os.fstat(fd)
            with self.usage.file_lock(before.st_ino):
                before = os.fstat(fd)
                estimate = write_estimate(before, offset, len(data))
                self.usage.reserve(estimate)          # EDQUOT: nothing written
                try:
                    done = _pwrite_all(fd, data, offset)
                finally:
                    self.usage.settle(charged_bytes(os.fstat(fd)) - charged_bytes(before) - estimate)
        finally:
            os.close(fd)
        return 0, {"size": done}, b""

    def _setattr(self, meta: dict[str, Any], data: bytes) -> Reply:
        rel = _str(meta, "path")
        if "size" in meta:
            size = _int(meta, "size")
            fd = self.tree.open_beneath(rel, os.O_WRONLY)
            try:
                if self.usage is None:
                    os.ftruncate(fd, size)
                else:                     # a truncate allocates nothing: it can only free
                    with self.usage.file_lock(os.fstat(fd).st_ino):
                        before = os.fstat(fd)
                        try:
                            os.ftruncate(fd, size)
                        finally:
                            self.usage.settle(charged_bytes(os.fstat(fd)) - charged_bytes(before))
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
                try:
                    out = await asyncio.get_running_loop().run_in_executor(executor, self.answer, frame)
                except RuntimeError:      # the executor is shut down: the node is closing
                    out = W.reply(frame.id, errno.EIO)
                writer.write(out)     # one write per reply: replies never interleave
                await writer.drain()
            except (ConnectionError, OSError):
                pass                  # the guest sends it again on the next channel
            finally:
                slots.release()

        try:
            while True:
                try:
                    header = await reader.readexactly(W.HEADER_LEN)
                except asyncio.IncompleteReadError:
                    return
                rid, meta_len, data_len = W.peek_header(header)
                if meta_len > W.MAX_META or data_len > W.MAX_DATA:
                    await _discard(reader, meta_len + data_len)
                    writer.write(W.reply(rid, errno.E2BIG))
                    continue
                body = await reader.readexactly(meta_len + data_len)
                try:
                    frame = W.decode_one(header, body)
                except W.MetaError as e:
                    writer.write(W.reply(e.frame_id, errno.EINVAL))
                    continue
                await slots.acquire()
                t = asyncio.get_running_loop().create_task(one(frame))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        finally:
            for t in list(tasks):
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)


async def _discard(reader: asyncio.StreamReader, n: int) -> None:
    """Read and drop ``n`` bytes (an oversized frame's body), ``DISCARD`` at a time."""
    while n > 0:
        chunk = await reader.read(min(n, DISCARD))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(chunk)
