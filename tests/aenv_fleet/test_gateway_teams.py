"""Teams through a gateway, in-process: a real `Gateway` and a node's `ApiServer` over a
``FakeSandboxService`` (no VMs) whose changes reach Redis through the node agent
(its bindings carry the sandbox's team), a real redis-server with a password, and the
fleet's teams in Redis (shared_keys.py). The gateway authenticates team keys itself,
answers 404 for another team's sandbox on every route (also one it answers from Redis
alone), lists the caller's team's only, keeps `Idempotency-Key` per team, keeps the
fleet's own routes for the deployment key, and serves the admin routes fleet-wide."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from aenv_api.server.app import ApiServer
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.settings import ServerConfig
from aenv_api.server.shared_keys import SharedKeyStore
from aenv_fleet import keys as fleet_keys_mod
from aenv_fleet.agent import NodeAgent
from aenv_fleet.config import ClusterConfig, GatewayConfig
from aenv_fleet.coord import Capacity, Coordinator
from aenv_fleet.gateway.app import Gateway
from aenv_fleet.teams_doc import RedisTeamsDocument
from aenv_fleet.trust import FleetTrust, gateway_trust
from aenv_vm.fake_service import FakeSandboxService

from .redisserver import RedisServer

KEY = "e2b_" + "7" * 40
ADMIN = "gateway-teams-admin-" + "w" * 12
SECRET = "gateway-teams-fleet-secret-0123456789"


def cap(url: str) -> Capacity:
    return Capacity(url=url, max_sandboxes=20, vcpus=2, mem_total_mib=100_000, mem_avail_mib=100_000,
                    disk_free_mib=10_000, sandbox_mem_mib=256, running=0, paused=0)


def fleet_trust(tmp_path: Path, redis_server: RedisServer, secret: str) -> FleetTrust:
    """An emptied Redis with a password and a fleet secret: the trust a gateway and its nodes share."""
    redis_server.client().flushall()
    (tmp_path / "fleet-secret").write_text(secret + "\n")
    redis_server.write_password(tmp_path / "redis-password")
    return gateway_trust(GatewayConfig(redis_url=redis_server.bare_url, fleet_secret_file="fleet-secret",
                                       redis_password_file=str(tmp_path / "redis-password")), tmp_path)


def test_teams_through_a_gateway(tmp_path: Path, redis_server: RedisServer) -> None:
    trust = fleet_trust(tmp_path, redis_server, SECRET)

    async def main() -> None:
        config, metrics = ServerConfig(port=0), Metrics()
        node_coord = Coordinator(trust.redis_url, trust.keys, trust.redis)
        agent = NodeAgent(ClusterConfig(redis_url=redis_server.bare_url, node_id="n1",
                                        advertise_url="http://127.0.0.1:1"),
                          KEY, 20, 256, tmp_path / "node", coord=node_coord)
        lifecycle = Lifecycle(agent.observe(FakeSandboxService()), config, metrics, tmp_path / "node")
        await lifecycle.start()
        doc = RedisTeamsDocument(redis_server.bare_url, trust.redis, trust.keys)
        secrets_doc = RedisTeamsDocument(redis_server.bare_url, trust.redis, trust.keys, key=fleet_keys_mod.SECRETS)
        node = ApiServer(lifecycle, Credentials(KEY, "env", b"s" * 32, admin_token=ADMIN, secrets_key=bytes(32)),
                         config, metrics, "test", fleet_keys=trust.keys, key_store=SharedKeyStore(doc, KEY),
                         secrets_doc=secrets_doc)
        node_url = f"http://127.0.0.1:{await node.start('127.0.0.1', 0)}"
        await node_coord.add_api_key(KEY)
        await node_coord.heartbeat("n1", cap(node_url), 60)
        gateway = Gateway(GatewayConfig(redis_url=redis_server.bare_url), trust)
        gw = f"http://127.0.0.1:{await gateway.start('127.0.0.1', 0)}"
        try:
            async with aiohttp.ClientSession() as http:
                async def call(method: str, path: str, body: Any = None, key: str | None = None,
                               admin: bool = False, **headers: str) -> tuple[int, Any]:
                    h = dict(headers)
                    if key:
                        h["X-API-Key"] = key
                    if admin:
                        h["X-Admin-Token"] = ADMIN
                    async with http.request(method, gw + path, json=body, headers=h) as r:
                        return r.status, (await r.json() if r.content_type == "application/json" else None)

                # teams and keys made through the gateway (its admin routes reach a node)
                ids: dict[str, str] = {}
                keys: dict[str, str] = {}
                for name in ("a", "b"):
                    status, team = await call("POST", "/admin/teams", {"name": f"gw-{name}"}, admin=True)
                    assert status == 201, team
                    status, made = await call("POST", f"/admin/teams/{team['teamID']}/api-keys", {"name": "k"},
                                              admin=True)
                    assert status == 201, made
                    ids[name], keys[name] = team["teamID"], made["key"]
                assert (await call("GET", "/admin/teams"))[0] == 401
                assert (await call("GET", "/admin/teams", key=KEY))[0] == 401
                status, teams = await call("GET", "/teams", key=keys["a"])
                assert status == 200 and teams[0]["teamID"] == ids["a"], teams
                assert (await call("GET", "/teams", key="e2b_" + "0" * 40))[0] == 401

                status, made = await call("POST", "/sandboxes", {"templateID": "base"}, key=keys["a"])
                assert status == 201, made
                sid = made["sandboxID"]
                assert (await call("GET", f"/sandboxes/{sid}", key=keys["a"]))[0] == 200
                assert [s["sandboxID"] for s in (await call("GET", "/sandboxes", key=keys["a"]))[1]] == [sid]
                # B (and the default team): as an id that does not exist, on every route
                for key in (keys["b"], KEY):
                    for method, path, body in (
                            ("GET", f"/sandboxes/{sid}", None), ("GET", f"/v2/sandboxes/{sid}/logs", None),
                            ("POST", f"/sandboxes/{sid}/connect", {"timeout": 30}),
                            ("POST", f"/sandboxes/{sid}/resume", {"timeout": 30}),
                            ("POST", f"/sandboxes/{sid}/pause", None), ("POST", f"/sandboxes/{sid}/fork", {}),
                            ("POST", f"/sandboxes/{sid}/snapshots", {}), ("POST", f"/snapshots/{sid}/fork", {}),
                            ("POST", f"/sandboxes/{sid}/timeout", {"timeout": 30}),
                            ("DELETE", f"/sandboxes/{sid}", None)):
                        status, got = await call(method, path, body, key=key)
                        assert status == 404 and got["message"] == f"sandbox {sid} not found", (method, path, got)
                    status, listed = await call("GET", "/v2/sandboxes?state=running,paused", key=key)
                    assert status == 200 and sid not in [s["sandboxID"] for s in listed], listed
                # one the gateway answers from Redis alone (paused in the repository, on no node)
                await node_coord.bind("sbx-released", "", "paused", {"templateID": "base", "teamID": ids["a"],
                                                                     "startedAt": 1.0, "endAt": 2.0})
                await node_coord.release("sbx-released", "")
                assert (await call("GET", "/sandboxes/sbx-released", key=keys["a"]))[0] == 200
                assert (await call("GET", "/sandboxes/sbx-released", key=keys["b"]))[0] == 404
                assert (await call("POST", "/sandboxes/sbx-released/connect", {"timeout": 30}, key=keys["b"]))[0] \
                    == 404
                paused_a = [s["sandboxID"] for s in (await call("GET", "/v2/sandboxes?state=paused",
                                                                key=keys["a"]))[1]]
                paused_b = [s["sandboxID"] for s in (await call("GET", "/v2/sandboxes?state=paused",
                                                                key=keys["b"]))[1]]
                assert "sbx-released" in paused_a and "sbx-released" not in paused_b
                await node_coord.unbind("sbx-released")
                # secrets: the fleet's (its Redis' document), the team's own
                status, secret = await call("POST", "/secrets", {"name": "tok", "value": "v-" + "9" * 20},
                                            key=keys["a"])
                assert status == 201, secret
                assert [x["name"] for x in (await call("GET", "/secrets", key=keys["a"]))[1]] == ["tok"]
                assert (await call("GET", "/secrets", key=keys["b"]))[1] == []
                assert (await call("GET", f"/secrets/{secret['secretID']}", key=keys["b"]))[0] == 404
                assert node.secret_store is not None and node.secret_store.shared
                assert node.secret_store.resolve(ids["a"], "tok") == b"v-" + b"9" * 20
                stored = redis_server.client().hget("aenv:secrets", "doc") or ""
                assert "tok" in stored and "9" * 20 not in stored
                # the same Idempotency-Key in two teams: two creates
                got = [await call("POST", "/sandboxes", {"templateID": "base"}, key=keys[t],
                                  **{"Idempotency-Key": "same-key"}) for t in ("a", "b")]
                assert all(s == 201 for s, _ in got) and got[0][1]["sandboxID"] != got[1][1]["sandboxID"], got
                # the fleet's own routes are the deployment key's
                assert (await call("GET", "/nodes", key=keys["b"]))[0] == 403
                assert (await call("GET", "/cluster/events", key=keys["b"]))[0] == 403
                assert (await call("POST", "/nodes/n1/drain", {}, key=keys["b"]))[0] == 403
                assert (await call("GET", "/nodes", key=KEY))[0] == 200
                # admin, fleet-wide: a team with a sandbox is not deleted; running counts by team
                status, got = await call("DELETE", f"/admin/teams/{ids['a']}", admin=True)
                assert status == 409 and "sandbox" in got["message"], got
                assert (await call("DELETE", f"/admin/teams/{ids['a']}"))[0] == 401
                status, counts = await call("GET", "/admin/sandboxes/running-counts", admin=True)
                # a team's metrics for the admin (X-Team-ID), as for the team's key (the fleet's sum)
                for got in (await call("GET", f"/teams/{ids['a']}/metrics", admin=True, **{"X-Team-ID": ids["a"]}),
                            await call("GET", f"/teams/{ids['a']}/metrics", key=keys["a"])):
                    assert got[0] == 200 and isinstance(got[1], list), got
                assert status == 200 and {"teamID": ids["a"], "runningSandboxes": 2,
                                          "pausedSandboxes": 0} in counts["teams"], counts
                # the gateway counts a team's starts as that team's (its Redis running set)
                assert len(await node_coord.team_running(ids["a"])) == 2
                # a team's quota holds at the gateway for that team's key, not the default team's
                status, got = await call("PUT", f"/admin/teams/{ids['a']}/quota", {"runningSandboxes": 2}, admin=True)
                assert status == 200, got
                status, got = await call("POST", "/sandboxes", {"templateID": "base"}, key=keys["a"])
                assert status == 429 and "maximum number of concurrent" in got["message"], got
                status, got = await call("POST", "/sandboxes", {"templateID": "base"}, key=keys["b"])
                assert status == 201, got
                assert (await call("POST", "/sandboxes", {"templateID": "base"}, key=KEY))[0] == 201
                # the paused quota holds at the gateway across the fleet: here only Redis has it
                # (the node's own copy says unlimited), so the 429 is the gateway's (TEAM_PAUSE)
                await node_coord.set_team_quota(ids["a"], {"runningSandboxes": 2, "pausedSandboxes": 1})
                first, second = [s["sandboxID"] for s in (await call("GET", "/sandboxes", key=keys["a"]))[1]]
                assert (await call("POST", f"/sandboxes/{first}/pause", None, key=keys["a"]))[0] == 204
                status, got = await call("POST", f"/sandboxes/{second}/pause", None, key=keys["a"])
                assert status == 429 and "maximum number of paused sandboxes (1)" in got["message"], got
                assert await node_coord.team_paused_ids(ids["a"]) == {first}
                assert (await call("POST", f"/sandboxes/{first}/connect", {"timeout": 30}, key=keys["a"]))[0] == 201
                assert (await call("POST", f"/sandboxes/{second}/pause", None, key=keys["a"]))[0] == 204
                for key in (keys["a"], keys["b"], KEY):
                    for s in (await call("GET", "/v2/sandboxes?state=running,paused", key=key))[1]:
                        assert (await call("DELETE", f"/sandboxes/{s['sandboxID']}", key=key))[0] == 204
                assert (await call("DELETE", f"/admin/teams/{ids['a']}", admin=True))[0] == 204
                assert (await call("GET", "/teams", key=keys["a"]))[0] == 401
                assert (await call("GET", "/teams", key=keys["b"]))[0] == 200
        finally:
            await gateway.close()
            await node.close()
            await lifecycle.shutdown()
            await node_coord.close()
            doc.close()
            secrets_doc.close()
    asyncio.run(main())
