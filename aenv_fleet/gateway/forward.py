"""HTTP from the gateway to nodes: whole calls (control plane the gateway reads) and
streamed forwarding (everything it passes through: request and answer bodies move as
they arrive, so envd's Connect streams and file transfers flow frame by frame).

aiohttp's client (pinned, as the server's) with decompression off: bodies pass as they
are, under their own Content-Encoding. Hop-by-hop headers are not forwarded; the API
key and the sandbox routing headers are (the node checks and routes by them). Every
request to a node carries the gateway's node credential for exactly that request
(``X-Aenv-Node-Auth``, aenv_wire/fleet_auth.py; one a client sent is dropped): the
node's cluster routes take nothing else.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

import aiohttp
from aiohttp import web
from yarl import URL

from aenv_wire.fleet_auth import NODE_AUTH_HEADER, FleetKeys

from aenv_http.wsbridge import HANDSHAKE_HEADERS, MAX_MESSAGE, bridge, offered_protocols

_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    NODE_AUTH_HEADER))      # the gateway's own, made per request (a client's is never passed on)
_DROP_RESPONSE = _HOP | {"date", "server"}
_SMALL = 1 << 20


# The most of a node's answer the gateway reads whole (control-plane answers: lists,
# forks, metrics; sandbox traffic is streamed, never read whole)
MAX_ANSWER = 64 << 20


async def _read_bounded(r: aiohttp.ClientResponse, limit: int) -> bytes:
    """The answer's body; NodeFailed past ``limit`` bytes (read no further)."""
    parts, size = [], 0
    async for piece in r.content.iter_any():
        size += len(piece)
        if size > limit:
            raise NodeFailed(f"the node's answer is over {limit} bytes")
        parts.append(piece)
    return b"".join(parts)


class NodeUnreachable(Exception):
    """The node could not be connected to (nothing was sent: safe to try elsewhere)."""


