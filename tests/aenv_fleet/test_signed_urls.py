"""Signed ``/files`` URLs that name no sandbox, through a gateway (issue 29; aenv_fleet/
gateway/signed_urls.py): an in-process gateway in front of two nodes' real
``ApiServer``s, on a real Redis, their sandboxes' envd an HTTP server of the test
(the sandbox layer is the fake one: what is tested is the routing, the bounds and
the memories; tests/aenv_fleet/test_fleet.py downloads a signed URL from a real guest).

* the node that holds the sandbox is found by one bodyless question to each node, then
  the request goes to that node alone, streamed: an upload larger than the gateway ever
  held in memory (the old gateway buffered at most 256 MiB, and offered the body to each
  node in turn) goes through, and a download comes back whole;
* a found signature is remembered (no more questions), an unknown one too (401 at once);
* one client trying many signatures is limited (429 with Retry-After), the nodes asked
  at most the burst; so is one whose API keys keep failing.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

import aiohttp
from aiohttp import web

from aenv_api.server.app import ApiServer
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.settings import ServerConfig
from aenv_fleet.config import GatewayConfig
from aenv_fleet.coord import Coordinator
from aenv_fleet.gateway.app import Gateway
from aenv_fleet.gateway.signed_urls import LOOKUP_BURST
from aenv_fleet.trust import gateway_trust
from aenv_vm.fake_service import FakeSandboxService
from envd import signing

from .redisserver import RedisServer
from .test_trust import KEY, cap, files

DOWNLOAD = 24 << 20
UPLOAD = 300 << 20          # over the old gateway's 256 MiB buffer


class Envd:
    """What the sandboxes' envd port reaches: /files, counting what it is sent."""

    def __init__(self) -> None:
        self.received = 0
        self.digest = ""
        self.block = hashlib.sha256(b"block").digest() * 2048        # 64 KiB

    async def files(self, request: web.Request) -> web.StreamResponse:
        if request.method == "POST":
            h = hashlib.sha256()
            async for piece in request.content.iter_any():
                self.received += len(piece)
                h.update(piece)
            self.digest = h.hexdigest()
            return web.json_response([{"path": request.query.get("path", ""), "type": "file"}])
        resp = web.StreamResponse()
        resp.content_length = DOWNLOAD
        await resp.prepare(request)
        for _ in range(DOWNLOAD // len(self.block)):
            await resp.write(self.block)
        return resp


def counting(fn: Callable[..., Any], calls: list[str], name: str) -> Callable[..., Any]:
    async def wrapped(*args: Any) -> Any:
        calls.append(name)
        return await fn(*args)
    return wrapped


def test_a_signed_url_is_found_once_streamed_to_its_node_and_lookups_are_bounded(
        tmp_path: Path, redis_server: RedisServer) -> None:
    trust = gateway_trust(GatewayConfig(redis_url=redis_server.bare_url, **files(tmp_path, redis_server)), tmp_path)
    redis_server.client().flushall()

    async def main() -> None:
        envd = Envd()
        envd_app = web.Application(client_max_size=1 << 40)
        envd_app.router.add_route("*", "/files", envd.files)
        envd_runner = web.AppRunner(envd_app)
        await envd_runner.setup()
        site = web.TCPSite(envd_runner, "127.0.0.1", 0)
        await site.start()
        envd_port = site._server.sockets[0].getsockname()[1]      # type: ignore[union-attr]
        asked: list[str] = []
        nodes, urls = [], []
        creds = Credentials(KEY, "env", b"s" * 32)      # one envd secret: one token derivation, as a fleet's
        for name in ("n1", "n2"):
            config = ServerConfig(port=0)
            metrics = Metrics()
            service = FakeSandboxService(node_id=name, endpoint=lambda _sid, _port: ("127.0.0.1", envd_port))
            lc = Lifecycle(service, config, metrics, tmp_path / name)
            lc.signed_sandbox = counting(lc.signed_sandbox, asked, name)    # type: ignore[method-assign]
            await lc.start()
            node = ApiServer(lc, creds, config, metrics, "test", fleet_keys=trust.keys)
            urls.append(f"http://127.0.0.1:{await node.start('127.0.0.1', 0)}")
            nodes.append(node)
        agent = Coordinator(trust.redis_url, trust.keys, trust.redis)
        await agent.add_api_key(KEY)
        for name, url in zip(("n1", "n2"), urls):
            await agent.heartbeat(name, cap(url), 60)
        gateway = Gateway(GatewayConfig(redis_url=redis_server.bare_url), trust)
        gw = f"http://127.0.0.1:{await gateway.start('127.0.0.1', 0)}"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{urls[1]}/sandboxes", json={"templateID": "base", "secure": True},
                                     headers={"X-API-Key": KEY}) as r:
                    made = await r.json()
                    assert r.status == 201, made
                sid, token = made["sandboxID"], made["envdAccessToken"]
                await agent.bind(sid, "n2", "running", {"templateID": "base"})
                expiry = int(time.time()) + 300

                def url(path: str, method: str, user: str = "user") -> str:
                    sig = signing.sign(path, signing.operation_of(method), user, token, expiry)
                    return gw + "/files?" + urllib.parse.urlencode(
                        {"path": path, "username": user, "signature": sig, "signature_expiration": expiry})

                async with http.get(url("/big", "GET")) as r:
                    assert r.status == 200, await r.text()
                    got = 0
                    async for piece in r.content.iter_any():
                        got += len(piece)
                    assert got == DOWNLOAD
                assert sorted(asked) == ["n1", "n2"]        # one question to each node, no body
                async with http.get(url("/big", "GET")) as r:     # remembered: nobody asked again
                    assert r.status == 200 and len(await r.read()) == DOWNLOAD
                assert len(asked) == 2

                h = hashlib.sha256()

                async def body() -> Any:
                    block = b"u" * (1 << 20)
                    for _ in range(UPLOAD >> 20):
                        h.update(block)
                        yield block
                async with http.post(url("/up", "POST"), data=body()) as r:
                    assert r.status == 200, await r.text()
                assert envd.received == UPLOAD and envd.digest == h.hexdigest()

                # a signature no sandbox made: 401, and the second time nobody is asked
                bad = url("/big", "GET").replace("signature=", "signature=x")
                before = len(asked)
                for _ in range(2):
                    async with http.get(bad) as r:
                        assert r.status == 401 and "invalid signature" in (await r.json())["message"]
                assert len(asked) == before + 2
                # one client trying many: limited, the nodes asked at most the burst
                statuses = []
                for i in range(int(LOOKUP_BURST) + 20):
                    async with http.get(bad.replace("signature=x", f"signature=y{i}")) as r:
                        statuses.append(r.status)
                        if r.status == 429:
                            assert int(r.headers["Retry-After"]) >= 1
                assert statuses.count(429) >= 15 and set(statuses) == {401, 429}, statuses
                assert len(asked) - before <= 2 * (LOOKUP_BURST + 4)
        finally:
            await gateway.close()
            await agent.close()
            for node in nodes:
                await node.close()
            await envd_runner.cleanup()
    asyncio.run(main())


