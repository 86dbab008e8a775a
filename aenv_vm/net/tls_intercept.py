"""The egress proxy's TLS termination toward a guest, for a connection to a host its
``network.rules`` name (egress.py decides which): the proxy has already read the
guest's ClientHello (to learn its SNI), so the server side runs over memory BIOs fed
with those bytes first, then with what the guest sends. Bounded: the BIOs hold at
most one read of ``CHUNK`` bytes beyond what the TLS object consumed; a handshake or
request head that does not arrive within the caller's timeout ends the connection.

``intercept`` then: the first request's head (``MAX_HEAD``), rewritten by
secret_relay.py, goes to the real server over a TLS connection that verifies it
(``EgressCa.upstream``, the name the guest asked for); the rest streams both ways.
"""
from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Callable

from .secret_relay import MAX_HEAD, Rewrite, split_head

CHUNK = 16 << 10


class TlsServerStream:
    """The server side of TLS over a guest's (reader, writer)."""

    def __init__(self, ctx: ssl.SSLContext, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 first: bytes) -> None:
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._out, server_side=True)
        self._reader, self._writer = reader, writer
        self._in.write(first)

    async def _flush(self) -> None:
        data = self._out.read()
        if data:
            self._writer.write(data)
            await self._writer.drain()

    async def _fill(self) -> bool:
        data = await self._reader.read(CHUNK)
        if not data:
            self._in.write_eof()
            return False
        self._in.write(data)
        return True

    async def handshake(self) -> None:
        """ssl.SSLError / ConnectionError when the guest does not complete it (it may not
        trust the CA: then it aborts, and nothing was sent anywhere)."""
        while True:
            try:
                self._obj.do_handshake()
                await self._flush()
                return
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionError("the guest closed during the TLS handshake") from None

    async def read(self, n: int = CHUNK) -> bytes:
        """Up to ``n`` decrypted bytes; b"" at the end."""
        while True:
            try:
                return self._obj.read(n)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    return b""
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def write(self, data: bytes) -> None:
        self._obj.write(data)
        await self._flush()

    async def close(self) -> None:
        with contextlib.suppress(ssl.SSLError, OSError, ConnectionError):
            self._obj.unwrap()
        with contextlib.suppress(OSError, ConnectionError):
            await self._flush()


async def read_head(guest: TlsServerStream) -> bytes:
    """What the guest sent up to and including its first request head (b"" if none within
    ``MAX_HEAD`` bytes)."""
    data = b""
    while split_head(data) is None:
        if len(data) > MAX_HEAD:
            return b""
        more = await guest.read()
        if not more:
            return b""
        data += more
    return data


async def relay(guest: TlsServerStream, up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter,
                first: Rewrite) -> None:
    """The rewritten head to the server, then both directions until either ends."""
    up_writer.write(first.head + first.rest)
    await up_writer.drain()

    async def out() -> None:
        with contextlib.suppress(OSError, ConnectionError, ssl.SSLError):
            while data := await guest.read():
                up_writer.write(data)
                await up_writer.drain()
            if up_writer.can_write_eof():
                up_writer.write_eof()

    async def back() -> None:
        with contextlib.suppress(OSError, ConnectionError, ssl.SSLError):
            while data := await up_reader.read(CHUNK):
                await guest.write(data)
        await guest.close()

    tasks = [asyncio.ensure_future(out()), asyncio.ensure_future(back())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        done_back = tasks[1].done()
        if not done_back:       # the guest finished sending: the server's answer still comes
            await tasks[1]
    finally:
        for t in tasks:
            t.cancel()


async def intercept(ctx: ssl.SSLContext, upstream_ctx: ssl.SSLContext, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, hello: bytes, name: str, host: str, port: int,
                    rewrite: Callable[[bytes], Rewrite], timeout: float, connect_timeout: float,
                    limit: int) -> str:
    """Terminate the guest's TLS (``hello``: its bytes so far), rewrite its first request,
    relay it to ``host:port`` over TLS verified for ``name``. "" when relayed, else why not."""
    guest = TlsServerStream(ctx, reader, writer, hello)
    try:
        async with asyncio.timeout(timeout):
            await guest.handshake()
            data = await read_head(guest)
    except (ssl.SSLError, ConnectionError, OSError, asyncio.TimeoutError) as e:
        return f"TLS with the guest failed (no handshake or request head in {timeout:.0f} s): {e!r}"
    if not data:
        return "no complete request head"
    rw = rewrite(data)
    if rw.refused:
        return rw.refused
    try:
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(
            host, port, ssl=upstream_ctx, server_hostname=name, limit=limit), connect_timeout)
    except (ssl.SSLError, OSError, asyncio.TimeoutError) as e:
        await guest.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await guest.close()
        return f"the server {name} was not reached or not verified: {e}"
    try:
        await relay(guest, up_reader, up_writer, rw)
    finally:
        up_writer.close()
    return ""
