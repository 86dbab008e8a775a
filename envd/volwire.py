"""The volume channel's wire format (docs/volumes.md, "Mount"): sans-IO, shared by
envd (the guest's FUSE side, which sends requests) and the node (aenv_vm/volumes,
which answers them). Pure functions and one small decoder over bytes; the asyncio
code on both sides only moves bytes to and from them.

A frame is a 20-byte header, a JSON object ("meta") and raw bytes ("data")::

    magic "AV" | version u8 | kind u8 | id u32 | code u16 | flags u16 | meta_len u32 | data_len u32

all big-endian. ``kind`` 1 = request (``code`` is the operation), 2 = reply
(``code`` is 0 or a Linux errno). A reply carries the id of its request; ids are
the sender's to choose and replies may come in any order. JSON carries names as
str with Python's surrogate escapes for bytes that are not UTF-8 (``os.fsdecode``).
"""
from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"AV"
VERSION = 1
HEADER = struct.Struct(">2sBBIHHII")
HEADER_LEN = HEADER.size            # 20
MAX_META = 64 << 10                 # a path is at most 4 KiB; a directory listing is paged
MAX_DATA = 4 << 20                  # above the 1 MiB FUSE's largest read or write
UPGRADE_TOKEN = "aenv-volume/1"     # the HTTP Upgrade value that opens a channel
ENDPOINT = "/_aenv/volume"          # envd's path for it (node's token only)


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2


class Op(enum.IntEnum):
    STAT = 1        # {path} -> attr
    READDIR = 2     # {path, cookie, offset} -> {entries: [[name, type, ino]], more, cookie}: a page
                    # of at most MAX_META bytes; the next page starts at the cookie answered
                    # (a directory offset), or after ``offset`` entries when no cookie is sent
    MKDIR = 3       # {path, mode} -> attr
    UNLINK = 4      # {path}
    RMDIR = 5       # {path}
    RENAME = 6      # {path, to, flags}
    SYMLINK = 7     # {path, target} -> attr
    READLINK = 8    # {path} -> {target}
    CREATE = 9      # {path, mode, excl} -> attr
    OPEN = 10       # {path, write} -> attr (a regular file, the guest may open it)
    READ = 11       # {path, offset, size} -> data
    WRITE = 12      # {path, offset} + data -> {size}
    SETATTR = 13    # {path, mode?, size?, atime?, mtime?} -> attr (times: ns, or "now")
    STATFS = 14     # {} -> {blocks, bfree, bavail, files, ffree, bsize, namelen}
    FSYNC = 15      # {path}


class WireError(ValueError):
    """Bytes that are not a frame of this protocol version (the channel is closed)."""


class MetaError(WireError):
    """A well-framed request whose meta is not a JSON object: the stream is still in step,
    so the request is answered (EINVAL) by its id rather than the channel closed."""

    def __init__(self, message: str, frame_id: int) -> None:
        super().__init__(message)
        self.frame_id = frame_id


@dataclass(frozen=True)
class Frame:
    kind: Kind
    id: int
    code: int                       # an Op for requests, an errno (0 = success) for replies
    meta: dict[str, Any] = field(default_factory=dict)
    data: bytes = b""


def encode(frame: Frame) -> bytes:
    meta = json.dumps(frame.meta, separators=(",", ":")).encode() if frame.meta else b""
    if len(meta) > MAX_META or len(frame.data) > MAX_DATA:
        raise WireError(f"frame too large: meta {len(meta)} B, data {len(frame.data)} B")
    if not (0 <= frame.id < 1 << 32 and 0 <= frame.code < 1 << 16):
        raise WireError(f"id {frame.id} or code {frame.code} out of range")
    return HEADER.pack(MAGIC, VERSION, int(frame.kind), frame.id, frame.code, 0, len(meta),
                       len(frame.data)) + meta + frame.data


def request(rid: int, op: Op, meta: dict[str, Any] | None = None, data: bytes = b"") -> bytes:
    return encode(Frame(Kind.REQUEST, rid, int(op), meta or {}, data))


def reply(rid: int, errno: int = 0, meta: dict[str, Any] | None = None, data: bytes = b"") -> bytes:
    return encode(Frame(Kind.REPLY, rid, errno, meta or {}, data))


def _parse_header(buf: bytes | bytearray | memoryview) -> tuple[Kind, int, int, int, int]:
    magic, version, kind, rid, code, _flags, meta_len, data_len = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise WireError(f"unsupported volume channel version {version} (this side speaks {VERSION})")
    try:
        k = Kind(kind)
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None
    if meta_len > MAX_META or data_len > MAX_DATA:
        raise WireError(f"frame too large: meta {meta_len} B, data {data_len} B")
    return k, rid, code, meta_len, data_len


class FrameDecoder:
    """Bytes in (any split), whole frames out. A WireError leaves the decoder unusable."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[Frame]:
        self._buf += chunk
        out: list[Frame] = []
        while len(self._buf) >= HEADER_LEN:
            kind, rid, code, meta_len, data_len = _parse_header(self._buf)
            end = HEADER_LEN + meta_len + data_len
            if len(self._buf) < end:
                break
            raw_meta = bytes(self._buf[HEADER_LEN:HEADER_LEN + meta_len])
            data = bytes(self._buf[HEADER_LEN + meta_len:end])
            del self._buf[:end]
            out.append(Frame(kind, rid, code, _parse_meta(raw_meta), data))
        return out

    @property
    def pending(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._buf)


def peek_header(header: bytes) -> tuple[int, int, int]:
    """(id, meta_len, data_len) of a header whose magic, version and kind are right, its
    lengths unchecked: a reader that finds them over the bounds can skip the body and
    answer the id (E2BIG) instead of closing the channel. WireError otherwise."""
    magic, version, kind, rid, _code, _flags, meta_len, data_len = HEADER.unpack_from(header, 0)
    if magic != MAGIC or version != VERSION or kind not in (Kind.REQUEST, Kind.REPLY):
        raise WireError(f"not a frame header of version {VERSION}: {bytes(header[:4])!r}")
    return rid, meta_len, data_len


def header_lengths(header: bytes) -> tuple[int, int]:
    """(meta_len, data_len) of a frame header, validated (for readers that read exactly)."""
    _, _, _, meta_len, data_len = _parse_header(header)
    return meta_len, data_len


def decode_one(header: bytes, body: bytes) -> Frame:
    kind, rid, code, meta_len, data_len = _parse_header(header)
    if len(body) != meta_len + data_len:
        raise WireError("frame body of the wrong length")
    try:
        meta = _parse_meta(body[:meta_len])
    except WireError as e:
        raise MetaError(str(e), rid) from None
    return Frame(kind, rid, code, meta, body[meta_len:])


def _parse_meta(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:     # RecursionError: 64 KiB of nested brackets
        raise WireError(f"frame meta is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise WireError("frame meta is not a JSON object")
    return meta
