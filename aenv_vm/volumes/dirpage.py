"""A page of a directory listing that fits one volume-channel reply, resumed by cookie.

A READDIR reply is one frame, and a frame's meta is at most ``MAX_META`` (64 KiB): a
page is therefore cut by the *encoded* size of its entries, not by their number (512
names of 200 bytes are 110 KiB; 240 such names already overflowed a page of a fixed
count, and the reply was never sent). The node keeps nothing between pages: each
answer carries a cookie -- the directory offset (``d_off`` of getdents64) after its
last entry, which the filesystem keeps valid as NFS servers rely on -- and the next
request resumes there with ``lseek``. A directory of any size is listed in memory of
one page, whatever the guest does.

``parse_dirents`` is a pure function over getdents64's buffer (fuzzed); ``read_page``
moves bytes from the kernel to it.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import stat as st
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from envd import volwire as W

DIRENT = struct.Struct("<QqHB")          # d_ino, d_off, d_reclen, d_type; then the NUL-ended name
BUFFER = 64 << 10                        # bytes asked of getdents64 at a time
PAGE_BUDGET = W.MAX_META - 256           # encoded entries per reply: the rest is {"more":..,"cookie":..}
MAX_COOKIE = (1 << 63) - 1
_KIND = {4: "d", 8: "f", 10: "l"}        # DT_DIR, DT_REG, DT_LNK; anything else is "o"
_SYSCALL_GETDENTS64 = {"x86_64": 217, "aarch64": 61, "riscv64": 61, "ppc64le": 202, "s390x": 220}


@dataclass(frozen=True)
class Dirent:
    ino: int
    cookie: int          # the offset at which the entry after this one is read
    dtype: int
    name: bytes


def parse_dirents(buf: bytes | memoryview) -> Iterator[Dirent]:
    """The linux_dirent64 records of ``buf`` in order. ValueError for a record that
    runs past the buffer or is shorter than its header."""
    view = memoryview(buf)
    pos = 0
    while pos < len(view):
        if pos + DIRENT.size > len(view):
            raise ValueError(f"a directory record header runs past the buffer at {pos}")
        ino, off, reclen, dtype = DIRENT.unpack_from(view, pos)
        if reclen < DIRENT.size + 1 or pos + reclen > len(view):
            raise ValueError(f"a directory record of length {reclen} at {pos} does not fit")
        raw = bytes(view[pos + DIRENT.size:pos + reclen])
        nul = raw.find(b"\0")
        yield Dirent(ino, off, dtype, raw if nul < 0 else raw[:nul])
        pos += reclen


def entry_json(name: str, kind: str, ino: int) -> bytes:
    """One listing entry as the reply's JSON encodes it (the page budget counts these)."""
    return json.dumps([name, kind, ino], separators=(",", ":")).encode()


class _Getdents:
    """getdents64(2) through libc (glibc ≥ 2.30 names it), else the raw system call."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "getdents64", None)
        if fn is not None:
            fn.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
            fn.restype = ctypes.c_ssize_t
            self._call = lambda fd, buf, n: fn(fd, buf, n)
        else:
            nr = _SYSCALL_GETDENTS64.get(os.uname().machine)
            if nr is None:
                raise OSError(errno.ENOSYS, f"no getdents64 on {os.uname().machine}")
            sc = libc.syscall
            sc.restype = ctypes.c_long
            self._call = lambda fd, buf, n: sc(ctypes.c_long(nr), ctypes.c_int(fd), buf, ctypes.c_size_t(n))

    def __call__(self, fd: int, size: int) -> bytes:
        buf = ctypes.create_string_buffer(size)
        n = self._call(fd, buf, size)
        if n < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return buf.raw[:n]


_getdents: _Getdents | None = None


def _kind(dfd: int, d: Dirent, name: str) -> str:
    kind = _KIND.get(d.dtype)
    if kind is not None:
        return kind
    if d.dtype != 0:                     # a FIFO, socket or device: listed, never opened
        return "o"
    try:                                 # DT_UNKNOWN: the filesystem does not say
        s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return "o"
    return "d" if st.S_ISDIR(s.st_mode) else "l" if st.S_ISLNK(s.st_mode) else "f" if st.S_ISREG(s.st_mode) else "o"


@dataclass(frozen=True)
class Page:
    entries: list[tuple[str, str, int]]
    cookie: int          # where the next page starts
    more: bool


def read_page(dfd: int, cookie: int, skip: int = 0, budget: int = PAGE_BUDGET) -> Page:
    """Entries of the directory open at ``dfd`` (O_RDONLY | O_DIRECTORY) from ``cookie``
    on, after skipping ``skip`` of them, whose encoded size stays within ``budget``
    (at least one: a name is at most 255 bytes, ~1.6 KiB encoded). ``.`` and ``..``
    are left out."""
    global _getdents
    if _getdents is None:
        _getdents = _Getdents()
    if not 0 <= cookie <= MAX_COOKIE:
        raise OSError(errno.EINVAL, "a listing cookie is a directory offset in 0..2**63-1")
    os.lseek(dfd, cookie, os.SEEK_SET)
    out: list[tuple[str, str, int]] = []
    used = 0
    at = cookie
    while True:
        buf = _getdents(dfd, BUFFER)
        if not buf:
            return Page(out, at, False)
        for d in parse_dirents(buf):
            if d.name in (b".", b".."):
                at = d.cookie
                continue
            if skip > 0:
                skip -= 1
                at = d.cookie
                continue
            name = os.fsdecode(d.name)
            entry = (name, _kind(dfd, d, name), d.ino)
            size = len(entry_json(*entry)) + 1
            if out and used + size > budget:
                return Page(out, at, True)
            out.append(entry)
            used += size
            at = d.cookie
        # the buffer is spent: the next getdents64 goes on from the last record's offset,
        # which is where the fd stands now
