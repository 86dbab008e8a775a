"""Sockets of the node's process inside a sandbox's network namespace.

The node's egress proxy and DNS forwarder listen *inside* each sandbox
namespace (where its guest's redirected connections arrive, and where the
kernel knows their original destination) while everything else of the node
stays in its own namespace. A socket keeps the namespace it was made in, so
``listener`` makes it in a short-lived thread that joins the namespace
(``setns`` changes only the calling thread's network namespace) and then goes.
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from pathlib import Path

NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_SO_ORIGINAL_DST = 80       # linux/netfilter_ipv4.h
_libc = ctypes.CDLL(None, use_errno=True)


class NamespaceError(OSError):
    """A namespace could not be joined."""


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NamespaceError(err, os.strerror(err))


def listener(namespace: str, kind: int, addr: tuple[str, int]) -> socket.socket:
    """A bound socket (listening, for TCP) in ``namespace``, non-blocking."""
    return listeners(namespace, [(kind, addr)])[0]


def listeners(namespace: str, wanted: list[tuple[int, tuple[str, int]]]) -> list[socket.socket]:
    """``listener`` for each ``(kind, addr)`` of ``wanted``, all made by one thread in
    one visit to the namespace; all or none (those made are closed on an error)."""
    out: list[socket.socket] = []
    errors: list[BaseException] = []

    def work() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.open(NETNS_DIR / namespace, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            os.close(own)
            errors.append(NamespaceError(e.errno, f"network namespace {namespace}: {e.strerror}"))
            return
        try:
            _setns(target)
            try:
                for kind, addr in wanted:
                    out.append(_bound(kind, addr))
            finally:
                _setns(own)   # this thread ends right after anyway
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors.append(e)
        finally:
            os.close(target)
            os.close(own)
    t = threading.Thread(target=work, name=f"netns-{namespace}", daemon=True)
    t.start()
    t.join()
    if errors:
        for s in out:
            s.close()
        raise errors[0]
    return out


def _bound(kind: int, addr: tuple[str, int]) -> socket.socket:
    s = socket.socket(socket.AF_INET, kind)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        if kind == socket.SOCK_STREAM:
            s.listen(128)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


def original_destination(sock: socket.socket) -> tuple[str, int] | None:
    """Where a connection redirected by nftables (``redirect``/``dnat``) was going,
    from the namespace's connection tracking; None if it was not redirected."""
    try:
        raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port = struct.unpack_from(">H", raw, 2)[0]
    return socket.inet_ntoa(raw[4:8]), port