def test_a_client_whose_api_keys_keep_failing_is_told_to_wait(tmp_path: Path, redis_server: RedisServer) -> None:
    """Each unknown key costs the gateway a look at Redis' teams document: past a burst,
    a client's failing keys are answered 429 with Retry-After, asking nothing."""
    trust = gateway_trust(GatewayConfig(redis_url=redis_server.bare_url, **files(tmp_path, redis_server)), tmp_path)
    redis_server.client().flushall()

    async def main() -> None:
        agent = Coordinator(trust.redis_url, trust.keys, trust.redis)
        await agent.add_api_key(KEY)
        gateway = Gateway(GatewayConfig(redis_url=redis_server.bare_url), trust)
        gw = f"http://127.0.0.1:{await gateway.start('127.0.0.1', 0)}"
        try:
            async with aiohttp.ClientSession() as http:
                statuses = []
                for i in range(80):
                    async with http.get(f"{gw}/sandboxes", headers={"X-API-Key": f"e2b_{i:040d}"}) as r:
                        statuses.append(r.status)
                        if r.status == 429:
                            assert int(r.headers["Retry-After"]) >= 1
                assert statuses[:50] == [401] * 50 and statuses.count(429) >= 20, statuses
                await asyncio.sleep(0.5)        # the bucket refills: the right key goes through
                async with http.get(f"{gw}/sandboxes", headers={"X-API-Key": KEY}) as r:
                    assert r.status == 200
        finally:
            await gateway.close()
            await agent.close()
    asyncio.run(main())
