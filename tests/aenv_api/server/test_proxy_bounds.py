"""The sandbox proxy's bounds (proxy.py ``ProxyLimits``, aenv_http/wsbridge.py) on the real
API over the fake service (inprocess.py), its stub guest given routes that misbehave: a
response head that never comes (504 after ``proxy_head_timeout``), a body the guest
never takes, more connections than ``proxy_max_connections`` (429, another sandbox
unaffected), and WebSocket messages beyond ``websocket_max_message`` in both
directions: plain, endless (a frame header naming 2^62 bytes) and deflate bombs. The
same offences from a real guest under QEMU: hostile/test_websocket.py."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from .inprocess import InProcessServer

HEAD_TIMEOUT = 1.0
MAX_CONNECTIONS = 3
CAP = 1 << 20               # websocket_max_message here
GUEST_PORT = 8080           # any port but envd's: no token needed (allowPublicTraffic)


class Guest:
    """Routes of the stub guest, and what it received."""

    def __init__(self) -> None:
        self.ws_received: list[int] = []      # sizes of the WebSocket messages that reached the guest
        self.body_bytes = 0

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/hang", self.hang)
        app.router.add_post("/hang", self.hang)
        app.router.add_post("/read", self.read)
        app.router.add_get("/ws", self.ws)

    async def hang(self, request: web.Request) -> web.StreamResponse:
        """Never answers, never reads a body; ends when the proxy gives up the connection
        (or after 10 s: a handler that does not read its body is not told of a reset)."""
        for _ in range(200):
            if request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(0.05)
        return web.Response(status=500)

    async def read(self, request: web.Request) -> web.StreamResponse:
        async for piece in request.content.iter_any():
            self.body_bytes += len(piece)
        return web.json_response({"bytes": self.body_bytes})

    async def ws(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=0)      # the guest takes anything: the proxy is the bound
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                self.ws_received.append(len(msg.data))
                await ws.send_str(f"got {len(msg.data)}")
            elif msg.type == aiohttp.WSMsgType.TEXT:
                self.ws_received.append(len(msg.data))
                verb, _, arg = msg.data.partition(":")
                transport = request.transport
                assert transport is not None
                if verb == "send":
                    await ws.send_bytes(b"g" * int(arg))
                elif verb == "endless":     # a frame header naming 2^62 bytes, then zeros until cut
                    transport.write(b"\x82\x7f" + struct.pack(">Q", 1 << 62))
                    for _ in range(4096):
                        if transport.is_closing():
                            break
                        transport.write(bytes(65536))
                        await asyncio.sleep(0)
                        await asyncio.sleep(0.001) if transport.get_write_buffer_size() > 1 << 20 else None
                elif verb == "bomb":        # a compressed frame (RSV1) though nothing was negotiated
                    z = zlib.compressobj(9, zlib.DEFLATED, -15)
                    data = z.compress(bytes(64 << 20)) + z.flush(zlib.Z_SYNC_FLUSH)
                    transport.write(b"\xc2\x7f" + struct.pack(">Q", len(data) - 4) + data[:-4])
                else:
                    await ws.send_str("echo:" + msg.data)
        return ws


@pytest.fixture(scope="module")
def guest() -> Guest:
    return Guest()


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory, guest: Guest) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("api-bounds"), guest_routes=guest.routes,
                                server={"proxy_head_timeout": HEAD_TIMEOUT, "proxy_max_connections": MAX_CONNECTIONS,
                                        "websocket_max_message": CAP})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def sid(bounded: InProcessServer) -> Iterator[str]:
    status, _, body = bounded.request("POST", "/sandboxes", {"templateID": "base"})
    assert status == 201, body
    try:
        yield body["sandboxID"]
    finally:
        bounded.kill_all()


def routed(sid: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(GUEST_PORT)}


def metric(srv: InProcessServer, line: str) -> float:
    _, _, text = srv.request("GET", "/metrics")
    for row in text.decode().splitlines():
        if row.startswith(line):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def test_a_head_that_never_comes_is_504_after_the_timeout(bounded: InProcessServer, sid: str) -> None:
    t0 = time.monotonic()
    status, _, body = bounded.request("GET", "/hang", headers=routed(sid), key=None)
    waited = time.monotonic() - t0
    assert status == 504 and body["code"] == 504, body
    assert f"did not answer on port {GUEST_PORT} within 1 s" in body["message"] and body["sandboxId"] == sid
    assert HEAD_TIMEOUT <= waited < HEAD_TIMEOUT + 2
    assert metric(bounded, 'aenv_proxy_refused_total{reason="head_timeout"}') >= 1


def test_the_head_wait_counts_from_the_last_byte_of_the_body(bounded: InProcessServer, sid: str,
                                                             guest: Guest) -> None:
    """A body that trickles for 3 × the timeout, taken by the guest as it comes, is not
    cut; a body the guest never takes is cut once nothing more goes up (504)."""
    async def trickle(pieces: int, pause: float) -> AsyncIterator[bytes]:
        for _ in range(pieces):
            yield bytes(1 << 16)
            await asyncio.sleep(pause)

    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            guest.body_bytes = 0
            async with s.post(bounded.url + "/read", data=trickle(10, 0.3), headers=routed(sid)) as r:
                assert r.status == 200 and (await r.json())["bytes"] == 10 << 16
            t0 = time.monotonic()
            async with s.post(bounded.url + "/hang", data=trickle(4096, 0), headers=routed(sid)) as r:
                body = await r.json()
                assert r.status == 504 and "did not answer" in body["message"], body
            assert time.monotonic() - t0 < HEAD_TIMEOUT + 5
    asyncio.run(run())


def test_connections_beyond_the_cap_are_429_and_other_sandboxes_are_untouched(bounded: InProcessServer,
                                                                              sid: str) -> None:
    status, _, other = bounded.request("POST", "/sandboxes", {"templateID": "base"})
    assert status == 201

    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            async def get(path: str, who: str) -> tuple[int, Any, float]:
                t0 = time.monotonic()
                async with s.get(bounded.url + path, headers=routed(who)) as r:
                    assert r.status != 429 or r.headers["Retry-After"] == "1"
                    return r.status, await r.json(), time.monotonic() - t0
            held = [asyncio.ensure_future(get("/hang", sid)) for _ in range(MAX_CONNECTIONS)]
            await asyncio.sleep(0.3)
            status, body, took = await get("/echo", sid)
            assert status == 429 and body["code"] == 429 and "proxy_max_connections" in body["message"], body
            assert took < 0.5 and body["sandboxId"] == sid
            status, _, _ = await get("/echo", other["sandboxID"])     # another sandbox: its own count
            assert status == 200
            assert [r[0] for r in await asyncio.gather(*held)] == [504] * MAX_CONNECTIONS
            status, _, _ = await get("/echo", sid)                      # the slots are free again
            assert status == 200
    asyncio.run(run())
    assert metric(bounded, 'aenv_proxy_refused_total{reason="connections"}') >= 1


# -- WebSocket messages ----------------------------------------------------------------

async def _session(srv: InProcessServer, sid: str, **kw: Any) -> tuple[aiohttp.ClientSession,
                                                                          aiohttp.ClientWebSocketResponse]:
    s = aiohttp.ClientSession()
    ws = await s.ws_connect(srv.url + "/ws", headers=routed(sid), max_msg_size=0, **kw)
    await ws.send_str("hello")
    assert (await ws.receive(timeout=10)).data == "echo:hello"
    return s, ws


async def _closed_with(ws: aiohttp.ClientWebSocketResponse, code: int) -> str:
    """Read until the session closes; the reason, after checking the close code."""
    while True:
        msg = await ws.receive(timeout=30)
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
            break
        assert msg.type != aiohttp.WSMsgType.BINARY or len(msg.data) <= CAP
    assert ws.close_code == code, (ws.close_code, msg)
    return str(msg.extra or "")


def test_a_client_message_beyond_the_cap_closes_the_session_with_1009(bounded: InProcessServer, sid: str,
                                                                      guest: Guest) -> None:
    async def run() -> None:
        for data, compress in ((os.urandom(CAP + 1), 0), (bytes(64 << 20), 15)):  # plain; a deflate bomb
            guest.ws_received.clear()
            s, ws = await _session(bounded, sid, compress=compress)
            try:
                await ws.send_bytes(bytes(CAP - 64))       # below the cap: relayed
                assert (await ws.receive(timeout=10)).data == f"got {CAP - 64}"
                await ws.send_bytes(data)
                await _closed_with(ws, 1009)
                assert max(guest.ws_received) <= CAP
            finally:
                await s.close()
    asyncio.run(run())


def test_an_endless_client_message_is_cut_at_its_header(bounded: InProcessServer, sid: str) -> None:
    """A raw client whose one frame names 2^62 bytes, then streams zeros: the proxy answers
    1009 and closes; what it took is far below the cap."""
    with socket.create_connection(("127.0.0.1", int(bounded.url.rsplit(":", 1)[1])), timeout=10) as c:
        key = base64.b64encode(os.urandom(16)).decode()
        c.sendall((f"GET /ws HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: {GUEST_PORT}\r\n"
                   f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                   f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += c.recv(4096)
        assert head.startswith(b"HTTP/1.1 101"), head
        c.sendall(b"\x82\xff" + struct.pack(">Q", 1 << 62) + os.urandom(4))
        sent, answer = 0, b""
        c.settimeout(0.05)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                c.sendall(bytes(65536))
                sent += 65536
            except OSError:
                break
            try:
                got = c.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not got:
                break
            answer += got
            if len(answer) >= 4:
                break
        rest = head.partition(b"\r\n\r\n")[2] + answer
        assert rest[:1] == b"\x88" and struct.unpack(">H", rest[2:4])[0] == 1009, rest[:40]
        assert sent < CAP, sent


def test_guest_messages_beyond_the_cap_close_the_client_session(bounded: InProcessServer, sid: str) -> None:
    """From the guest: a message over the cap, an endless one, and a deflate bomb (a
    compressed frame on a session the node never offered compression on): the client's
    session closes with 1009 (1002 for the bomb, a protocol error) and the reason."""
    async def run() -> None:
        for command, code, reason in ((f"send:{CAP + 1}", 1009, "exceeds limit"),
                                      ("endless", 1009, "exceeds limit"), ("bomb", 1002, "")):
            s, ws = await _session(bounded, sid)
            try:
                await ws.send_str(f"send:{CAP - 64}")
                assert len((await ws.receive(timeout=10)).data) == CAP - 64
                await ws.send_str(command)
                said = await _closed_with(ws, code)
                assert reason in said, said
            finally:
                await s.close()
    asyncio.run(run())


def test_a_bound_out_of_range_is_a_config_error() -> None:
    from aenv_api.server.settings import ServerConfig
    from aenv_store.errors import ConfigError

    for key, value in (("proxy_head_timeout", 0.0), ("proxy_max_connections", 0), ("websocket_max_message", 10)):
        with pytest.raises(ConfigError, match=f"server.{key}"):
            ServerConfig(**{key: value})
    assert json.dumps(ServerConfig().websocket_max_message) == str(16 << 20)
