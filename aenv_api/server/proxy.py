"""Reverse proxy from the API port to sandbox ports.

Sandbox traffic is recognised by the ``E2b-Sandbox-Id`` header (port in
``E2b-Sandbox-Port``, default envd's 49983) or AgentENV's
``x-agentenv-sandbox-id`` / ``x-agentenv-target-port`` (its ``/proxy``
path prefix is taken off header-routed requests), by a host of the form
``<port>-<sandboxID>.<domain>`` when ``[server] domain`` is set, or, for a
signed file URL naming no sandbox (``/files?…&signature=…``, what the SDK
builds on ``E2B_SANDBOX_URL``), by the signature itself: it is made with one
secured sandbox's envd token. Everything else is control plane. (The recognition
itself is aenv_wire/routing.py's, shared with the fleet's gateway.)

Both directions stream: request bodies (chunked ones too) are forwarded as
they arrive, responses are written out piece by piece as they come from the
guest — a Connect stream frame or an SSE event is flushed to the client the
moment envd sends it. The upstream side is the small HTTP/1.1 client of
upstream.py (chunked answers pass through undecoded); WebSocket upgrades are
bridged message by message with aiohttp's client.

The proxy's cost is CPU in this process, mostly per send and per wake-up
(docs/benchmarks.md, "API"): whole bodies go upstream with their head in one
send, and envd's answers go back in as few sends as envd made pieces.

Security: for a ``secure`` sandbox the envd port requires its client token
(``X-Access-Token`` or a ``/files`` URL signed with it, checked here); the
request goes in with the guest's own token instead, which envd checks
(access_tokens.py: a token found in a clone's memory opens nothing); a sandbox created with
``allowPublicTraffic: false`` demands its traffic access token in
``e2b-traffic-access-token`` on every other port (checked before anything
else, so a request without it never resumes a paused sandbox), answered 403
as E2B's proxy does. The API key, the traffic token and the routing headers
are never forwarded into the sandbox. ``maskRequestHost`` sets the Host
header the guest sees; ``httpsPorts`` are reached over TLS (upstream.py).

Bounds (``ProxyLimits``, from ``[server]``; docs/security.md): a sandbox has at
most ``max_connections`` proxied requests and WebSocket sessions open at once
(beyond: 429 JSON, before anything is sent to it); the wait for its response head
(or its WebSocket handshake answer) ends after ``head_timeout`` seconds without it,
counted from the last byte of the request sent upstream (504 JSON); a WebSocket
message is at most ``websocket_max_message`` bytes either way (aenv_http/wsbridge.py).
A guest that never answers thus holds a bounded number of connections for a bounded
time, and none of another sandbox's.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from aenv_http.wsbridge import HANDSHAKE_HEADERS, MAX_MESSAGE, bridge, offered_protocols
from aenv_wire.errors import BadRoute
from aenv_wire.fleet_auth import NODE_AUTH_HEADER
from aenv_wire.headers import (ACCESS_TOKEN_HEADER, AGENTENV_ID_HEADER, AGENTENV_PORT_HEADER, API_KEY_HEADER,
                               SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER, TRAFFIC_TOKEN_HEADER)
from aenv_wire.routing import (FILES_PATH, PROXY_PREFIX, SandboxAddress, has_proxy_prefix, has_routing_header,
                               is_sdk_connect, sandbox_route)
from envd import ENVD_PORT, signing
from envd.signing import SignedRequest

from .access_tokens import upstream_headers
from .auth import check_token
from .errors import ApiError
from .lifecycle import Lifecycle
from .metrics import Metrics
from .scrub import NO_KEY, KeyScrub
from .settings import ServerConfig
from .upstream import MAX_HEAD, ChunkedBody, ResponseHead, UpstreamConn, UpstreamError, Upstreams, parse_response_head

log = logging.getLogger(__name__)

# Never forwarded: hop-by-hop headers (RFC 9110 7.6.1), the routing headers, the API key and
# the fleet gateway's node credential.
_DROP_REQUEST = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length", API_KEY_HEADER, SANDBOX_ID_HEADER,
    SANDBOX_PORT_HEADER, AGENTENV_ID_HEADER, AGENTENV_PORT_HEADER, TRAFFIC_TOKEN_HEADER, NODE_AUTH_HEADER))
_DROP_RESPONSE = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Trailer", "Transfer-Encoding", "Upgrade",
    "Content-Length", "Date", "Server"))
# Bodies up to this size are read whole and sent with a Content-Length (one write upstream).
_SMALL_BODY = 64 << 10
# How long a chunked request body may take to complete before it is relayed piece by piece.
_BODY_WAIT = 0.005


@dataclass(frozen=True)
class ProxyLimits:
    """What one sandbox may hold of the proxy ([server] proxy_*, websocket_max_message)."""
    head_timeout: float = 300.0             # seconds without the response head, after the request went up
    max_connections: int = 512              # proxied requests and WebSocket sessions open per sandbox
    websocket_max_message: int = MAX_MESSAGE

    @classmethod
    def of(cls, config: ServerConfig) -> "ProxyLimits":
        return cls(config.proxy_head_timeout, config.proxy_max_connections, config.websocket_max_message)


class _Stale(Exception):
    """A reused connection was closed by the sandbox before any answer."""


def forward_target(request: web.BaseRequest) -> str:
    """The request target sent into the sandbox: as the client sent it, but with
    AgentENV's ``/proxy`` prefix taken off a header-routed request (``/proxy`` alone is
    ``/``). Host-routed requests keep their path whole: a guest app may serve ``/proxy``."""
    raw = request.rel_url.raw_path_qs
    if has_routing_header(request.headers) and has_proxy_prefix(request.rel_url.raw_path):
        rest = raw[len(PROXY_PREFIX):]
        return rest if rest.startswith("/") else "/" + rest
    return raw


def _forward_path(request: web.BaseRequest) -> str:
    if has_routing_header(request.headers) and has_proxy_prefix(request.path):
        return request.path[len(PROXY_PREFIX):] or "/"
    return request.path


def signed_files(request: web.BaseRequest) -> SignedRequest | None:
    """The signature part of a ``/files`` request (None for any other path). ApiError 400
    on an expiry that is not a number, as envd answers."""
    if _forward_path(request) != FILES_PATH:
        return None
    try:
        return signing.parse(request.method, request.query)
    except signing.BadExpiration as e:
        raise ApiError(400, str(e)) from None


def route_of(request: web.BaseRequest, domain: str) -> SandboxAddress | None:
    """Where sandbox traffic goes, or None for control-plane requests (aenv_wire.routing).
    ApiError 400 on a bad port, and on a ``/proxy`` path (AgentENV's prefix) that names no
    sandbox."""
    if is_sdk_connect(request.method, request.path, request.headers):
        return None
    try:
        return sandbox_route(request.headers, request.host, request.path, domain, ENVD_PORT)
    except BadRoute as e:
        raise ApiError(400, str(e)) from None


class _RelayResponse(web.StreamResponse):
    """Headers go out with the first piece of the body: one send and one client wake-up
    instead of two (per-piece relaying is most of the proxy's cost, docs/benchmarks.md).
    Used for envd, whose streams start with an event at once; other guest ports and
    SSE answers send headers at once (a client may wait for them alone)."""

    _send_headers_immediately = False


class _PassThrough(_RelayResponse):
    """A chunked answer relayed as the very bytes the sandbox sent (its chunk framing
    included): aiohttp neither decodes nor re-encodes it. ``Transfer-Encoding:
    chunked`` is set by the proxy; the length check is off as for WebSockets."""

    def __init__(self, *, status: int, reason: str | None, immediate: bool) -> None:
        super().__init__(status=status, reason=reason)
        self._length_check = False
        self._send_headers_immediately = immediate


def _upstream_head(request: web.Request, host: str, framing: str, length: int | None,
                   headers: list[tuple[str, str]], scrub: KeyScrub = NO_KEY) -> bytes:
    """Request line and ``headers`` for the sandbox (``host``: its Host header): hop-by-hop
    headers, routing headers and credentials for the proxy dropped, the API key wherever
    it is (scrub.py; ``headers`` come scrubbed, the envd token translated:
    ``access_tokens.upstream_headers``); the body's framing as the proxy sends it."""
    lines = [f"{request.method} {scrub.target(forward_target(request))} HTTP/1.1", f"Host: {host}"]
    for k, v in headers:
        if k.lower() not in _DROP_REQUEST:
            lines.append(f"{k}: {v}")
    if framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


def _check_traffic_token(expected: str, request: web.Request, sid: str) -> None:
    """E2B's proxy answer when a sandbox created with ``allowPublicTraffic: false`` is asked
    without its token (403, its message, the sandbox id)."""
    given = request.headers.get(TRAFFIC_TOKEN_HEADER)
    if given is None:
        raise ApiError(403, f"Sandbox is secured with traffic access token. Token header "
                            f"'{TRAFFIC_TOKEN_HEADER}' is missing", sandboxId=sid)
    if not check_token(expected, given):
        raise ApiError(403, f"Sandbox is secured with traffic access token. Token header "
                            f"'{TRAFFIC_TOKEN_HEADER}' is invalid", sandboxId=sid)


class SandboxProxy:
    def __init__(self, lifecycle: Lifecycle, metrics: Metrics, limits: ProxyLimits = ProxyLimits(),
                 scrub: KeyScrub = NO_KEY) -> None:
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.limits = limits
        self.scrub = scrub
        self.open: Counter[str] = Counter()     # sandbox id → its proxied requests and sessions open
        self.upstreams = Upstreams()
        self._session: aiohttp.ClientSession | None = None   # WebSocket bridging only

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
                timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_connect=10.0, sock_read=None),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def close(self) -> None:
        self.upstreams.close()
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request, sid: str, port: int, rid: str = "") -> web.StreamResponse:
        """Forward ``request`` to ``sid``'s guest ``port``; the answer carries ``X-Request-Id: rid``.
        429 when the sandbox has ``max_connections`` open already."""
        if self.open[sid] >= self.limits.max_connections:
            self._refused("connections")
            raise ApiError(429, f"The sandbox {sid} has {self.open[sid]} proxied connections open, the most one "
                                f"sandbox may have ([server] proxy_max_connections): retry when some have ended",
                           sandboxId=sid, port=port, retry_after=1)
        self.open[sid] += 1
        try:
            return await self._handle(request, sid, port, rid)
        finally:
            self.open[sid] -= 1
            if not self.open[sid]:
                del self.open[sid]

    def _refused(self, reason: str) -> None:
        self.metrics.inc("aenv_proxy_refused_total", (("reason", reason),),
                         help="proxied requests refused by a bound (connections per sandbox, head timeout)")

    def _head_timeout(self, sid: str, port: int) -> ApiError:
        self._refused("head_timeout")
        return ApiError(504, f"The sandbox {sid} did not answer on port {port} within "
                             f"{self.limits.head_timeout:g} s ([server] proxy_head_timeout)", sandboxId=sid, port=port)

    async def _handle(self, request: web.Request, sid: str, port: int, rid: str) -> web.StreamResponse:
        t0 = time.monotonic()
        rules = await self.lifecycle.proxy_rules(sid)
        if rules.traffic_token and port != ENVD_PORT:
            _check_traffic_token(rules.traffic_token, request, sid)
        signed = signed_files(request) if port == ENVD_PORT else None
        given = request.headers.get(ACCESS_TOKEN_HEADER)
        host, host_port = await self.lifecycle.target(sid, port, given, signed)
        # the client's token (or signature) was checked for envd's port: the guest's goes in
        # its place; on other ports only a right client token is translated (access_tokens.py)
        sent = upstream_headers(self.scrub.headers(request.headers.items()), self.lifecycle.proxy_keys(sid),
                                given, checked=port == ENVD_PORT)
        tls = port in rules.https_ports
        host_header = rules.host_header(port) or f"{host}:{host_port}"
        if request.headers.get("Upgrade", "").lower() == "websocket":
            headers = [(k, v) for k, v in sent if k.lower() not in _DROP_REQUEST]
            if rules.mask_request_host is not None:
                headers.append(("Host", host_header))
            return await self._websocket(request, sid, port, f"{host}:{host_port}", headers, rid, tls)
        body: bytes | None = None
        streamed = False
        chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
        if request.body_exists:
            content = request.content

            def complete() -> bool:
                return content.is_eof() and content.total_bytes <= _SMALL_BODY
            if chunked and not complete():
                # A streamed body that is complete a moment later (the SDK's server-streaming
                # RPCs: head, one envelope, then the terminator, as separate writes) goes
                # upstream whole with its head and a Content-Length: one send instead of three.
                # Longer or slower streams are relayed as they come, after this one short wait.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_BODY_WAIT):  # no extra task, unlike wait_for
                        await content.wait_eof()
            small = not chunked and request.content_length is not None and request.content_length <= _SMALL_BODY
            if complete() or small:
                body = await request.read()
            else:
                streamed = True
        if streamed:
            framing = "length" if request.content_length is not None and not chunked else "chunked"
            head = _upstream_head(request, host_header, framing, request.content_length, sent, self.scrub)
        else:
            head = _upstream_head(request, host_header, "length" if body is not None else "none",
                                  len(body) if body is not None else None, sent, self.scrub)
        conn: UpstreamConn | None = None
        sender: asyncio.Future[None] | None = None
        try:
            for attempt in (0, 1):
                try:
                    conn, reused = await self.upstreams.acquire(host, host_port, tls)
                except (OSError, asyncio.TimeoutError) as e:
                    raise ApiError(502, f"The sandbox {sid} is running but port {port} is not open "
                                        f"({e.__class__.__name__})", sandboxId=sid, port=port) from None
                if streamed:
                    conn.write(head)
                    sender = asyncio.ensure_future(self._send_body(request, conn, framing == "chunked"))
                else:
                    conn.write(head + body if body else head)
                try:
                    resp_head, rest = await self._answer(conn, request.method, sender, sid, port)
                    break
                except _Stale:
                    # A kept-alive connection the sandbox had closed: nothing was answered, so
                    # the request (whole in memory) is sent once more on a fresh one.
                    conn.close()
                    conn = None
                    if not reused or streamed or attempt:
                        raise ApiError(502, f"The sandbox {sid} closed the connection to port {port} without "
                                            f"an answer", sandboxId=sid, port=port) from None
            assert conn is not None
            return await self._relay(request, conn, resp_head, rest, sender, sid, port, t0, rid)
        except HttpProcessingError:
            raise
        except (UpstreamError, ValueError, OSError) as e:
            bad_body = request.content.exception()
            if isinstance(bad_body, HttpProcessingError):  # the client's framing broke, not the sandbox: 400
                raise bad_body from None
            raise ApiError(502, f"The sandbox {sid} answered on port {port} with a broken response ({e})",
                           sandboxId=sid, port=port) from None
        finally:
            if sender is not None and not sender.done():
                sender.cancel()
                with contextlib.suppress(BaseException):
                    await sender
            if conn is not None and not conn.in_pool:
                if conn.closed:
                    conn.close()
                else:           # given up on mid-exchange: nothing more is owed to the sandbox
                    conn.abort()

    @staticmethod
    async def _send_body(request: web.Request, conn: UpstreamConn, chunk: bool) -> None:
        """Relay a request body that streams, piece by piece, as it arrives."""
        async for piece in request.content.iter_any():
            if piece:
                conn.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunk else piece)
                await conn.drain()
        if chunk:
            conn.write(b"0\r\n\r\n")

    async def _answer(self, conn: UpstreamConn, method: str, sender: asyncio.Future[None] | None,
                      sid: str, port: int) -> tuple[ResponseHead, bytes]:
        """The sandbox's response head; while a request body still streams, a failure to
        read that body (the client's framing broke: 400) ends the wait too. 504 after
        ``head_timeout`` without it and without a byte of the body going up meanwhile."""
        wait = self.limits.head_timeout
        if sender is None:
            try:
                async with asyncio.timeout(wait):   # no extra task, unlike wait_for
                    return await self._read_head(conn, method)
            except TimeoutError:
                raise self._head_timeout(sid, port) from None
        reading = asyncio.ensure_future(self._read_head(conn, method))
        try:
            sent = conn.written
            while not reading.done():
                pending = {reading} if sender.done() else {reading, sender}
                done, _ = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if reading.done():
                    break
                if sender in done:
                    if (failed := sender.exception()) is not None:
                        raise failed
                    continue        # the whole request is up: the wait for the head starts now
                if not done and (sender.done() or conn.written == sent):
                    raise self._head_timeout(sid, port)
                sent = conn.written     # the sandbox still takes the body: no answer is due yet
            return await reading
        finally:
            if not reading.done():
                reading.cancel()
                with contextlib.suppress(BaseException):
                    await reading

    @staticmethod
    async def _read_head(conn: UpstreamConn, method: str) -> tuple[ResponseHead, bytes]:
        buf = b""
        while True:
            data = await conn.read()
            if not data:
                if not buf:
                    raise _Stale()
                raise UpstreamError("the sandbox closed the connection inside a response head")
            buf += data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise UpstreamError(f"response head over {MAX_HEAD} bytes")
                continue
            head = parse_response_head(buf[:end], method)
            buf = buf[end + 4:]
            if 100 <= head.status < 200:  # interim answers (100 Continue): the final one follows
                continue
            return head, buf

    async def _relay(self, request: web.Request, conn: UpstreamConn, head: ResponseHead, piece: bytes,
                     sender: asyncio.Future[None] | None, sid: str, port: int, t0: float,
                     rid: str) -> web.StreamResponse:
        sse = head.get("Content-Type").startswith("text/event-stream")
        held = port == ENVD_PORT and not sse   # headers leave with the first piece of the body
        framing = head.framing
        raw = framing == "chunked" and request.version >= aiohttp.HttpVersion11
        resp: web.StreamResponse
        if raw:
            resp = _PassThrough(status=head.status, reason=head.reason, immediate=not held)
        else:
            resp = (_RelayResponse if held else web.StreamResponse)(status=head.status, reason=head.reason)
        for k, v in head.headers:
            if k.lower() not in _DROP_RESPONSE:
                resp.headers.add(k, v)
        if rid:
            resp.headers["X-Request-Id"] = rid
        if raw:
            resp.headers["Transfer-Encoding"] = "chunked"
        elif framing == "length" or (framing == "none" and (declared := head.get("Content-Length")).isascii()
                                        and declared.isdigit()):
            resp.content_length = head.length if framing == "length" else int(declared)
        elif framing in ("close", "chunked") and request.version >= aiohttp.HttpVersion11:
            resp.enable_chunked_encoding()
        tracker = ChunkedBody() if framing == "chunked" else None
        left = head.length
        done = ok = False
        await resp.prepare(request)
        try:
            while True:
                extra = b""
                if framing == "none":
                    out, done, extra = b"", True, piece
                elif tracker is not None:
                    used, payload = tracker.feed(piece)
                    out, done, extra = (piece[:used] if raw else payload), tracker.done, piece[used:]
                elif framing == "length":
                    take = min(left, len(piece))
                    out, extra = piece[:take], piece[take:]
                    left -= take
                    done = not left
                else:
                    out = piece
                if extra:
                    raise UpstreamError("the sandbox sent bytes after its response")
                if done:  # the last piece leaves with the end of the response: one send
                    await resp.write_eof(out)
                    break
                if out:
                    await resp.write(out)  # flushed now: a stream frame must not wait for the next one
                piece = await conn.read()
                if not piece:
                    if framing != "close":
                        raise UpstreamError("the sandbox closed the connection inside a response")
                    await resp.write_eof()
                    break
            ok = True
        except (UpstreamError, ValueError, ConnectionError) as e:
            # Headers are gone already: the only honest signal left is cutting the connection.
            log.info("request %s: proxy stream to %s:%d ended early: %s", rid, sid, port, e)
            resp.force_close()
            if request.transport is not None:
                request.transport.close()
        reusable = ok and done and head.keep_alive and (sender is None or sender.done())
        self.upstreams.release(conn, reusable)
        self.metrics.inc("aenv_proxy_requests_total", (("port", "envd" if port == ENVD_PORT else "other"),
                                                       ("outcome", "ok" if ok else "cut")),
                         help="requests forwarded to sandboxes")
        self.metrics.observe("aenv_proxy_response_start_seconds", time.monotonic() - t0,
                             help="time from request to the end of a proxied response")
        return resp

    async def _websocket(self, request: web.Request, sid: str, port: int, upstream: str,
                         headers: list[tuple[str, str]], rid: str, tls: bool) -> web.StreamResponse:
        fwd = [(k, v) for k, v in headers if k.lower() not in HANDSHAKE_HEADERS]
        protocols = offered_protocols(request)
        url = f"{'wss' if tls else 'ws'}://{upstream}{self.scrub.target(forward_target(request))}"
        cap = self.limits.websocket_max_message
        handshake = asyncio.timeout(self.limits.head_timeout)
        try:
            async with handshake:
                up = await self._client().ws_connect(url, headers=fwd, protocols=protocols, autoping=False,
                                                     max_msg_size=cap, ssl=False)  # ssl=False: TLS, unverified
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            if handshake.expired():
                raise self._head_timeout(sid, port) from None
            raise ApiError(502, f"The sandbox {sid} is running but port {port} is not open ({e})",
                           sandboxId=sid, port=port) from None
        down = web.WebSocketResponse(protocols=protocols, autoping=False, max_msg_size=cap)
        if rid:
            down.headers["X-Request-Id"] = rid
        await down.prepare(request)
        await bridge(down, up)
        self.metrics.inc("aenv_proxy_websockets_total", help="WebSocket sessions bridged to sandboxes")
        return down
