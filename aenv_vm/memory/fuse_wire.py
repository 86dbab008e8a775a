"""The part of the Linux FUSE kernel protocol (include/uapi/linux/fuse.h) that a
read-only file server needs: struct codecs over bytes, no I/O. Host side (the
lazy memory files of lazyfs.py); envd has its own guest-side codec and the two
never share code (envd imports no host package, and the host trusts nothing of
the guest's). Protocol 7.31 (Linux 5.4+), little endian as on x86-64 and arm64.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

KERNEL_MAJOR = 7
KERNEL_MINOR = 31

IN_HEADER = struct.Struct("<IIQQIIII")       # len opcode unique nodeid uid gid pid padding
OUT_HEADER = struct.Struct("<IiQ")           # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")    # fuse_attr, 88 bytes
ENTRY_OUT = struct.Struct("<QQQQII")         # nodeid generation entry_valid attr_valid (+nsec x2), then ATTR
ATTR_OUT = struct.Struct("<QII")             # attr_valid attr_valid_nsec dummy, then ATTR
INIT_IN = struct.Struct("<IIII")             # major minor max_readahead flags (newer kernels send more)
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")  # 64 bytes
OPEN_IN = struct.Struct("<II")               # flags, open_flags
OPEN_OUT = struct.Struct("<QII")             # fh open_flags padding
READ_IN = struct.Struct("<QQIIQII")          # fh offset size read_flags lock_owner flags padding
STATFS_OUT = struct.Struct("<QQQQQIII28x")   # fuse_kstatfs, 80 bytes
DIRENT = struct.Struct("<QQII")              # ino off namelen type, name padded to 8

# INIT flags this server asks for
ASYNC_READ = 1 << 0               # several READs of one file in flight (the faults of many vCPUs/QEMUs)
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22               # requests of up to max_pages pages (else 32)
EXPLICIT_INVAL_DATA = 1 << 25     # cached pages are dropped only when the server says so
WANTED_FLAGS = ASYNC_READ | PARALLEL_DIROPS | MAX_PAGES | EXPLICIT_INVAL_DATA

# OPEN reply flags
FOPEN_KEEP_CACHE = 1 << 1         # an open does not drop the page cache every other QEMU maps

S_IFDIR = 0o040000
S_IFREG = 0o100000
DT_DIR = 4
DT_REG = 8


class Opcode(enum.IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    DESTROY = 38
    BATCH_FORGET = 42
    FALLOCATE = 43
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47


NO_REPLY = frozenset({Opcode.FORGET, Opcode.BATCH_FORGET, Opcode.INTERRUPT})
# what changes the filesystem: always refused (EROFS), whoever asks
WRITES = frozenset({Opcode.SETATTR, Opcode.SYMLINK, Opcode.MKNOD, Opcode.MKDIR, Opcode.UNLINK, Opcode.RMDIR,
                    Opcode.RENAME, Opcode.LINK, Opcode.WRITE, Opcode.SETXATTR, Opcode.REMOVEXATTR,
                    Opcode.CREATE, Opcode.FALLOCATE, Opcode.RENAME2, Opcode.COPY_FILE_RANGE})


class ProtocolError(ValueError):
    """Bytes from /dev/fuse that are not a well-formed request."""


@dataclass(frozen=True)
class Request:
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    body: bytes


def parse_request(buf: bytes) -> Request:
    if len(buf) < IN_HEADER.size:
        raise ProtocolError(f"short FUSE request ({len(buf)} bytes)")
    length, opcode, unique, nodeid, uid, gid, pid, _ = IN_HEADER.unpack_from(buf, 0)
    if length != len(buf):
        raise ProtocolError(f"FUSE request says {length} bytes, read {len(buf)}")
    return Request(opcode, unique, nodeid, uid, gid, pid, bytes(buf[IN_HEADER.size:]))


def reply_header(unique: int, body_len: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + body_len, 0, unique)


def reply(unique: int, body: bytes = b"") -> bytes:
    return reply_header(unique, len(body)) + body


def error(unique: int, errno: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size, -errno, unique)


def attr(ino: int, mode: int, size: int, mtime: int, nlink: int = 1) -> bytes:
    """fuse_attr of a root-owned node (times in whole seconds)."""
    return ATTR.pack(ino, size, (size + 511) // 512, mtime, mtime, mtime, 0, 0, 0, mode, nlink, 0, 0, 0, 4096, 0)


def entry_out(ino: int, attr_bytes: bytes, valid: int) -> bytes:
    return ENTRY_OUT.pack(ino, 0, valid, valid, 0, 0) + attr_bytes


def attr_out(attr_bytes: bytes, valid: int) -> bytes:
    return ATTR_OUT.pack(valid, 0, 0) + attr_bytes


def dirent(ino: int, off: int, name: bytes, kind: int) -> bytes:
    raw = DIRENT.pack(ino, off, len(name), kind) + name
    return raw + bytes(-len(raw) % 8)


def cstring(body: bytes) -> bytes:
    """The NUL-terminated name at the start of ``body``."""
    end = body.find(b"\0")
    if end < 0:
        raise ProtocolError("missing NUL-terminated name")
    return body[:end]
