"""A small HTTP/1.1 server for the code interpreter: request heads and bodies parsed
from asyncio streams, JSON and text answers, chunked streaming answers.

The SDK speaks plain HTTP/1.1 to port 49999 (through aenv's proxy): one request per
connection at a time, ``Content-Length`` bodies (the proxy re-frames large ones as
chunked), and ``/execute`` answered as a chunked NDJSON stream. ``parse_head`` is pure;
``Connection`` only moves bytes."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import unquote

MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 1024 * 1024     # a cell's code; far beyond any real notebook cell

REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 409: "Conflict", 411: "Length Required", 413: "Payload Too Large",
           415: "Unsupported Media Type", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}


class HttpError(Exception):
    """Answered with ``status`` and a JSON body ``{"error": message}``."""

    def __init__(self, status: int, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]         # names lower-cased; a repeated header keeps the last value
    body: bytes
    keep_alive: bool

    def json(self) -> Any:
        if not self.body.strip():
            raise HttpError(400, "the request body is empty: a JSON object is expected")
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError) as e:
            raise HttpError(400, f"the request body is not valid JSON: {e}") from None


@dataclass(frozen=True)
class Head:
    method: str
    path: str
    version: str
    headers: dict[str, str]


def parse_head(data: bytes) -> Head:
    """Request line and headers (without the blank line). HttpError 400 on bad framing."""
    try:
        text = data.decode("latin-1")
    except UnicodeDecodeError:   # latin-1 decodes everything; kept for clarity
        raise HttpError(400, "undecodable request head", close=True) from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"malformed request line {lines[0][:80]!r}", close=True)
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"malformed header line {line[:80]!r}", close=True)
        headers[name.lower()] = value.strip()
    path = unquote(target.split("?", 1)[0])
    return Head(method.upper(), path, version, headers)


def format_head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


Handler = Callable[["Connection", Request], Awaitable[None]]


class Connection:
    """One client connection: reads requests, lets the handler answer each."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.answered = False

    async def read_request(self) -> Request | None:
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if e.partial.strip():
                raise HttpError(400, "the connection closed inside a request head", close=True) from None
            return None
        except asyncio.LimitOverrunError:
            raise HttpError(431, f"request head over {MAX_HEAD} bytes", close=True) from None
        head = parse_head(raw[:-4])
        body = await self._body(head.headers)
        conn_hdr = head.headers.get("connection", "").lower()
        keep = ("close" not in conn_hdr) if head.version == "HTTP/1.1" else ("keep-alive" in conn_hdr)
        return Request(head.method, head.path, head.headers, body, keep)

    async def _body(self, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out = bytearray()
            while True:
                line = await self.reader.readuntil(b"\r\n")
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise HttpError(400, "malformed chunk size", close=True) from None
                if size == 0:
                    while (await self.reader.readuntil(b"\r\n")) != b"\r\n":   # trailers
                        pass
                    return bytes(out)
                if len(out) + size > MAX_BODY:
                    raise HttpError(413, f"request body over {MAX_BODY} bytes", close=True)
                out += await self.reader.readexactly(size)
                if await self.reader.readexactly(2) != b"\r\n":
                    raise HttpError(400, "malformed chunk", close=True)
        raw = headers.get("content-length")
        if raw is None:
            return b""
        if not raw.isdigit():
            raise HttpError(400, f"bad Content-Length {raw[:20]!r}", close=True)
        if int(raw) > MAX_BODY:
            raise HttpError(413, f"request body over {MAX_BODY} bytes", close=True)
        try:
            return await self.reader.readexactly(int(raw))
        except asyncio.IncompleteReadError:
            raise HttpError(400, "the connection closed inside the request body", close=True) from None

    async def send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        self.answered = True
        headers = [("Content-Length", str(len(body)))]
        if body or status != 204:
            headers.insert(0, ("Content-Type", content_type))
        self.writer.write(format_head(status, headers) + body)
        await self.writer.drain()

    async def send_json(self, status: int, value: Any) -> None:
        await self.send(status, json.dumps(value).encode())

    async def send_error(self, status: int, message: str) -> None:
        await self.send_json(status, {"error": message, "code": status})

    async def stream(self, lines: AsyncIterator[bytes]) -> None:
        """A chunked 200 answer, one NDJSON line per chunk, flushed as each comes.
        ConnectionError when the client has gone (the caller stops the work)."""
        self.answered = True
        self.writer.write(format_head(200, [("Content-Type", "application/x-ndjson"),
                                            ("Transfer-Encoding", "chunked")]))
        async for line in lines:
            if self.writer.is_closing():
                raise ConnectionResetError("client went away")
            self.writer.write(b"%x\r\n%s\r\n" % (len(line), line))
            await self.writer.drain()
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()

    async def wait_closed_by_peer(self) -> None:
        """Returns when the client closes its side (EOF) or resets the connection. With
        one request in flight and no pipelining, anything the client sends now is the end."""
        try:
            while await self.reader.read(4096):
                pass
        except (ConnectionError, OSError):
            pass


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
    conn = Connection(reader, writer)
    try:
        while True:
            conn.answered = False
            try:
                req = await conn.read_request()
            except HttpError as e:
                await conn.send_error(e.status, e.message)
                return
            if req is None:
                return
            try:
                await handler(conn, req)
            except HttpError as e:
                if conn.answered:
                    return
                await conn.send_error(e.status, e.message)
                if e.close:
                    return
            if not req.keep_alive:
                return
    except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return
    finally:
        writer.close()
