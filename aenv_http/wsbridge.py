"""A WebSocket session carried across a proxy, message by message.

Used by the node's sandbox proxy (client ↔ guest port) and by the fleet gateway
(client ↔ node): the client's side is an accepted ``web.WebSocketResponse``, the
other side a client connection aiohttp opened. Frames keep their kind (text, binary,
ping, pong; autoping is off on both sides so pings reach the far end and are answered
there); a close or an error on either side closes both.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import web

# headers of the handshake that each hop makes anew (aiohttp writes its own)
HANDSHAKE_HEADERS = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                               "sec-websocket-protocol"})


def offered_protocols(request: web.BaseRequest) -> list[str]:
    """The subprotocols the client offered, to offer the same upstream."""
    return [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]


async def _pump(src: Any, dst: Any) -> None:
    async for msg in src:
        if msg.type == aiohttp.WSMsgType.TEXT:
            await dst.send_str(msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            await dst.send_bytes(msg.data)
        elif msg.type == aiohttp.WSMsgType.PING:
            await dst.ping(msg.data)
        elif msg.type == aiohttp.WSMsgType.PONG:
            await dst.pong(msg.data)
        else:
            break
    await dst.close()


async def bridge(down: web.WebSocketResponse, up: aiohttp.ClientWebSocketResponse) -> None:
    """Relay between ``down`` (prepared) and ``up`` until either side ends; closes both."""
    tasks = [asyncio.ensure_future(_pump(down, up)), asyncio.ensure_future(_pump(up, down))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        await up.close()
        await down.close()
