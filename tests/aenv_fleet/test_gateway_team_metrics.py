"""A team's metrics through a gateway are the whole fleet's (aenv_fleet/gateway/team_metrics.py):
two nodes' ``ApiServer`` over ``FakeSandboxService`` (no VMs) sampling every 0.1 s, a
real redis-server with a password, the fleet's teams in Redis, a real ``Gateway``. Team
A runs one sandbox on one node and two on the other: each node alone says 1 or 2, the
gateway says 3, in the series and in ``/metrics/max``; the nodes' refusals come through."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_api.server.app import ApiServer
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.settings import ServerConfig
from aenv_api.server.shared_keys import SharedKeyStore
from aenv_fleet.agent import NodeAgent
from aenv_fleet.config import ClusterConfig, GatewayConfig
from aenv_fleet.coord import Coordinator
from aenv_fleet.gateway.app import Gateway
from aenv_fleet.gateway.team_metrics import maximum, merged
from aenv_fleet.teams_doc import RedisTeamsDocument
from aenv_vm.fake_service import FakeSandboxService

from .redisserver import RedisServer
from .test_gateway_teams import cap, fleet_trust

KEY = "e2b_" + "8" * 40
ADMIN = "gateway-metrics-admin-" + "m" * 12
SECRET = "gateway-metrics-fleet-secret-0123456789"

buckets = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 30), st.floats(0, 10, allow_nan=False)),
                   max_size=8, unique_by=lambda b: b[0])


@settings(max_examples=60)
@given(st.lists(buckets, max_size=4))
def test_merged_sums_each_bucket_over_the_nodes(nodes: list[list[tuple[int, int, float]]]) -> None:
    answers = [[{"timestampUnix": 1000 + 5 * t, "concurrentSandboxes": c, "sandboxStartRate": r} for t, c, r in n]
               for n in nodes]
    got = merged(answers)
    stamps = sorted({1000 + 5 * t for n in nodes for t, _, _ in n})
    assert [b["timestampUnix"] for b in got] == stamps
    for b in got:
        ts = b["timestampUnix"]
        assert b["concurrentSandboxes"] == sum(c for n in nodes for t, c, _ in n if 1000 + 5 * t == ts)
        assert abs(b["sandboxStartRate"] - sum(r for n in nodes for t, _, r in n if 1000 + 5 * t == ts)) < 1e-9
    best = maximum(got, "concurrent_sandboxes", None)
    assert best["value"] == max((b["concurrentSandboxes"] for b in got), default=0)


def test_a_teams_metrics_through_a_gateway_are_the_fleets(tmp_path: Path, redis_server: RedisServer) -> None:
    trust = fleet_trust(tmp_path, redis_server, SECRET)

    async def main() -> None:
        nodes: list[tuple[ApiServer, Lifecycle, Coordinator, RedisTeamsDocument, str]] = []
        gateway: Gateway | None = None
        try:
            for nid in ("n1", "n2"):
                config, metrics = ServerConfig(port=0, team_metrics_interval=0.1), Metrics()
                coord = Coordinator(trust.redis_url, trust.keys, trust.redis)
                agent = NodeAgent(ClusterConfig(redis_url=redis_server.bare_url, node_id=nid,
                                                advertise_url="http://127.0.0.1:1"),
                                  KEY, 20, 256, tmp_path / nid, coord=coord)
                lifecycle = Lifecycle(agent.observe(FakeSandboxService()), config, metrics, tmp_path / nid,
                                      node_id=nid)
                await lifecycle.start()
                doc = RedisTeamsDocument(redis_server.bare_url, trust.redis, trust.keys)
                node = ApiServer(lifecycle, Credentials(KEY, "env", b"s" * 32, admin_token=ADMIN), config, metrics,
                                 "test", fleet_keys=trust.keys, key_store=SharedKeyStore(doc, KEY))
                url = f"http://127.0.0.1:{await node.start('127.0.0.1', 0)}"
                await coord.add_api_key(KEY)
                await coord.heartbeat(nid, cap(url), 60)
                nodes.append((node, lifecycle, coord, doc, url))
            gateway = Gateway(GatewayConfig(redis_url=redis_server.bare_url), trust)
            gw = f"http://127.0.0.1:{await gateway.start('127.0.0.1', 0)}"
            async with aiohttp.ClientSession() as http:
                async def call(method: str, url: str, body: Any = None, key: str | None = None,
                               admin: bool = False, **headers: str) -> tuple[int, Any]:
                    h = dict(headers)
                    if key:
                        h["X-API-Key"] = key
                    if admin:
                        h["X-Admin-Token"] = ADMIN
                    async with http.request(method, url, json=body, headers=h) as r:
                        return r.status, (await r.json() if r.content_type == "application/json" else None)

                ids: dict[str, str] = {}
                keys: dict[str, str] = {}
                for name in ("a", "b"):
                    status, team = await call("POST", gw + "/admin/teams", {"name": f"gm-{name}"}, admin=True)
                    assert status == 201, team
                    status, made = await call("POST", f"{gw}/admin/teams/{team['teamID']}/api-keys", {"name": "k"},
                                              admin=True)
                    assert status == 201, made
                    ids[name], keys[name] = team["teamID"], made["key"]
                a = ids["a"]
                # one of A's sandboxes on n1, two on n2 (made on each node itself: no placement)
                for (_, _, _, _, url), count in zip(nodes, (1, 2)):
                    for _ in range(count):
                        assert (await call("POST", url + "/sandboxes", {"templateID": "base"}, key=keys["a"]))[0] == 201

                async def peak(url: str, **kw: Any) -> int:
                    status, series = await call("GET", f"{url}/teams/{a}/metrics", **kw)
                    assert status == 200, series
                    return max((b["concurrentSandboxes"] for b in series), default=0)
                for _ in range(100):      # until each node sampled its sandboxes
                    if [await peak(u, key=keys["a"]) for *_, u in nodes] == [1, 2]:
                        break
                    await asyncio.sleep(0.1)
                assert [await peak(u, key=keys["a"]) for *_, u in nodes] == [1, 2]
                assert await peak(gw, key=keys["a"]) == 3
                assert await peak(gw, admin=True, **{"X-Team-ID": a}) == 3       # the admin, for the team
                status, best = await call("GET", f"{gw}/teams/{a}/metrics/max?metric=concurrent_sandboxes",
                                          key=keys["a"])
                assert status == 200 and best["value"] == 3.0 and best["timestampUnix"] > 0, best
                status, rate = await call("GET", f"{gw}/teams/{a}/metrics/max?metric=sandbox_start_rate",
                                          key=keys["a"])
                assert status == 200 and rate["value"] > 0, rate
                # an explicit range: the same grid on both nodes, summed
                status, series = await call("GET", f"{gw}/teams/{a}/metrics?start=0&end=4000000000", key=keys["a"])
                assert status == 200 and max(b["concurrentSandboxes"] for b in series) == 3, series
                # refusals, as the nodes (or the gateway's key check) give them
                assert (await call("GET", f"{gw}/teams/{a}/metrics", key=keys["b"]))[0] == 403
                assert (await call("GET", f"{gw}/teams/{a}/metrics", key="e2b_" + "0" * 40))[0] == 401
                assert (await call("GET", f"{gw}/teams/{a}/metrics"))[0] == 401
                assert (await call("GET", f"{gw}/teams/{a}/metrics/max?metric=nope", key=keys["a"]))[0] == 400
                assert (await call("GET", f"{gw}/teams/{a}/metrics?start=9&end=1", key=keys["a"]))[0] == 400
                assert (await call("GET", f"{gw}/teams/{a}/metrics?start=x", key=keys["a"]))[0] == 400
                for *_, url in nodes:
                    for s in (await call("GET", url + "/sandboxes", key=keys["a"]))[1]:
                        assert (await call("DELETE", f"{url}/sandboxes/{s['sandboxID']}", key=keys["a"]))[0] == 204
        finally:
            if gateway is not None:
                await gateway.close()
            for node, lifecycle, coord, doc, _ in nodes:
                await node.close()
                await lifecycle.shutdown()
                await coord.close()
                doc.close()
    asyncio.run(main())
