"""Volumes through a gateway (aenv_fleet/gateway/volumes.py, docs/cluster.md "Volumes"):
an in-process gateway in front of two nodes' real ``ApiServer``s with real volume
registries (directories of the test), on a real Redis; the sandbox layer is the fake
one, which mounts nothing but refuses a volume its node does not have, as a node does.

A volume is made on the node with the most free disk and stays there; its content
routes (the volume's token, no API key) are streamed to that node; a sandbox that mounts
it is placed there; mounts on two nodes are refused; names are unique in the fleet;
a delete frees the name.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from aenv_api.server.app import ApiServer
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.settings import ServerConfig
from aenv_api.server.volumes_api import VolumeApi
from aenv_fleet.config import GatewayConfig
from aenv_fleet.coord import Capacity, Coordinator
from aenv_fleet.gateway.app import Gateway
from aenv_fleet.trust import gateway_trust
from aenv_vm.fake_service import FakeSandboxService
from aenv_vm.volumes.registry import VolumeRegistry
from aenv_wire.team_keys import DEFAULT_TEAM_ID

from .redisserver import RedisServer
from .test_trust import KEY, files

BIG = 40 << 20


def cap(url: str, disk_free_mib: int) -> Capacity:
    return Capacity(url=url, max_sandboxes=8, vcpus=2, mem_total_mib=4096, mem_avail_mib=4096,
                    disk_free_mib=disk_free_mib, sandbox_mem_mib=256, running=0, paused=0)


@contextlib.asynccontextmanager
async def two_nodes(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[tuple[str, list[VolumeRegistry], Any]]:
    """Two nodes' ApiServers (real volume registries, the fake sandbox layer) behind an
    in-process gateway: (its URL, the registries, ``beat(disk free MiB of n1, n2)``)."""
    trust = gateway_trust(GatewayConfig(redis_url=redis_server.bare_url, **files(tmp_path, redis_server)), tmp_path)
    redis_server.client().flushall()
    nodes, urls, registries = [], [], []
    for name in ("n1", "n2"):
        config = ServerConfig(port=0)
        metrics = Metrics()
        registry = VolumeRegistry(tmp_path / name / "volumes")
        service = FakeSandboxService(node_id=name, volumes=registry)
        lc = Lifecycle(service, config, metrics, tmp_path / name)
        await lc.start()
        node = ApiServer(lc, Credentials(KEY, "env", b"s" * 32), config, metrics, "test",
                         volumes=VolumeApi(registry), fleet_keys=trust.keys)
        urls.append(f"http://127.0.0.1:{await node.start('127.0.0.1', 0)}")
        nodes.append(node)
        registries.append(registry)
    agent = Coordinator(trust.redis_url, trust.keys, trust.redis)
    await agent.add_api_key(KEY)
    gateway = Gateway(GatewayConfig(redis_url=redis_server.bare_url), trust)

    async def beat(disk: tuple[int, int]) -> None:
        for name, url, d in zip(("n1", "n2"), urls, disk):
            await agent.heartbeat(name, cap(url, d), 60)
        await gateway.fleet.refresh()
    gw = f"http://127.0.0.1:{await gateway.start('127.0.0.1', 0)}"
    try:
        yield gw, registries, beat
    finally:
        await gateway.close()
        await agent.close()
        for node in nodes:
            await node.close()


def test_volumes_live_on_one_node_and_everything_that_uses_them_goes_there(
        tmp_path: Path, redis_server: RedisServer) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path, redis_server) as (gw, registries, beat):
            async with aiohttp.ClientSession(headers={"X-API-Key": KEY}) as http:
                await beat((1000, 9000))        # n2 has the most free disk
                async with http.post(f"{gw}/volumes", json={"name": "data"}) as r:
                    data = await r.json()
                    assert r.status == 201, data
                assert [v.name for v in registries[1].list()] == ["data"] and registries[0].list() == []
                async with http.post(f"{gw}/volumes", json={"name": "data"}) as r:     # names: the fleet's
                    assert r.status == 400 and "already exists" in (await r.json())["message"]
                await beat((9000, 1000))
                async with http.post(f"{gw}/volumes", json={"name": "logs"}) as r:
                    logs = await r.json()
                    assert r.status == 201, logs
                assert [v.name for v in registries[0].list()] == ["logs"]
                async with http.get(f"{gw}/volumes") as r:
                    assert sorted(v["name"] for v in await r.json()) == ["data", "logs"]
                async with http.get(f"{gw}/volumes/{data['volumeID']}") as r:
                    assert r.status == 200 and (await r.json())["token"] == data["token"]

                # content: the volume's token, no API key; streamed to its node
                bearer = {"Authorization": f"Bearer {data['token']}"}
                block = hashlib.sha256(b"v").digest() * 32768
                async with aiohttp.ClientSession() as anon:
                    async def body():      # type: ignore[no-untyped-def]
                        for _ in range(BIG // len(block)):
                            yield block
                    async with anon.put(f"{gw}/volumecontent/{data['volumeID']}/file?path=/big&force=true",
                                        data=body(), headers=bearer) as r:
                        assert r.status == 201, await r.text()
                    async with anon.get(f"{gw}/volumecontent/{data['volumeID']}/file?path=/big", headers=bearer) as r:
                        got = hashlib.sha256()
                        size = 0
                        async for piece in r.content.iter_any():
                            got.update(piece)
                            size += len(piece)
                    assert size == BIG and got.hexdigest() == hashlib.sha256(block * (BIG // len(block))).hexdigest()
                    async with anon.get(f"{gw}/volumecontent/{data['volumeID']}/file?path=/big",
                                        headers={"Authorization": f"Bearer {logs['token']}"}) as r:
                        assert r.status == 401      # another volume's token
                    async with anon.get(f"{gw}/volumecontent/{'0' * 8}-0000-0000-0000-{'0' * 12}/path?path=/",
                                        headers=bearer) as r:
                        assert r.status == 404

                # a sandbox that mounts "data" goes to n2, whatever placement would prefer
                await beat((9000, 1000))
                for _ in range(3):
                    async with http.post(f"{gw}/sandboxes", json={
                            "templateID": "base", "volumeMounts": [{"name": "data", "path": "/mnt/data"}]}) as r:
                        made = await r.json()
                        assert r.status == 201, made
                        assert r.headers["X-Aenv-Node"] == "n2"
                async with http.post(f"{gw}/sandboxes", json={"templateID": "base", "volumeMounts": [
                        {"name": "data", "path": "/a"}, {"name": "logs", "path": "/b"}]}) as r:
                    assert r.status == 400 and "different nodes" in (await r.json())["message"]
                async with http.post(f"{gw}/sandboxes", json={
                        "templateID": "base", "volumeMounts": [{"name": "nope", "path": "/a"}]}) as r:
                    assert r.status == 404

                async with http.delete(f"{gw}/volumes/{logs['volumeID']}") as r:
                    assert r.status == 204
                assert registries[0].list() == []
                assert redis_server.client().get("aenv:volname:logs") is None
                async with http.post(f"{gw}/volumes", json={"name": "logs"}) as r:     # the name is free again
                    assert r.status == 201
    asyncio.run(main())


def test_a_teams_volume_bytes_quota_holds_across_the_nodes(tmp_path: Path, redis_server: RedisServer) -> None:
    """The team's volumeBytes quota, in the fleet's Redis: each node checks only its own
    volumes, so a volume on n1 that fits there but not beside the team's volume on n2
    is refused by the gateway (507) and deleted again on n1; its name is free."""
    mib = 1 << 20

    async def main() -> None:
        async with two_nodes(tmp_path, redis_server) as (gw, registries, beat):
            coord = Coordinator(redis_server.url, gateway_trust(
                GatewayConfig(redis_url=redis_server.bare_url, **files(tmp_path, redis_server)), tmp_path).keys)
            await coord.set_team_quota(DEFAULT_TEAM_ID, {"volumeBytes": 10 * mib})
            await coord.close()
            async with aiohttp.ClientSession(headers={"X-API-Key": KEY}) as http:
                await beat((1000, 9000))
                async with http.post(f"{gw}/volumes", json={"name": "six", "maxBytes": 6 * mib}) as r:
                    six = await r.json()
                    assert r.status == 201 and six["maxBytes"] == 6 * mib, six
                await beat((9000, 1000))        # the next one goes to n1, which holds nothing of the team
                async with http.post(f"{gw}/volumes", json={"name": "five", "maxBytes": 5 * mib}) as r:
                    err = await r.json()
                    assert r.status == 507 and str(6 * mib) in err["message"], err
                assert registries[0].list() == [] and [v.name for v in registries[1].list()] == ["six"]
                async with http.post(f"{gw}/volumes", json={"name": "four", "maxBytes": 4 * mib}) as r:
                    assert r.status == 201
                assert [v.name for v in registries[0].list()] == ["four"]
                async with http.delete(f"{gw}/volumes/{six['volumeID']}") as r:
                    assert r.status == 204
                async with http.post(f"{gw}/volumes", json={"name": "five", "maxBytes": 5 * mib}) as r:
                    assert r.status == 201, await r.text()
    asyncio.run(main())
