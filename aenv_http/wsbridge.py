"""A WebSocket session carried across a proxy, message by message.

Used by the node's sandbox proxy (client ↔ guest port) and by the fleet gateway
(client ↔ node): the client's side is an accepted ``web.WebSocketResponse``, the
other side a client connection aiohttp opened. Frames keep their kind (text, binary,
ping, pong; autoping is off on both sides so pings reach the far end and are answered
there); a close or an error on either side closes both.

Messages are bounded: each side is opened with a ``max_msg_size`` (the node's and the
gateway's ``websocket_max_message``, default ``MAX_MESSAGE``), which aiohttp (≥ 3.11)
enforces from a frame's declared length before it buffers the payload, on the sum of a
fragmented message's frames, and on a compressed message as it inflates (it inflates
at most the bound plus one byte: a deflate bomb costs the bound, not its expansion).
A message beyond the bound is refused where it arrives (aiohttp closes that side with
1009, "message too big") and the bridge closes the other side with the same code and
the reason, so both ends learn why the session ended.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import web

# The default bound on one WebSocket message, in either direction: what a guest app's
# WebSocket carries (a terminal's output, a notebook's cell result with an image, a
# dev server's reload events) is far less; it bounds what one session holds (a message
# is relayed whole, so about twice this while it is passed on).
MAX_MESSAGE = 16 << 20
# Close codes one side's error is passed on with (1002 protocol error, 1007 bad data,
# 1009 too big); any other ends the other side with 1011 (internal error).
_PASSED_ON = frozenset({1002, 1007, 1009})

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
        elif msg.type == aiohttp.WSMsgType.ERROR:
            # aiohttp closed ``src`` with the error's code (1009 for a message beyond the
            # bound): the other side is told the same, with the reason
            code = src.close_code if src.close_code in _PASSED_ON else 1011
            await dst.close(code=code, message=f"the other side: {msg.data}".encode()[:123])
            return
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
