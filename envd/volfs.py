"""Volume mounts in the guest: a FUSE filesystem over ``/dev/fuse`` whose every
operation is a request on a channel the node dialled in (docs/volumes.md, "Mount").

envd never connects out: the node opens ``POST /_aenv/volume`` with ``Upgrade:
aenv-volume/1`` and the sandbox's access token; envd answers 101 and the
connection becomes the channel of one mount point (envd/volwire.py frames: envd
sends requests, the node answers). The first channel for a path mounts it; a
later one (after a resume, in a fork child) replaces the channel and every request
still unanswered is sent again on it: requests made while no channel is there
wait, as on a hard NFS mount.

What the guest keeps, so the node keeps nothing: the node id <-> volume path
table (``Nodes``) and open handles. Paths sent to the node are relative to the
volume root; the node resolves them beneath the volume's root (it trusts none).
Semantics: close-to-open data consistency (no page cache kept across opens),
attributes cached ``ATTR_VALID`` seconds, no hard links, no device nodes or FIFOs,
an unlinked file cannot be read through a handle opened before (ESTALE), like NFS
without silly renames.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat as st
from dataclasses import dataclass, field
from typing import Any

from . import fuse_proto as F
from . import volwire as W

log = logging.getLogger("envd.volfs")

ATTR_VALID = 1              # seconds the kernel may cache attributes and names
READAHEAD_KB = 1024         # sequential reads ask for 1 MiB at a time (one round trip each)
MAX_WRITE = 1 << 20
READ_BUF = MAX_WRITE + 64 * 1024


class VolfsError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Node:
    path: str | None        # relative to the volume root ("" = the root); None: removed
    lookups: int = 0


class Nodes:
    """FUSE node ids <-> volume paths (pure; renames move whole subtrees)."""

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {1: Node("", 1)}
        self.by_path: dict[str, int] = {"": 1}
        self._next = 2

    def path(self, nodeid: int) -> str:
        node = self.nodes.get(nodeid)
        if node is None or node.path is None:
            raise OSError(errno.ESTALE, "stale node")
        return node.path

    @staticmethod
    def child(parent: str, name: bytes) -> str:
        n = os.fsdecode(name)
        if not n or n in (".", "..") or "/" in n:
            raise OSError(errno.EINVAL, "bad name")
        return f"{parent}/{n}" if parent else n

    def remember(self, path: str) -> int:
        nid = self.by_path.get(path)
        if nid is None:
            nid = self._next
            self._next += 1
            self.nodes[nid] = Node(path)
            self.by_path[path] = nid
        self.nodes[nid].lookups += 1
        return nid

    def forget(self, nodeid: int, n: int) -> None:
        node = self.nodes.get(nodeid)
        if node is None or nodeid == 1:
            return
        node.lookups -= n
        if node.lookups <= 0:
            del self.nodes[nodeid]
            if node.path is not None and self.by_path.get(node.path) == nodeid:
                del self.by_path[node.path]

    def removed(self, path: str) -> None:
        nid = self.by_path.pop(path, None)
        if nid is not None:
            self.nodes[nid].path = None

    def renamed(self, old: str, new: str) -> None:
        self.removed(new)
        moved = [(p, nid) for p, nid in self.by_path.items() if p == old or p.startswith(old + "/")]
        for p, nid in moved:
            del self.by_path[p]
        for p, nid in moved:
            np = new + p[len(old):]
            self.nodes[nid].path = np
            self.by_path[np] = nid

    def exchanged(self, a: str, b: str) -> None:
        tmp = "\0x"
        self.renamed(a, tmp)
        self.renamed(b, a)
        self.renamed(tmp, b)


@dataclass
class _Pending:
    frame: bytes
    future: asyncio.Future


@dataclass
class DirHandle:
    entries: list[tuple[bytes, str, int]] = field(default_factory=list)


class Channel:
    """Requests to the node, answered in any order; survives re-dials."""

    def __init__(self) -> None:
        self._next = 1
        self._pending: dict[int, _Pending] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.attached = asyncio.Event()

    async def call(self, op: W.Op, meta: dict[str, Any], data: bytes = b"") -> tuple[dict[str, Any], bytes]:
        rid = self._next
        self._next = self._next + 1 if self._next < 0xFFFFFFFF else 1
        fut = asyncio.get_running_loop().create_future()
        try:
            raw = W.request(rid, op, meta, data)
        except W.WireError as e:      # a request no frame can carry (never sent: the node would refuse it)
            raise OSError(errno.ENAMETOOLONG, str(e)) from None
        p = _Pending(raw, fut)
        self._pending[rid] = p
        try:
            if self._writer is not None:
                self._send(p.frame)
            frame: W.Frame = await fut
        finally:
            self._pending.pop(rid, None)
        if frame.code:
            raise OSError(frame.code, os.strerror(frame.code))
        return frame.meta, frame.data

    def _send(self, raw: bytes) -> None:
        try:
            assert self._writer is not None
            self._writer.write(raw)
        except (ConnectionError, OSError, RuntimeError):
            pass      # the reader sees the loss; the request is resent on the next channel

    def attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
               preamble: bytes = b"") -> asyncio.Task[None]:
        """Use this connection from now on (closing the one before) and resend what
        waits (after ``preamble``: the 101 that opens it)."""
        self.detach()
        self._writer = writer
        if preamble:
            writer.write(preamble)
        for p in list(self._pending.values()):
            self._send(p.frame)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader, writer))
        self.attached.set()
        return self._reader_task

    def detach(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._reader_task is not None and not self._reader_task.done():
            self._reader_task.cancel()
        self._reader_task = None
        self.attached.clear()

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(W.HEADER_LEN)
                meta_len, data_len = W.header_lengths(header)
                frame = W.decode_one(header, await reader.readexactly(meta_len + data_len))
                p = self._pending.get(frame.id)
                if frame.kind is W.Kind.REPLY and p is not None and not p.future.done():
                    p.future.set_result(frame)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, W.WireError) as e:
            log.info("volume channel closed: %s", e)
        finally:
            if self._writer is writer:
                self._writer = None
                self.attached.clear()
            writer.close()


class VolumeFs:
    """One mounted volume: /dev/fuse requests -> channel requests -> /dev/fuse replies."""

    def __init__(self, mountpoint: str, volume: str, fd: int) -> None:
        self.mountpoint = mountpoint
        self.volume = volume
        self.fd = fd
        self.channel = Channel()
        self.nodes = Nodes()
        self._fhs: dict[int, int] = {}          # file handle -> node id
        self._dirs: dict[int, DirHandle] = {}
        self._next_fh = 1
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    # ------------------------------------------------------------ /dev/fuse

    def start(self) -> None:
        os.set_blocking(self.fd, False)
        asyncio.get_running_loop().add_reader(self.fd, self._readable)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            asyncio.get_running_loop().remove_reader(self.fd)
        except (RuntimeError, ValueError):
            pass
        self.channel.detach()
        for t in list(self._tasks):
            t.cancel()
        os.close(self.fd)

    def _readable(self) -> None:
        for _ in range(64):
            try:
                buf = os.read(self.fd, READ_BUF)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.ENOENT:       # the request was interrupted: skip it
                    continue
                log.info("volume %s at %s unmounted (%s)", self.volume, self.mountpoint, e)
                self.close()
                return
            if not buf:
                self.close()
                return
            try:
                req = F.parse_request(buf)
            except F.ProtocolError as e:
                log.warning("bad FUSE request: %s", e)
                self._refuse(buf)
                continue
            t = asyncio.get_running_loop().create_task(self._handle(req))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def _refuse(self, buf: bytes) -> None:
        """EIO to a request that does not parse, when its header names it: the process
        that made it gets an error instead of waiting forever."""
        if len(buf) >= F.IN_HEADER.size:
            _length, opcode, unique, *_ = F.IN_HEADER.unpack_from(buf, 0)
            if opcode not in F.NO_REPLY:
                self._write(F.error(unique, errno.EIO))

    def _write(self, raw: bytes) -> None:
        try:
            os.write(self.fd, raw)
        except OSError as e:   # ENOENT: the request was interrupted meanwhile
            if e.errno != errno.ENOENT:
                log.debug("fuse reply: %s", e)

    async def _handle(self, req: F.Request) -> None:
        name = F.OPCODE_NAMES.get(req.opcode)
        handler = getattr(self, f"op_{name}", None) if name else None
        if handler is None:
            if req.opcode not in F.NO_REPLY:
                self._write(F.error(req.unique, errno.ENOSYS))
            return
        try:
            body = await handler(req)
        except OSError as e:
            if req.opcode not in F.NO_REPLY:
                self._write(F.error(req.unique, e.errno or errno.EIO))
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:      # any failure is an errno to the caller, never silence
            log.warning("FUSE %s failed: %r", req.opcode, e)
            if req.opcode not in F.NO_REPLY:
                self._write(F.error(req.unique, errno.EIO))
            return
        if body is not None and req.opcode not in F.NO_REPLY:
            self._write(F.reply(req.unique, body))
        if req.opcode == F.Opcode.INIT:
            set_readahead(self.mountpoint, READAHEAD_KB)   # after INIT: it sets its own first

    async def _call(self, op: W.Op, meta: dict[str, Any], data: bytes = b"") -> tuple[dict[str, Any], bytes]:
        return await self.channel.call(op, meta, data)

    # ------------------------------------------------------------ operations

    async def op_init(self, req: F.Request) -> bytes:
        major, minor, readahead, flags = F.INIT_IN.unpack_from(req.body, 0)
        if major != F.KERNEL_MAJOR:
            raise OSError(errno.EPROTO, "FUSE major version")
        return F.INIT_OUT.pack(F.KERNEL_MAJOR, min(minor, F.KERNEL_MINOR), max(readahead, READAHEAD_KB << 10),
                               flags & F.WANTED_FLAGS,
                               16, 12, MAX_WRITE, 1, MAX_WRITE // 4096, 0, 0)

    async def op_destroy(self, req: F.Request) -> bytes:
        return b""

    async def op_forget(self, req: F.Request) -> None:
        (n,) = F.FORGET_IN.unpack_from(req.body, 0)
        self.nodes.forget(req.nodeid, n)

    async def op_batch_forget(self, req: F.Request) -> None:
        count, _ = F.BATCH_FORGET_IN.unpack_from(req.body, 0)
        for i in range(count):
            nid, n = F.FORGET_ONE.unpack_from(req.body, F.BATCH_FORGET_IN.size + i * F.FORGET_ONE.size)
            self.nodes.forget(nid, n)

    async def op_interrupt(self, req: F.Request) -> None:
        return None

    def _entry(self, path: str, a: dict[str, Any]) -> bytes:
        return F.entry_out(self.nodes.remember(path), a, ATTR_VALID)

    async def op_lookup(self, req: F.Request) -> bytes:
        (name,) = F.cstrings(req.body, 1)
        path = self.nodes.child(self.nodes.path(req.nodeid), name)
        a, _ = await self._call(W.Op.STAT, {"path": path})
        return self._entry(path, a)

    async def op_getattr(self, req: F.Request) -> bytes:
        a, _ = await self._call(W.Op.STAT, {"path": self.nodes.path(req.nodeid)})
        return F.attr_out(req.nodeid, a, ATTR_VALID)

    async def op_setattr(self, req: F.Request) -> bytes:
        (valid, _, fh, size, _lo, atime, mtime, _c, atimens, mtimens, _cn, mode, _u4, uid, gid,
         _u5) = F.SETATTR_IN.unpack_from(req.body, 0)
        meta: dict[str, Any] = {"path": self.nodes.path(req.nodeid)}
        if valid & F.FATTR_MODE:
            meta["mode"] = st.S_IMODE(mode)
        if valid & F.FATTR_UID:
            meta["uid"] = uid
        if valid & F.FATTR_GID:
            meta["gid"] = gid
        if valid & F.FATTR_SIZE:
            meta["size"] = size
        if valid & F.FATTR_ATIME:
            meta["atime"] = "now" if valid & F.FATTR_ATIME_NOW else atime * 1_000_000_000 + atimens
        if valid & F.FATTR_MTIME:
            meta["mtime"] = "now" if valid & F.FATTR_MTIME_NOW else mtime * 1_000_000_000 + mtimens
        a, _ = await self._call(W.Op.SETATTR, meta)
        return F.attr_out(req.nodeid, a, ATTR_VALID)

    async def op_readlink(self, req: F.Request) -> bytes:
        m, _ = await self._call(W.Op.READLINK, {"path": self.nodes.path(req.nodeid)})
        return os.fsencode(m["target"])

    async def op_symlink(self, req: F.Request) -> bytes:
        name, target = F.cstrings(req.body, 2)
        path = self.nodes.child(self.nodes.path(req.nodeid), name)
        a, _ = await self._call(W.Op.SYMLINK, {"path": path, "target": os.fsdecode(target), "uid": req.uid,
                                                "gid": req.gid})
        return self._entry(path, a)

    async def op_mknod(self, req: F.Request) -> bytes:
        raise OSError(errno.EPERM, "no device nodes or FIFOs in a volume")

    async def op_link(self, req: F.Request) -> bytes:
        raise OSError(errno.EPERM, "no hard links in a volume")

    async def op_mkdir(self, req: F.Request) -> bytes:
        mode, umask = F.MKDIR_IN.unpack_from(req.body, 0)
        (name,) = F.cstrings(req.body[F.MKDIR_IN.size:], 1)
        path = self.nodes.child(self.nodes.path(req.nodeid), name)
        a, _ = await self._call(W.Op.MKDIR, {"path": path, "mode": st.S_IMODE(mode) & ~umask,
                                              "uid": req.uid, "gid": req.gid})
        return self._entry(path, a)

    async def op_unlink(self, req: F.Request) -> bytes:
        (name,) = F.cstrings(req.body, 1)
        path = self.nodes.child(self.nodes.path(req.nodeid), name)
        await self._call(W.Op.UNLINK, {"path": path})
        self.nodes.removed(path)
        return b""

    async def op_rmdir(self, req: F.Request) -> bytes:
        (name,) = F.cstrings(req.body, 1)
        path = self.nodes.child(self.nodes.path(req.nodeid), name)
        await self._call(W.Op.RMDIR, {"path": path})
        self.nodes.removed(path)
        return b""

    async def _rename(self, req: F.Request, newdir: int, flags: int, rest: bytes) -> bytes:
        old, new = F.cstrings(rest, 2)
        src = self.nodes.child(self.nodes.path(req.nodeid), old)
        dst = self.nodes.child(self.nodes.path(newdir), new)
        await self._call(W.Op.RENAME, {"path": src, "to": dst, "flags": flags})
        if flags & 2:
            self.nodes.exchanged(src, dst)
        else:
            self.nodes.renamed(src, dst)
        return b""

    async def op_rename(self, req: F.Request) -> bytes:
        (newdir,) = F.RENAME_IN.unpack_from(req.body, 0)
        return await self._rename(req, newdir, 0, req.body[F.RENAME_IN.size:])

    async def op_rename2(self, req: F.Request) -> bytes:
        newdir, flags, _ = F.RENAME2_IN.unpack_from(req.body, 0)
        return await self._rename(req, newdir, flags, req.body[F.RENAME2_IN.size:])

    def _new_fh(self, nodeid: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._fhs[fh] = nodeid
        self.nodes.nodes[nodeid].lookups += 1      # a handle keeps its node
        return fh

    def _fh_path(self, fh: int) -> str:
        nid = self._fhs.get(fh)
        if nid is None:
            raise OSError(errno.EBADF, "bad handle")
        return self.nodes.path(nid)

    async def op_open(self, req: F.Request) -> bytes:
        flags, _ = F.OPEN_IN.unpack_from(req.body, 0)
        await self._call(W.Op.OPEN, {"path": self.nodes.path(req.nodeid),
                                     "write": bool(flags & (os.O_WRONLY | os.O_RDWR))})
        return F.OPEN_OUT.pack(self._new_fh(req.nodeid), 0, 0)

    async def op_create(self, req: F.Request) -> bytes:
        flags, mode, umask, _ = F.CREATE_IN.unpack_from(req.body, 0)
        (name,) = F.cstrings(req.body[F.CREATE_IN.size:], 1)
        path = self.nodes.child(self.nodes.path(req.nodeid), name)
        a, _ = await self._call(W.Op.CREATE, {"path": path, "mode": st.S_IMODE(mode) & ~umask,
                                               "excl": bool(flags & os.O_EXCL), "uid": req.uid, "gid": req.gid})
        entry = self._entry(path, a)
        nid = self.nodes.by_path[path]
        return entry + F.OPEN_OUT.pack(self._new_fh(nid), 0, 0)

    async def op_read(self, req: F.Request) -> bytes:
        fh, offset, size, *_ = F.READ_IN.unpack_from(req.body, 0)
        _, data = await self._call(W.Op.READ, {"path": self._fh_path(fh), "offset": offset, "size": size})
        return data

    async def op_write(self, req: F.Request) -> bytes:
        fh, offset, size, *_ = F.WRITE_IN.unpack_from(req.body, 0)
        data = req.body[F.WRITE_IN.size:F.WRITE_IN.size + size]
        m, _ = await self._call(W.Op.WRITE, {"path": self._fh_path(fh), "offset": offset}, data)
        return F.WRITE_OUT.pack(int(m.get("size", 0)), 0)

    async def op_release(self, req: F.Request) -> bytes:
        (fh,) = struct_fh(req.body)
        nid = self._fhs.pop(fh, None)
        if nid is not None:
            self.nodes.forget(nid, 1)
        return b""

    async def op_flush(self, req: F.Request) -> bytes:
        return b""

    async def op_fsync(self, req: F.Request) -> bytes:
        (fh,) = struct_fh(req.body)
        await self._call(W.Op.FSYNC, {"path": self._fh_path(fh)})
        return b""

    async def op_opendir(self, req: F.Request) -> bytes:
        path = self.nodes.path(req.nodeid)
        h = DirHandle([(b".", "d", req.nodeid), (b"..", "d", 1)])
        offset = 0
        cookie = 0
        while True:
            # the cookie says where the node's listing goes on (its directory offset); the
            # count is for nodes that page by count only
            m, _ = await self._call(W.Op.READDIR, {"path": path, "offset": offset, "cookie": cookie})
            for name, kind, ino in m.get("entries", []):
                h.entries.append((os.fsencode(name), kind, int(ino)))
            offset += len(m.get("entries", []))
            next_cookie = m.get("cookie")
            if isinstance(next_cookie, int) and not isinstance(next_cookie, bool):
                cookie = next_cookie
            if not m.get("more") or not m.get("entries"):
                break
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = h
        return F.OPEN_OUT.pack(fh, 0, 0)

    async def op_readdir(self, req: F.Request) -> bytes:
        fh, offset, size, *_ = F.READ_IN.unpack_from(req.body, 0)
        h = self._dirs.get(fh)
        if h is None:
            raise OSError(errno.EBADF, "bad directory handle")
        out = bytearray()
        for i in range(offset, len(h.entries)):
            name, kind, ino = h.entries[i]
            ent = F.dirent(ino or 1, i + 1, name, kind)
            if len(out) + len(ent) > size:
                break
            out += ent
        return bytes(out)

    async def op_releasedir(self, req: F.Request) -> bytes:
        (fh,) = struct_fh(req.body)
        self._dirs.pop(fh, None)
        return b""

    async def op_fsyncdir(self, req: F.Request) -> bytes:
        return b""

    async def op_statfs(self, req: F.Request) -> bytes:
        m, _ = await self._call(W.Op.STATFS, {})
        return F.STATFS_OUT.pack(m["blocks"], m["bfree"], m["bavail"], m["files"], m["ffree"], m["bsize"],
                                 min(int(m["namelen"]), 255), m["frsize"])


def struct_fh(body: bytes) -> tuple[int]:
    return (int.from_bytes(body[:8], "little"),)


def set_readahead(mountpoint: str, kb: int) -> None:
    """Raise the mount's read-ahead (FUSE starts at 128 KiB: one round trip per 128 KiB of a
    sequential read). The device number comes from mountinfo: a stat of the mount point
    would be a FUSE request to this very daemon."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4] == mountpoint:
                    with open(f"/sys/class/bdi/{fields[2]}/read_ahead_kb", "w") as bdi:
                        bdi.write(str(kb))
    except OSError as e:
        log.debug("read-ahead of %s not set: %s", mountpoint, e)
