"""The chunk protocol spoken on ALPN ``aenv/chunks/1`` (sans-IO: bytes in,
events out; node.py moves the bytes). Spec: docs/remote.md, "P2P protocol".

One request per QUIC bidirectional stream. The client writes a request and
finishes its send side; the server answers and finishes.

Request::

    4   magic "AEP1"
    1   op: 1 = GET (send the chunks), 2 = HAVE (which of these do you hold?)
    1   flags = 0
    2   count n (u16 BE, 1..MAX_IDS)
    32n chunk ids (BLAKE3 of the plaintext)

GET response: n frames, in request order::

    1   status: 0 = OK, 1 = MISSING (not committed here), 2 = ERROR
    4   length L (u32 BE; 0 unless OK; <= MAX_CHUNK)
    L   plaintext

HAVE response: ceil(n/8) bytes, bit i (LSB first) set = the server holds id i.

The receiver checks every OK payload against the id it asked for; a payload
that does not hash to its id is ``BadData`` (the peer is then dropped)."""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import blake3

from ..errors import CorruptData
from ..formats.ids import DIGEST_SIZE, Digest

ALPN = b"aenv/chunks/1"
MAGIC = b"AEP1"
MAX_IDS = 4096
MAX_CHUNK = 4 * 1024 * 1024
_REQ_HEAD = struct.Struct(">4sBBH")
_FRAME_HEAD = struct.Struct(">BI")
FRAME_HEAD_SIZE = _FRAME_HEAD.size


class ProtocolError(ValueError):
    """The peer sent something that is not this protocol."""


class BadData(CorruptData):
    """A peer's payload does not hash to the id it was sent for."""


class Op(enum.IntEnum):
    GET = 1
    HAVE = 2


class Status(enum.IntEnum):
    OK = 0
    MISSING = 1
    ERROR = 2


@dataclass(frozen=True)
class Request:
    op: Op
    ids: tuple[Digest, ...]


@dataclass(frozen=True)
class Frame:
    chunk: Digest
    status: Status
    data: bytes = b""


def encode_request(op: Op, ids: list[Digest] | tuple[Digest, ...]) -> bytes:
    if not 1 <= len(ids) <= MAX_IDS:
        raise ValueError(f"a request carries 1..{MAX_IDS} ids, got {len(ids)}")
    return _REQ_HEAD.pack(MAGIC, int(op), 0, len(ids)) + b"".join(bytes(i) for i in ids)


def request_size(count: int) -> int:
    return _REQ_HEAD.size + DIGEST_SIZE * count


def decode_request(data: bytes) -> Request:
    """Parse a whole request (the server reads the stream to its end first)."""
    if len(data) < _REQ_HEAD.size:
        raise ProtocolError(f"request too short ({len(data)} bytes)")
    magic, op, flags, count = _REQ_HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    try:
        op_ = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    if flags != 0:
        raise ProtocolError(f"unknown flags {flags:#x}")
    if not 1 <= count <= MAX_IDS:
        raise ProtocolError(f"id count {count} outside 1..{MAX_IDS}")
    if len(data) != request_size(count):
        raise ProtocolError(f"request of {count} ids has {len(data)} bytes, want {request_size(count)}")
    ids = tuple(Digest(data[_REQ_HEAD.size + DIGEST_SIZE * i:_REQ_HEAD.size + DIGEST_SIZE * (i + 1)])
                for i in range(count))
    return Request(op_, ids)


def encode_frame_head(status: Status, length: int) -> bytes:
    if status != Status.OK and length:
        raise ValueError("only OK frames carry data")
    if length > MAX_CHUNK:
        raise ValueError(f"chunk of {length} bytes exceeds {MAX_CHUNK}")
    return _FRAME_HEAD.pack(int(status), length)


def encode_frame(status: Status, data: bytes = b"") -> bytes:
    return encode_frame_head(status, len(data)) + data


def encode_have(flags: list[bool]) -> bytes:
    out = bytearray((len(flags) + 7) // 8)
    for i, f in enumerate(flags):
        if f:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def decode_have(data: bytes, count: int) -> list[bool]:
    if len(data) != (count + 7) // 8:
        raise ProtocolError(f"HAVE answer for {count} ids has {len(data)} bytes")
    return [bool(data[i // 8] >> (i % 8) & 1) for i in range(count)]


class GetResponseParser:
    """Incremental parser of a GET response. ``feed`` returns the frames that
    became complete; OK payloads are verified against the requested id."""

    def __init__(self, ids: list[Digest] | tuple[Digest, ...], verify: bool = True) -> None:
        self.ids = tuple(ids)
        self.verify = verify
        self._buf = bytearray()
        self._next = 0
        self._head: tuple[Status, int] | None = None

    @property
    def done(self) -> bool:
        return self._next == len(self.ids)

    @property
    def started(self) -> bool:
        """True once any byte of the answer arrived."""
        return self._next > 0 or bool(self._buf) or self._head is not None

    def feed(self, data: bytes) -> list[Frame]:
        if data and self.done:
            raise ProtocolError("data after the last frame")
        self._buf += data
        out: list[Frame] = []
        while not self.done:
            if self._head is None:
                if len(self._buf) < FRAME_HEAD_SIZE:
                    break
                st, length = _FRAME_HEAD.unpack_from(self._buf)
                try:
                    status = Status(st)
                except ValueError:
                    raise ProtocolError(f"unknown frame status {st}") from None
                if length > MAX_CHUNK or (status != Status.OK and length):
                    raise ProtocolError(f"bad frame length {length} for status {status.name}")
                del self._buf[:FRAME_HEAD_SIZE]
                self._head = (status, length)
            status, length = self._head
            if len(self._buf) < length:
                break
            with memoryview(self._buf) as view:  # one copy out of the buffer, not two
                payload = bytes(view[:length])
            del self._buf[:length]
            self._head = None
            cid = self.ids[self._next]
            self._next += 1
            if status == Status.OK and self.verify and blake3.blake3(payload).digest() != cid:
                raise BadData(f"peer sent {length} bytes for chunk {cid.hex()} that do not match its id")
            out.append(Frame(cid, status, payload))
        if self.done and self._buf:
            raise ProtocolError("data after the last frame")
        return out

    def finish(self) -> None:
        """The stream ended: it must have ended exactly after the last frame."""
        if not self.done:
            raise ProtocolError(f"stream ended after {self._next} of {len(self.ids)} frames")
