"""Mounting envd's volume filesystems (envd/volfs.py): the mount(2) call, the mount
points envd accepts, which peers may open a channel, and the table of mounts by path
that the HTTP server hands channels to (docs/volumes.md, "Mounting")."""
from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import logging
import os
import socket
import threading
from typing import Any

from . import volwire as W
from .libc import libc
from .volfs import MAX_WRITE, VolfsError, VolumeFs

log = logging.getLogger("envd.volfs")

MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
CHANNEL_LIMIT = W.MAX_DATA + W.MAX_META + W.HEADER_LEN   # a whole frame in the reader

def peer_is_local(address: str) -> bool:
    """Whether a connection from ``address`` comes from inside this machine: loopback,
    or any address this kernel can bind (one of its own, whichever interface has it)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True
    if ip.is_loopback or ip.is_unspecified:
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return peer_is_local(str(ip.ipv4_mapped))
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(ip), 0))
        except OSError:
            return False          # EADDRNOTAVAIL: not one of ours
    return True




def check_mountpoint(path: str) -> str:
    """A normalised absolute mount point, or VolfsError 400."""
    if not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise VolfsError(400, "the mount path must be absolute")
    norm = os.path.normpath(path)
    if norm == "/" or any(p == ".." for p in path.split("/")):
        raise VolfsError(400, f"cannot mount a volume at {path!r}")
    for system in ("/proc", "/sys", "/dev", "/run/aenv"):
        if norm == system or norm.startswith(system + "/"):
            raise VolfsError(400, f"cannot mount a volume under {system}")
    return norm


def mount_fuse(mountpoint: str, volume: str) -> int:
    """Open /dev/fuse and mount it at ``mountpoint``; the fd serving it."""
    os.makedirs(mountpoint, exist_ok=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,max_read={MAX_WRITE}"
    src = f"aenv-volume:{volume}"
    if libc().mount(src.encode(), mountpoint.encode(), b"fuse.aenv", MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise VolfsError(500, f"mount {mountpoint}: {os.strerror(e)}")
    return fd


class VolumeMounts:
    """envd's mounts by mount point, served on a thread and event loop of their own.

    envd's own handlers touch files synchronously on the main loop (a ``files.read``
    or a ``ListDir`` of a volume path): if the FUSE daemon shared that loop, the
    kernel would wait for an answer from the very loop that is blocked in the
    syscall. So the daemons, their /dev/fuse fds and their channels live on the
    ``volfs`` thread; the main loop only hands each upgraded socket over."""

    def __init__(self) -> None:
        self.mounts: dict[str, VolumeFs] = {}       # touched on the volfs thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _daemon(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="volfs", daemon=True).start()
                self._loop = loop
            return self._loop

    async def _on_daemon(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._daemon()))

    async def attach(self, path: str, volume: str, sock: socket.socket, preamble: bytes = b"") -> None:
        """Mount (the first time) and make ``sock`` the channel of ``path``, after
        writing ``preamble`` (the 101) on it. VolfsError when it cannot mount."""
        mountpoint = check_mountpoint(path)
        await self._on_daemon(self._attach(mountpoint, volume, sock, preamble))

    async def _attach(self, mountpoint: str, volume: str, sock: socket.socket, preamble: bytes) -> None:
        fs = self.mounts.get(mountpoint)
        if fs is not None and fs.closed:
            del self.mounts[mountpoint]
            fs = None
        if fs is None:
            try:
                fd = mount_fuse(mountpoint, volume)
            except OSError as e:
                raise VolfsError(500, f"cannot mount at {mountpoint}: {e}") from None
            fs = VolumeFs(mountpoint, volume, fd)
            fs.start()
            self.mounts[mountpoint] = fs
        reader, writer = await asyncio.open_connection(sock=sock, limit=CHANNEL_LIMIT)
        fs.channel.attach(reader, writer, preamble)

    async def unmount(self, path: str) -> bool:
        """Detach the mount at ``path`` (lazily: open files keep it until closed) and end
        its daemon, which fails whatever still waits (ENOTCONN). False: none there."""
        mountpoint = check_mountpoint(path)
        if self._loop is None:
            return False
        return bool(await self._on_daemon(self._unmount(mountpoint)))

    async def _unmount(self, mountpoint: str) -> bool:
        fs = self.mounts.pop(mountpoint, None)
        if fs is None:
            return False
        if libc().umount2(mountpoint.encode(), MNT_DETACH) != 0:
            log.warning("umount %s: %s", mountpoint, os.strerror(ctypes.get_errno()))
        fs.close()
        return True

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return

        def shut() -> None:
            for fs in self.mounts.values():
                fs.close()
            loop.stop()
        loop.call_soon_threadsafe(shut)
