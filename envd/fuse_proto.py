"""The Linux FUSE kernel protocol (include/uapi/linux/fuse.h), the part envd's volume
mounts speak: pure struct codecs over bytes, no I/O. Negotiated version 7.31 (Linux
5.4+); everything is little-endian, as the kernel's own structs on x86-64.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

KERNEL_MAJOR = 7
KERNEL_MINOR = 31

IN_HEADER = struct.Struct("<IIQQIIII")      # len opcode unique nodeid uid gid pid padding
OUT_HEADER = struct.Struct("<IiQ")          # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")   # fuse_attr (88 bytes)
ENTRY_OUT = struct.Struct("<QQQQII")        # + attr
ATTR_OUT = struct.Struct("<QII")            # + attr
INIT_IN = struct.Struct("<IIII")
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")  # 64 bytes
OPEN_IN = struct.Struct("<II")
OPEN_OUT = struct.Struct("<QII")
CREATE_IN = struct.Struct("<IIII")
MKDIR_IN = struct.Struct("<II")
READ_IN = struct.Struct("<QQIIQII")         # fh offset size read_flags lock_owner flags padding
WRITE_IN = struct.Struct("<QQIIQII")
WRITE_OUT = struct.Struct("<II")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
STATFS_OUT = struct.Struct("<QQQQQIII28x")  # fuse_kstatfs (80 bytes)
DIRENT = struct.Struct("<QQII")             # ino off namelen type, then the name, padded to 8
INVAL_INODE_OUT = struct.Struct("<Qqq")

# init flags
ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
WANTED_FLAGS = ASYNC_READ | BIG_WRITES | AUTO_INVAL_DATA | PARALLEL_DIROPS | MAX_PAGES

# setattr valid bits
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1, 2, 4, 8
FATTR_ATIME, FATTR_MTIME, FATTR_FH, FATTR_ATIME_NOW, FATTR_MTIME_NOW = 16, 32, 64, 128, 256

NOTIFY_INVAL_INODE = 2


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
    RENAME2 = 45


OPCODE_NAMES = {op.value: op.name.lower() for op in Opcode}
NO_REPLY = frozenset({Opcode.FORGET, Opcode.BATCH_FORGET, Opcode.INTERRUPT})


@dataclass(frozen=True)
class Request:
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    body: bytes


class ProtocolError(ValueError):
    """Bytes from /dev/fuse that are not a request (a kernel bug, or not FUSE)."""


def parse_request(buf: bytes) -> Request:
    if len(buf) < IN_HEADER.size:
        raise ProtocolError(f"short FUSE request ({len(buf)} bytes)")
    length, opcode, unique, nodeid, uid, gid, pid, _ = IN_HEADER.unpack_from(buf, 0)
    if length != len(buf):
        raise ProtocolError(f"FUSE request says {length} bytes, read {len(buf)}")
    return Request(opcode, unique, nodeid, uid, gid, pid, bytes(buf[IN_HEADER.size:]))


def reply(unique: int, body: bytes = b"") -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body


def error(unique: int, errno: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size, -errno, unique)


def cstrings(body: bytes, n: int) -> list[bytes]:
    """The first ``n`` NUL-terminated strings of ``body``."""
    parts = body.split(b"\0")
    if len(parts) <= n - 1 or len(parts) < n:
        raise ProtocolError("missing NUL-terminated name")
    return parts[:n]


def pack_attr(a: dict, ino: int) -> bytes:
    def sec(ns: int) -> tuple[int, int]:
        return ns // 1_000_000_000, ns % 1_000_000_000
    at, atn = sec(int(a.get("atime", 0)))
    mt, mtn = sec(int(a.get("mtime", 0)))
    ct, ctn = sec(int(a.get("ctime", 0)))
    return ATTR.pack(ino, int(a.get("size", 0)), int(a.get("blocks", 0)), at, mt, ct, atn, mtn, ctn,
                     int(a.get("mode", 0)), int(a.get("nlink", 1)), int(a.get("uid", 0)), int(a.get("gid", 0)),
                     0, 4096, 0)


def entry_out(nodeid: int, a: dict, valid_s: int) -> bytes:
    return ENTRY_OUT.pack(nodeid, 0, valid_s, valid_s, 0, 0) + pack_attr(a, nodeid)


def attr_out(nodeid: int, a: dict, valid_s: int) -> bytes:
    return ATTR_OUT.pack(valid_s, 0, 0) + pack_attr(a, nodeid)


DT = {"d": 4, "f": 8, "l": 10, "o": 0}


def dirent(ino: int, next_off: int, name: bytes, kind: str) -> bytes:
    raw = DIRENT.pack(ino, next_off, len(name), DT.get(kind, 0)) + name
    return raw + b"\0" * (-len(raw) % 8)
