"""The proxy's HTTP/1.1 client to sandbox ports: parse heads, pass body bytes through.

Why not aiohttp's client: on this 2-core box the proxy's cost is CPU in the
server process, and aiohttp's client decodes every chunked response only for
aiohttp's server to encode it again, with a request object, a response
object, stream readers and several tasks per call (docs/benchmarks.md, "API").
Here a response head is parsed once, and a chunked body goes to the client as
the very bytes envd sent (``ChunkedBody`` only follows the framing to know
where the response ends); a request body is written with its head in one
send.

Sans-IO parts (``parse_response_head``, ``ChunkedBody``) are pure and fuzzed;
``UpstreamConn`` is an asyncio protocol that only buffers bytes; ``Upstreams``
keeps idle keep-alive connections per ``(host, port, tls)`` — the address
comes from ``Lifecycle.target`` (``Sandbox.endpoint``), nowhere else. A guest
port listed in a sandbox's ``network.httpsPorts`` is reached over TLS without
verifying its certificate (as E2B documents: self-signed ones work); the
client side of the proxy stays what it was.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import cast

MAX_HEAD = 64 << 10          # response head bytes at most
_READ_HIGH = 256 << 10       # buffered bytes at which reading from the sandbox pauses
_IDLE_KEEP = 30.0            # seconds an idle connection is kept
_IDLE_PER_TARGET = 16        # idle connections kept per (host, port)


class UpstreamError(Exception):
    """The sandbox side broke the exchange (closed, sent garbage)."""


@dataclass(frozen=True)
class ResponseHead:
    status: int
    reason: str
    headers: tuple[tuple[str, str], ...]
    framing: str        # "length" | "chunked" | "close" | "none"
    length: int         # body bytes for "length"
    keep_alive: bool    # the connection may carry another request afterwards

    def get(self, name: str, default: str = "") -> str:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return default


def parse_response_head(data: bytes, method: str) -> ResponseHead:
    """The head ``data`` (status line + headers, without the blank line). ValueError if malformed."""
    lines = data.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (parts[1].isdigit() and len(parts[1]) == 3):
        raise ValueError(f"bad status line {lines[0][:80]!r}")
    version, status = parts[0], int(parts[1])
    headers = []
    te = cl = conn = ""
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise ValueError(f"bad header line {line[:80]!r}")
        value = value.strip()
        low = name.lower()
        if low == "transfer-encoding":
            te = value.lower()
        elif low == "content-length":
            if cl and cl != value:
                raise ValueError("conflicting Content-Length headers")
            cl = value
        elif low == "connection":
            conn = value.lower()
        headers.append((name, value))
    keep = "close" not in conn if version == "HTTP/1.1" else "keep-alive" in conn
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return ResponseHead(status, parts[2] if len(parts) > 2 else "", tuple(headers), "none", 0, keep)
    if te:
        if te.split(",")[-1].strip() != "chunked":
            return ResponseHead(status, parts[2] if len(parts) > 2 else "", tuple(headers), "close", 0, False)
        return ResponseHead(status, parts[2] if len(parts) > 2 else "", tuple(headers), "chunked", 0, keep)
    if cl:
        if not cl.isdigit():
            raise ValueError(f"bad Content-Length {cl[:20]!r}")
        return ResponseHead(status, parts[2] if len(parts) > 2 else "", tuple(headers), "length", int(cl), keep)
    return ResponseHead(status, parts[2] if len(parts) > 2 else "", tuple(headers), "close", 0, False)


class ChunkedBody:
    """Follows chunked framing (RFC 9112 7.1) over pieces cut anywhere: ``feed``
    returns how many bytes of the piece belong to this body and the payload they
    carry; ``done`` once the last chunk and the trailer section are complete.
    ValueError on malformed framing. Sans-IO."""

    def __init__(self) -> None:
        self._line = bytearray()   # an incomplete size or trailer line
        self._left = 0             # payload bytes of the current chunk still to come
        self._crlf = 0             # bytes of the CRLF after a chunk's payload still to come
        self._trailers = False     # after the last chunk: reading trailer lines
        self.done = False

    def feed(self, data: bytes) -> tuple[int, bytes]:
        pos, n, out = 0, len(data), []
        while pos < n and not self.done:
            if self._left:
                take = min(self._left, n - pos)
                out.append(data[pos:pos + take])
                self._left -= take
                pos += take
                if not self._left:
                    self._crlf = 2
            elif self._crlf:
                want = b"\r\n"[2 - self._crlf:]
                got = data[pos:pos + len(want)]
                if not want.startswith(got):
                    raise ValueError("chunk data not followed by CRLF")
                self._crlf -= len(got)
                pos += len(got)
            else:
                end = data.find(b"\n", pos)
                if end < 0:
                    self._line += data[pos:]
                    if len(self._line) > 4096:
                        raise ValueError("chunk size or trailer line too long")
                    pos = n
                    break
                self._line += data[pos:end + 1]
                pos = end + 1
                line = bytes(self._line).rstrip(b"\r\n")
                self._line.clear()
                if self._trailers:
                    if not line:
                        self.done = True
                    continue
                size = line.split(b";", 1)[0].strip()
                if not size or any(c not in b"0123456789abcdefABCDEF" for c in size) or len(size) > 16:
                    raise ValueError(f"bad chunk size line {line[:40]!r}")
                self._left = int(size, 16)
                if not self._left:
                    self._trailers = True
        return pos, b"".join(out)


Target = tuple[str, int, bool]   # (host, port, over TLS)


def unverified_tls() -> ssl.SSLContext:
    """TLS to a guest's own server: encrypted, its certificate not checked (the guest is
    reached by an address only the node knows; E2B does the same for httpsPorts)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class UpstreamConn(asyncio.Protocol):
    """One connection to a sandbox port: bytes in a buffer, read with ``read``."""

    def __init__(self, key: Target) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None   # set while the sandbox is not reading
        self.closed = False
        self.in_pool = False
        self.idle_since = 0.0
        self.written = 0        # bytes written to the sandbox so far (the proxy's head wait watches it)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)     # a stream connection's

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > _READ_HIGH and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        w, self._drained = self._drained, None
        if w is not None and not w.done():
            w.set_result(None)

    async def drain(self) -> None:
        """Wait while the sandbox is not reading what was written (a streamed request body)."""
        if self._drained is not None:
            await asyncio.shield(self._drained)
        if self.closed:
            raise UpstreamError("connection to the sandbox is closed")

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def read(self) -> bytes:
        """What has arrived (waiting for something); b"" once the sandbox closed."""
        while not self._buf and not self.closed:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = bytes(self._buf)
        self._buf.clear()
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def write(self, data: bytes) -> None:
        if self.transport is None or self.closed:
            raise UpstreamError("connection to the sandbox is closed")
        self.transport.write(data)
        self.written += len(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close at once (a reset), whatever is still unsent: an exchange given up on (the
        sandbox did not answer, or never read the body). A plain close would first wait
        until the sandbox took every byte written, which one that never reads never does."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Upstreams:
    """Keep-alive connections to sandbox ports, per ``(host, port)``."""

    def __init__(self, connect_timeout: float = 10.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[Target, list[UpstreamConn]] = {}
        self._releases = 0
        self._tls: ssl.SSLContext | None = None

    async def acquire(self, host: str, port: int, tls: bool = False) -> tuple[UpstreamConn, bool]:
        """A connection (over TLS when ``tls``) and whether it was reused (a reused one may
        turn out closed)."""
        key = (host, port, tls)
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            conn.in_pool = False
            if not idle:
                del self._idle[key]
            if not conn.closed and now - conn.idle_since < _IDLE_KEEP and not conn._buf:
                return conn, True
            conn.close()
        loop = asyncio.get_running_loop()
        if tls and self._tls is None:
            self._tls = unverified_tls()
        _, conn = await asyncio.wait_for(loop.create_connection(lambda: UpstreamConn(key), host, port,
                                                                ssl=self._tls if tls else None),
                                         self.connect_timeout)
        return conn, False

    def release(self, conn: UpstreamConn, reusable: bool) -> None:
        if not reusable or conn.closed:
            conn.close()
            return
        idle = self._idle.setdefault(conn.key, [])
        now = time.monotonic()
        if len(idle) >= _IDLE_PER_TARGET:  # the oldest make room (they are the likeliest to be stale)
            idle[:] = [c for c in idle if not c.closed and now - c.idle_since < _IDLE_KEEP]
            while len(idle) >= _IDLE_PER_TARGET:
                idle.pop(0).close()
        conn.idle_since = now
        conn.in_pool = True
        idle.append(conn)
        self._releases += 1
        if not self._releases % 256:  # targets that went away (killed, paused) leave closed connections
            self.prune(now)

    def prune(self, now: float) -> None:
        for key, conns in list(self._idle.items()):
            keep = [c for c in conns if not c.closed and now - c.idle_since < _IDLE_KEEP]
            for c in conns:
                if c not in keep:
                    c.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
