"""Reverse proxy from the API port to sandbox ports.

Sandbox traffic is recognised by the ``E2b-Sandbox-Id`` header (port in
``E2b-Sandbox-Port``, default envd's 49983) or by a host of the form
``<port>-<sandboxID>.<domain>`` when ``[server] domain`` is set. Everything
else is control plane.

Both directions stream: request bodies (chunked ones too) are forwarded as
they arrive, responses are written out chunk by chunk as they come from the
guest — a Connect stream frame or an SSE event is flushed to the client the
moment envd sends it. WebSocket upgrades are bridged message by message.

Security: for a ``secure`` sandbox the envd port requires its
``X-Access-Token`` (checked here, and by envd itself); the API key is never
forwarded into the sandbox, nor are the routing headers.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .auth import check_token
from .errors import ApiError
from .lifecycle import ENVD_PORT, Lifecycle
from .metrics import Metrics

log = logging.getLogger(__name__)

SANDBOX_ID_HEADER = "E2b-Sandbox-Id"
SANDBOX_PORT_HEADER = "E2b-Sandbox-Port"
# Never forwarded: hop-by-hop headers (RFC 9110 7.6.1), the routing headers and the API key.
_DROP_REQUEST = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "X-API-Key", SANDBOX_ID_HEADER,
    SANDBOX_PORT_HEADER))
_DROP_RESPONSE = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Trailer", "Transfer-Encoding", "Upgrade",
    "Content-Length", "Date", "Server"))
CONNECT_STREAM = "application/connect+json"
# Bodies up to this size are read whole and sent with a Content-Length (one write upstream).
_SMALL_BODY = 64 << 10
# How long a chunked request body may take to complete before it is relayed piece by piece.
_BODY_WAIT = 0.005


def parse_host(host: str, domain: str) -> tuple[str, int] | None:
    """``(sandbox id, port)`` of a ``<port>-<id>.<domain>[:p]`` host, else None."""
    if not domain or not host:
        return None
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    suffix = "." + domain.lower()
    if not name.lower().endswith(suffix):
        return None
    label = name[: -len(suffix)]
    port, sep, sid = label.partition("-")
    if not sep or not sid or "." in sid or not port.isdigit():
        return None
    return sid, int(port)


def route_of(request: web.Request, domain: str) -> tuple[str, int] | None:
    """Where sandbox traffic goes, or None for control-plane requests. ApiError 400 on a bad port."""
    sid = request.headers.get(SANDBOX_ID_HEADER)
    if sid is not None:
        raw = request.headers.get(SANDBOX_PORT_HEADER, str(ENVD_PORT))
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ApiError(400, f"{SANDBOX_PORT_HEADER} must be a port number, got {raw[:20]!r}")
        return sid.strip(), int(raw)
    return parse_host(request.host, domain)


class ConnectFrames:
    """Follows the Connect envelopes (``[flags u8][length u32 BE][payload]``) of a
    streamed response piece by piece, however pieces cut them, to tell when the
    end-of-stream frame (flags & 0x02) is complete. Sans-IO."""

    def __init__(self) -> None:
        self._head = b""        # bytes of an incomplete 5-byte frame header
        self._left = 0          # payload bytes of the current frame still to come
        self._end = False       # the current frame is the end-of-stream frame
        self.ended = False      # the end-of-stream frame is complete

    def feed(self, data: bytes) -> bool:
        pos = 0
        while pos < len(data) and not self.ended:
            if self._left:
                take = min(self._left, len(data) - pos)
                self._left -= take
                pos += take
            else:
                need = 5 - len(self._head)
                self._head += data[pos:pos + need]
                pos += min(need, len(data) - pos)
                if len(self._head) < 5:
                    break
                flags, self._left = struct.unpack(">BI", self._head)
                self._head = b""
                self._end = bool(flags & 0x02)
            if not self._left and self._end and not self._head:
                self.ended = True
        return self.ended


class _RelayResponse(web.StreamResponse):
    """Headers go out with the first piece of the body: one send and one client wake-up
    instead of two (per-piece relaying is most of the proxy's cost, docs/benchmarks.md).
    Used for envd, whose streams start with an event at once; other guest ports and
    SSE answers send headers at once (a client may wait for them alone)."""

    _send_headers_immediately = False


class SandboxProxy:
    def __init__(self, lifecycle: Lifecycle, metrics: Metrics) -> None:
        self.lifecycle = lifecycle
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
                # streams (process output, watchers) may be silent for as long as they like
                timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_connect=10.0, sock_read=None),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request, sid: str, port: int, rid: str = "") -> web.StreamResponse:
        """Forward ``request`` to ``sid``'s guest ``port``; the answer carries ``X-Request-Id: rid``."""
        t0 = time.monotonic()
        token, (host, host_port) = await self.lifecycle.target(sid, port)  # host: 127.0.0.1 or a tap netns
        if token and port == ENVD_PORT and not check_token(token, request.headers.get("X-Access-Token")):
            raise ApiError(401, "missing or invalid X-Access-Token for this sandbox")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST]
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request, sid, port, f"{host}:{host_port}", headers, rid)
        url = f"http://{host}:{host_port}{request.rel_url.raw_path_qs}"
        data: Any = None
        chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
        if request.body_exists:
            body = request.content

            def complete() -> bool:
                return body.is_eof() and body.total_bytes <= _SMALL_BODY
            if chunked and not complete():
                # A streamed body that is complete a moment later (the SDK's server-streaming
                # RPCs: head, one envelope, then the terminator, as separate writes) goes
                # upstream whole with a Content-Length: one send instead of three (each send
                # is most of the proxy's CPU, docs/benchmarks.md). Longer or slower streams
                # are relayed as they come, after at most this one short wait.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(body.wait_eof(), _BODY_WAIT)
            small = not chunked and request.content_length is not None and request.content_length <= _SMALL_BODY
            if complete() or small:
                data = await request.read()
            else:
                if request.content_length is not None and not chunked:
                    headers.append(("Content-Length", str(request.content_length)))
                data = request.content.iter_any()
        skip = {"Accept", "Accept-Encoding", "Content-Type"} - {k for k, _ in headers}
        try:
            upstream = await self._client().request(
                request.method, url, headers=headers, data=data, allow_redirects=False,
                skip_auto_headers=skip, compress=None, chunked=None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
            bad_body = request.content.exception()
            if isinstance(bad_body, HttpProcessingError):  # the client's framing broke, not the sandbox: 400
                raise bad_body from None
            raise ApiError(502, f"The sandbox {sid} is running but port {port} is not open ({e.__class__.__name__})",
                           sandboxId=sid, port=port) from None
        try:
            return await self._relay(request, upstream, sid, port, t0, rid)
        finally:
            upstream.release()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, sid: str, port: int,
                     t0: float, rid: str) -> web.StreamResponse:
        sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        cls = _RelayResponse if port == ENVD_PORT and not sse else web.StreamResponse
        resp = cls(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _DROP_RESPONSE:
                resp.headers.add(k, v)
        if rid:
            resp.headers["X-Request-Id"] = rid
        length = upstream.headers.get("Content-Length")
        chunked = "chunked" in upstream.headers.get("Transfer-Encoding", "").lower()
        if length is not None and length.isdigit() and not chunked:
            resp.content_length = int(length)
        elif request.method != "HEAD" and upstream.status not in (204, 304):
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        ok = True
        try:
            content = upstream.content
            frames = ConnectFrames() if upstream.headers.get("Content-Type") == CONNECT_STREAM else None
            while chunk := await content.readany():
                if content.at_eof():  # the last piece: one send with the end of the response
                    break
                if frames is not None and frames.feed(chunk):
                    # After a Connect end-of-stream frame only the end of the response can
                    # come (envd sends it at once): the two leave in one send.
                    chunk += await content.read()
                    break
                await resp.write(chunk)  # flushed now: a stream frame must not wait for the next one
            await resp.write_eof(chunk)
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
            # Headers are gone already: the only honest signal left is cutting the connection.
            ok = False
            log.info("request %s: proxy stream to %s:%d ended early: %s", rid, sid, port, e)
            resp.force_close()
            if request.transport is not None:
                request.transport.close()
        self.metrics.inc("aenv_proxy_requests_total", (("port", "envd" if port == ENVD_PORT else "other"),
                                                       ("outcome", "ok" if ok else "cut")),
                         help="requests forwarded to sandboxes")
        self.metrics.observe("aenv_proxy_response_start_seconds", time.monotonic() - t0,
                             help="time from request to the end of a proxied response")
        return resp

    async def _websocket(self, request: web.Request, sid: str, port: int, upstream: str,
                         headers: list[tuple[str, str]], rid: str) -> web.StreamResponse:
        skip = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol"}
        fwd = [(k, v) for k, v in headers if k.lower() not in skip]
        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        url = f"ws://{upstream}{request.rel_url.raw_path_qs}"
        try:
            up = await self._client().ws_connect(url, headers=fwd, protocols=protocols, autoping=False,
                                                 max_msg_size=0)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise ApiError(502, f"The sandbox {sid} is running but port {port} is not open ({e})",
                           sandboxId=sid, port=port) from None
        down = web.WebSocketResponse(protocols=protocols, autoping=False, max_msg_size=0)
        if rid:
            down.headers["X-Request-Id"] = rid
        await down.prepare(request)

        async def pump(src: Any, dst: Any) -> None:
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

        tasks = [asyncio.ensure_future(pump(down, up)), asyncio.ensure_future(pump(up, down))]
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
        self.metrics.inc("aenv_proxy_websockets_total", help="WebSocket sessions bridged to sandboxes")
        return down