class NodeRefused(Exception):
    """The node answered a WebSocket handshake with an HTTP status instead of 101."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message


class NodeFailed(Exception):
    """The connection to the node broke or timed out after the request was sent."""


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


def forwarded_headers(request: web.BaseRequest, extra: dict[str, str] | None = None,
                      drop: frozenset[str] = frozenset()) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in _HOP or lk in drop:
            continue
        out[k] = v if k not in out else out[k] + ", " + v
    out.update(extra or {})
    return out


class NodeClient:
    def __init__(self, timeout: float, fleet_keys: FleetKeys, websocket_max_message: int = MAX_MESSAGE,
                 node_tls: ssl.SSLContext | None = None) -> None:
        """``node_tls``: how nodes reached over https:// are checked (None: the system's CAs)."""
        self.node_tls = node_tls
        self.timeout = timeout
        self.fleet_keys = fleet_keys
        self.websocket_max_message = websocket_max_message    # bytes, either way (wsbridge.py)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30, force_close=False,
                                         ssl=self.node_tls if self.node_tls is not None else True)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def _signed(self, method: str, url: str, headers: dict[str, str] | None) -> dict[str, str]:
        """``headers`` plus this gateway's credential for ``method url`` (its request
        target as aiohttp sends it: yarl's encoded path and query)."""
        out = {k: v for k, v in (headers or {}).items() if k.lower() != NODE_AUTH_HEADER.lower()}
        out[NODE_AUTH_HEADER] = self.fleet_keys.request_credential(method, URL(url).raw_path_qs, time.time())
        return out

    async def call(self, method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                   timeout: float | None = None) -> Answer:
        assert self.session is not None
        try:
            async with self.session.request(method, url, data=body, headers=self._signed(method, url, headers),
                                            allow_redirects=False,
                                            timeout=aiohttp.ClientTimeout(total=timeout or self.timeout,
                                                                          sock_connect=5)) as r:
                data = await _read_bounded(r, MAX_ANSWER)
                return Answer(r.status, {k: v for k, v in r.headers.items()}, data)
        except aiohttp.ClientConnectorError as e:
            raise NodeUnreachable(str(e)) from None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise NodeFailed(f"{type(e).__name__}: {e}") from None

    async def answers(self, urls: Iterable[str], method: str, path_qs: str, headers: dict[str, str],
                      timeout: float | None = None) -> list[Answer]:
        """``method path_qs`` of every node at ``urls`` at once: the answers of those that
        answered (a node unreachable or failing is left out)."""
        async def one(url: str) -> Answer | None:
            try:
                return await self.call(method, url + path_qs, None, headers, timeout)
            except (NodeUnreachable, NodeFailed):
                return None
        return [a for a in await asyncio.gather(*(one(u) for u in urls)) if a is not None]

    async def call_json(self, method: str, url: str, payload: Any, headers: dict[str, str],
                        timeout: float | None = None) -> Answer:
        return await self.call(method, url, json.dumps(payload).encode(),
                               {**headers, "Content-Type": "application/json"}, timeout)

    async def forward(self, request: web.Request, url: str, headers: dict[str, str],
                      body: bytes | None = None) -> web.StreamResponse:
        """Send ``request`` to ``url`` and stream the answer back. ``body`` given: sent
        as it is (already read); else a small body is read whole and a larger or chunked
        one streams."""
        assert self.session is not None
        data: bytes | AsyncIterator[bytes] | None = body
        if body is None and request.body_exists:
            if request.content_length is not None and request.content_length <= _SMALL:
                data = await request.read()
            else:
                data = _stream(request)
        try:
            up = await self.session.request(request.method, url, data=data,
                                            headers=self._signed(request.method, url, headers), allow_redirects=False,
                                            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5,
                                                                          sock_read=self.timeout))
        except aiohttp.ClientConnectorError as e:
            raise NodeUnreachable(str(e)) from None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise NodeFailed(f"{type(e).__name__}: {e}") from None
        try:
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in _DROP_RESPONSE:
                    resp.headers.add(k, v)
            length = up.headers.get("Content-Length")
            if length is not None and "Transfer-Encoding" not in up.headers:
                resp.content_length = int(length)
            elif up.status not in (204, 304) and request.method != "HEAD":
                resp.enable_chunked_encoding()
            await resp.prepare(request)
            async for piece in up.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp
        except (aiohttp.ClientError, TimeoutError) as e:
            raise NodeFailed(f"{type(e).__name__}: {e}") from None
        finally:
            up.release()

    async def websocket(self, request: web.Request, url: str, headers: dict[str, str]) -> web.StreamResponse:
        """Carry a WebSocket session to ``url`` (the node, which carries it on to the guest
        port): the node's handshake is made first, so a refusal there (401, 403, 502 of a
        closed port) reaches the client as that HTTP answer, not as an accepted socket.
        The node's answer to the handshake is awaited ``timeout`` seconds at most (the node
        bounds its own wait on the guest: [server] proxy_head_timeout)."""
        assert self.session is not None
        fwd = {k: v for k, v in headers.items() if k.lower() not in HANDSHAKE_HEADERS}
        protocols = offered_protocols(request)
        cap = self.websocket_max_message
        try:
            async with asyncio.timeout(self.timeout):
                up = await self.session.ws_connect("ws" + url[len("http"):], headers=self._signed("GET", url, fwd),
                                                   protocols=protocols,
                                                   autoping=False, max_msg_size=cap,
                                                   timeout=aiohttp.ClientWSTimeout(ws_close=10.0))
        except aiohttp.WSServerHandshakeError as e:
            raise NodeRefused(e.status, e.message) from None
        except aiohttp.ClientConnectorError as e:
            raise NodeUnreachable(str(e)) from None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise NodeFailed(f"{type(e).__name__}: {e}") from None
        down = web.WebSocketResponse(protocols=protocols, autoping=False, max_msg_size=cap)
        await down.prepare(request)
        await bridge(down, up)
        return down


async def _stream(request: web.Request) -> AsyncIterator[bytes]:
    async for piece in request.content.iter_any():
        yield piece
