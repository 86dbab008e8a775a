"""Minimal HTTP/1.1 framing for envd, sans-IO where it counts.

``parse_request_head`` and ``ChunkedDecoder`` are pure (bytes in, values out)
and fuzzed in tests; ``BodyReader`` and the ``write_*`` helpers only move bytes
between them and asyncio streams. envd serves plain HTTP/1.1 only: the E2B SDK
never speaks h2c to a plaintext origin.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator
from urllib.parse import parse_qsl, unquote

MAX_HEAD_BYTES = 64 * 1024
READ_SIZE = 256 * 1024

REASONS = {
    200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
    403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 406: "Not Acceptable",
    409: "Conflict", 411: "Length Required", 413: "Payload Too Large",
    415: "Unsupported Media Type", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
    499: "Client Closed Request", 500: "Internal Server Error", 501: "Not Implemented",
    503: "Service Unavailable", 504: "Gateway Timeout", 507: "Insufficient Storage",
}


class HttpError(Exception):
    """A request that cannot be parsed; answered with ``status`` and closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RequestHead:
    method: str
    path: str
    query: tuple[tuple[str, str], ...]
    version: str
    headers: tuple[tuple[str, str], ...]  # names lower-cased, order kept

    def header(self, name: str, default: str | None = None) -> str | None:
        """First value of a header (``name`` lower-case)."""
        for k, v in self.headers:
            if k == name:
                return v
        return default

    def query_value(self, name: str) -> str | None:
        for k, v in self.query:
            if k == name:
                return v
        return None

    @property
    def keep_alive(self) -> bool:
        conn = (self.header("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def parse_request_head(data: bytes) -> RequestHead:
    """Parse ``request-line CRLF *(header CRLF)`` (terminating CRLF optional)."""
    try:
        text = data.decode("latin-1")
    except UnicodeDecodeError:  # latin-1 decodes everything; kept for clarity
        raise HttpError(400, "undecodable request head") from None
    lines = text.split("\r\n")
    while lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise HttpError(400, "empty request")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not method or not set(method) <= _TOKEN_CHARS:
        raise HttpError(400, "malformed method")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505 if version.startswith("HTTP/") else 400, f"unsupported version {version!r}")
    if not target.startswith("/"):
        raise HttpError(400, "request target must be an absolute path")
    # Not urlsplit: "//x" is an absolute path here, not a network location.
    raw_path, _, raw_query = target.partition("?")
    raw_path = raw_path.partition("#")[0]
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name) <= _TOKEN_CHARS:
            raise HttpError(400, f"malformed header line {line[:40]!r}")
        headers.append((name.lower(), value.strip(" \t")))
    query = tuple(parse_qsl(raw_query.partition("#")[0], keep_blank_values=True))
    return RequestHead(method, unquote(raw_path), query, version, tuple(headers))


class ChunkedDecoder:
    """State machine for ``Transfer-Encoding: chunked`` bodies.

    ``feed`` returns the data bytes decoded so far; ``done`` turns true after
    the last-chunk and trailer section. Chunk extensions and trailers are
    accepted and ignored.
    """

    _SIZE, _DATA, _DATA_CRLF, _TRAILER, _DONE = range(5)

    def __init__(self) -> None:
        self._state = self._SIZE
        self._buf = bytearray()
        self._remaining = 0

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while True:
            if self._state == self._SIZE:
                idx = self._buf.find(b"\r\n")
                if idx < 0:
                    if len(self._buf) > 1024:
                        raise HttpError(400, "chunk size line too long")
                    return out
                line = bytes(self._buf[:idx]).split(b";", 1)[0].strip()
                del self._buf[: idx + 2]
                try:
                    if not line or not all(c in b"0123456789abcdefABCDEF" for c in line):
                        raise ValueError
                    self._remaining = int(line, 16)
                except ValueError:
                    raise HttpError(400, f"bad chunk size {line[:20]!r}") from None
                self._state = self._DATA if self._remaining else self._TRAILER
            elif self._state == self._DATA:
                if not self._buf:
                    return out
                take = min(self._remaining, len(self._buf))
                out.append(bytes(self._buf[:take]))
                del self._buf[:take]
                self._remaining -= take
                if self._remaining == 0:
                    self._state = self._DATA_CRLF
            elif self._state == self._DATA_CRLF:
                if len(self._buf) < 2:
                    return out
                if self._buf[:2] != b"\r\n":
                    raise HttpError(400, "missing CRLF after chunk data")
                del self._buf[:2]
                self._state = self._SIZE
            elif self._state == self._TRAILER:
                idx = self._buf.find(b"\r\n")
                if idx < 0:
                    if len(self._buf) > MAX_HEAD_BYTES:
                        raise HttpError(400, "trailer too long")
                    return out
                del self._buf[: idx + 2]
                if idx == 0:
                    self._state = self._DONE
            else:
                return out

    def leftover(self) -> bytes:
        """Bytes after the end of the body (a pipelined request)."""
        return bytes(self._buf) if self.done else b""


class BodyReader:
    """The request body as an async iterator of byte chunks (bounded reads)."""

    def __init__(self, reader: asyncio.StreamReader, head: RequestHead) -> None:
        self._reader = reader
        te = (head.header("transfer-encoding") or "").lower()
        cl = head.header("content-length")
        self._chunked: ChunkedDecoder | None = None
        self._remaining = 0
        if te:
            if te.split(",")[-1].strip() != "chunked":
                raise HttpError(400, f"unsupported transfer-encoding {te!r}")
            self._chunked = ChunkedDecoder()
        elif cl is not None:
            if not cl.isdigit():
                raise HttpError(400, "bad content-length")
            self._remaining = int(cl)
        self._pending: list[bytes] = []
        self.finished = self._chunked is None and self._remaining == 0

    async def read_chunk(self) -> bytes:
        """Next piece of body, or b"" at the end."""
        while True:
            if self._pending:
                return self._pending.pop(0)
            if self.finished:
                return b""
            if self._chunked is not None:
                data = await self._reader.read(READ_SIZE)
                if not data:
                    raise HttpError(400, "connection closed inside chunked body")
                self._pending = [p for p in self._chunked.feed(data) if p]
                if self._chunked.done:
                    self.finished = True
                    extra = self._chunked.leftover()
                    if extra:  # pipelining is not used by the SDK; refuse it loudly
                        raise HttpError(400, "pipelined requests are not supported")
            else:
                data = await self._reader.read(min(READ_SIZE, self._remaining))
                if not data:
                    raise HttpError(400, "connection closed inside body")
                self._remaining -= len(data)
                self.finished = self._remaining == 0
                return data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self.read_chunk()
            if not chunk:
                return
            yield chunk

    async def read_all(self, limit: int) -> bytes:
        buf = bytearray()
        async for chunk in self:
            buf += chunk
            if len(buf) > limit:
                raise HttpError(413, f"request body larger than {limit} bytes")
        return bytes(buf)

    async def drain(self, limit: int = 1 << 20) -> bool:
        """Discard what is left of the body; False when too much is left."""
        seen = 0
        async for chunk in self:
            seen += len(chunk)
            if seen > limit:
                return False
        return True


def format_head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def encode_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


LAST_CHUNK = b"0\r\n\r\n"
