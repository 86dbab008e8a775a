"""A streamed Connect answer of envd, decoded as it arrives (sans-IO).

A server-streaming response (``process.Process/Start``) is an HTTP body, chunked or
delimited by the connection's close, carrying ``[flags u8][length u32 BE][JSON]``
frames (docs/envd.md). The guest decides every length in it, so nothing here trusts
one: a frame longer than ``max_frame`` is refused from its 5-byte header, before any
of its bytes are kept, and a chunk's payload is passed on as it arrives, never
gathered whole (a chunk announcing 2^60 bytes costs nothing until they come). The
bytes held at any time are at most one frame header, ``max_frame`` and the piece
being fed. ``StreamError`` (a ``ValueError``) on anything malformed; the client
(envd_client.py) turns it into its ``EnvdError``.
"""
from __future__ import annotations

import json
import struct

# A Connect message the node accepts from envd: gRPC's default receive limit. envd's own
# data events carry at most 64 KiB of output (envd/process.py READ_CHUNK), ~88 KiB as
# base64 in JSON: 4 MiB is ~45 times that.
MAX_FRAME = 4 << 20
MAX_CHUNK_LINE = 4096       # a chunk-size or trailer line (RFC 9112 sets no bound: this one)
FRAME_HEADER = 5


class StreamError(ValueError):
    """The stream is malformed or beyond a bound."""


class ConnectStream:
    """Feed it the body bytes of a streamed answer as they come (``feed``); it returns the
    complete frames so far as ``(flags, message)``. ``chunked``: the body has HTTP/1.1
    chunked framing, and ``done`` turns true at its last chunk; else the body ends at the
    connection's close, which the caller says with ``finish``."""

    def __init__(self, chunked: bool, max_frame: int = MAX_FRAME) -> None:
        self.chunked = chunked
        self.max_frame = max_frame
        self.done = False
        self._frames = bytearray()      # frame bytes not yet a whole frame
        self._line = bytearray()        # an incomplete chunk-size or trailer line
        self._chunk_left = 0            # payload bytes of the current chunk still to come
        self._crlf_left = 0             # bytes of the CRLF closing a chunk's payload still to come
        self._trailers = False          # after the last chunk: reading trailer lines

    @property
    def buffered(self) -> int:
        """Bytes held between calls (an incomplete frame, an incomplete chunk line)."""
        return len(self._frames) + len(self._line)

    def feed(self, data: bytes) -> list[tuple[int, dict]]:
        if self.done:
            if data:
                raise StreamError("bytes after the end of the stream")
            return []
        if self.chunked:
            for payload in self._dechunk(data):
                self._frames += payload
        else:
            self._frames += data
        frames = self._take()
        if self.done and self._frames:
            raise StreamError(f"the stream ended inside a frame ({len(self._frames)} bytes of it)")
        return frames

    def finish(self) -> None:
        """The connection closed: StreamError if that was inside a chunk or a frame."""
        if self.chunked and not self.done:
            raise StreamError("the stream ended inside its chunked framing")
        if self._frames:
            raise StreamError(f"the stream ended inside a frame ({len(self._frames)} bytes of it)")

    def _take(self) -> list[tuple[int, dict]]:
        """The whole frames buffered; the next one's header, once there, is checked at
        once (its payload would otherwise be kept until it is whole)."""
        out: list[tuple[int, dict]] = []
        pos = 0
        buf = self._frames
        while len(buf) - pos >= FRAME_HEADER:
            flags, length = struct.unpack_from(">BI", buf, pos)
            if length > self.max_frame:
                raise StreamError(f"a Connect frame of {length} bytes (at most {self.max_frame})")
            if len(buf) - pos - FRAME_HEADER < length:
                break
            start = pos + FRAME_HEADER
            try:
                msg = json.loads(bytes(buf[start:start + length]) or b"{}")
            except ValueError as e:
                raise StreamError(f"bad JSON in a Connect frame: {e}") from None
            out.append((flags, msg if isinstance(msg, dict) else {}))
            pos = start + length
        del buf[:pos]
        return out

    def _dechunk(self, data: bytes) -> list[bytes]:
        """The payload pieces in ``data`` (RFC 9112 7.1, trailers read and dropped)."""
        out: list[bytes] = []
        pos, n = 0, len(data)
        while pos < n and not self.done:
            if self._chunk_left:
                take = min(self._chunk_left, n - pos)
                out.append(data[pos:pos + take])
                self._chunk_left -= take
                pos += take
                if not self._chunk_left:
                    self._crlf_left = 2
            elif self._crlf_left:
                want = b"\r\n"[2 - self._crlf_left:]
                got = data[pos:pos + len(want)]
                if not want.startswith(got):
                    raise StreamError("chunk data not followed by CRLF")
                self._crlf_left -= len(got)
                pos += len(got)
            else:
                end = data.find(b"\n", pos)
                if end < 0:
                    self._line += data[pos:]
                    pos = n
                    if len(self._line) > MAX_CHUNK_LINE:
                        raise StreamError(f"a chunk-size or trailer line over {MAX_CHUNK_LINE} bytes")
                    break
                self._line += data[pos:end + 1]
                pos = end + 1
                if len(self._line) > MAX_CHUNK_LINE:
                    raise StreamError(f"a chunk-size or trailer line over {MAX_CHUNK_LINE} bytes")
                line = bytes(self._line).rstrip(b"\r\n")
                self._line.clear()
                if self._trailers:
                    self.done = not line
                    continue
                size = line.split(b";", 1)[0].strip()
                if not size or len(size) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in size):
                    raise StreamError(f"bad chunk size line {line[:40]!r}")
                self._chunk_left = int(size, 16)
                self._trailers = not self._chunk_left
        if self.done and pos < n:
            raise StreamError("bytes after the end of the stream")
        return out
