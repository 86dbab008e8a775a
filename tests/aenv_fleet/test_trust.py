"""The fleet's trust without VMs (aenv_fleet/trust.py, docs/cluster.md "Trust"), on real
redis-server processes (an open one, one with requirepass, one on TLS only):

* a node or gateway refuses an open Redis, and a missing credential, with a message
  naming the setting; ``insecure_redis`` lets a development fleet run; a wrong
  password is refused as such; TLS with the CA file works;
* node records: what a stranger with Redis' password but not the fleet secret writes
  (a URL, a lease) is ignored, by the coordinator and by a gateway's view, which keeps
  the node's last signed record;
* an in-process gateway (aenv_fleet's ``Gateway``) in front of a node's real
  ``ApiServer``: a forged URL redirects nothing, the gateway's own calls to the
  cluster routes carry a credential the node takes, and a client cannot reach those
  routes through the gateway;
* `aenv gateway` against an open Redis: a message and a non-zero exit, no traceback.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import pytest

from aenv_api.server.app import ApiServer
from aenv_api.server.auth import Credentials
from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_api.server.settings import ServerConfig
from aenv_fleet.config import ClusterConfig, GatewayConfig
from aenv_fleet.coord import Capacity, Coordinator
from aenv_fleet.gateway.app import Gateway
from aenv_fleet.gateway.state import FleetView
from aenv_fleet.trust import RedisTrustError, check_fleet_redis, cluster_trust, gateway_trust
from aenv_store.errors import ConfigError
from aenv_wire.fleet_auth import FleetKeys

from tests.aenv_api.server.test_cluster_auth import Holding
from .redisserver import RedisServer

REPO = Path(__file__).resolve().parents[2]
SECRET = "trust-test-fleet-secret-0123456789"
KEY = "e2b_" + "1" * 40


@pytest.fixture(scope="module")
def open_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer.start(tmp_path_factory.mktemp("open-redis"), password=None)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer.start(tmp_path_factory.mktemp("tls-redis"), tls=True)
    try:
        yield srv
    finally:
        srv.stop()


def files(tmp_path: Path, srv: RedisServer | None = None) -> dict[str, str]:
    (tmp_path / "fleet-secret").write_text(SECRET + "\n")
    out = {"fleet_secret_file": "fleet-secret"}      # relative: in the data dir
    if srv is not None and srv.password:
        srv.write_password(tmp_path / "redis-password")
        out["redis_password_file"] = str(tmp_path / "redis-password")
    return out


def node_config(srv: RedisServer, **kw: Any) -> ClusterConfig:
    extra = {"redis_ca_file": str(srv.ca_file)} if srv.ca_file else {}
    return ClusterConfig(redis_url=srv.bare_url, node_id="n1", advertise_url="http://127.0.0.1:1", **extra, **kw)


# --- settings ------------------------------------------------------------------------------


def test_missing_secrets_are_refused_naming_the_setting(tmp_path: Path, redis_server: RedisServer) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.fleet_secret_file is required"):
        cluster_trust(node_config(redis_server), tmp_path)
    f = files(tmp_path)
    with pytest.raises(ConfigError, match=r"cluster\.redis_password_file is required.*cluster\.insecure_redis"):
        cluster_trust(node_config(redis_server, **f), tmp_path)
    gw = GatewayConfig(redis_url=redis_server.bare_url, **f)
    with pytest.raises(ConfigError, match=r"gateway\.redis_password_file is required"):
        gateway_trust(gw, tmp_path)
    with pytest.raises(ConfigError, match=r"cluster\.fleet_secret_file: .*at least 16"):
        (tmp_path / "short").write_text("short\n")
        cluster_trust(node_config(redis_server, fleet_secret_file="short", insecure_redis=True), tmp_path)
    with pytest.raises(ConfigError, match=r"cluster\.redis_password_file: cannot read"):
        cluster_trust(node_config(redis_server, redis_password_file="nope", **f), tmp_path)
    with pytest.raises(ConfigError, match="set one"):
        both = files(tmp_path, redis_server)
        cluster_trust(ClusterConfig(redis_url=redis_server.url, advertise_url="http://n:1", **both), tmp_path)
    with pytest.raises(ConfigError, match=r"cluster\.redis_ca_file is for TLS"):
        cluster_trust(ClusterConfig(redis_url="redis://x:1/0", advertise_url="http://n:1", redis_ca_file="ca.pem",
                                    insecure_redis=True, **f), tmp_path)
    # the password in the URL is a credential too
    t = cluster_trust(ClusterConfig(redis_url=redis_server.url, advertise_url="http://n:1", **f), tmp_path)
    assert t.redis.password == redis_server.password and "password" not in repr(t)


def test_an_open_redis_is_refused_unless_the_fleet_says_it_is_a_development_one(
        tmp_path: Path, open_redis: RedisServer) -> None:
    f = files(tmp_path)
    trust = cluster_trust(node_config(open_redis, redis_password_file="", insecure_redis=True, **f), tmp_path)
    assert asyncio.run(check_fleet_redis(trust))
    # a password configured does not make an open Redis safe: it still takes anyone's commands
    (tmp_path / "pw").write_text("whatever-password\n")
    trust = cluster_trust(node_config(open_redis, redis_password_file="pw", **f), tmp_path)
    with pytest.raises(RedisTrustError, match=r"without a password.*cluster\.insecure_redis = true"):
        asyncio.run(check_fleet_redis(trust))


def test_the_right_password_is_taken_a_wrong_one_refused(tmp_path: Path, redis_server: RedisServer) -> None:
    f = files(tmp_path, redis_server)
    assert asyncio.run(check_fleet_redis(cluster_trust(node_config(redis_server, **f), tmp_path)))
    (tmp_path / "redis-password").write_text("not-the-password\n")
    with pytest.raises(RedisTrustError, match=r"refused this cluster's credential.*cluster\.redis_password_file"):
        asyncio.run(check_fleet_redis(cluster_trust(node_config(redis_server, **f), tmp_path)))


def test_an_unreachable_redis_is_checked_later_not_passed(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]       # nothing listens there once closed
    f = files(tmp_path)
    (tmp_path / "pw").write_text("pw-of-nothing\n")
    cfg = ClusterConfig(redis_url=f"redis://127.0.0.1:{port}/0", advertise_url="http://n:1",
                        redis_password_file="pw", **f)
    assert asyncio.run(check_fleet_redis(cluster_trust(cfg, tmp_path))) is False


def test_tls_with_the_ca_file(tmp_path: Path, tls_redis: RedisServer) -> None:
    assert tls_redis.bare_url.startswith("rediss://")
    trust = cluster_trust(node_config(tls_redis, **files(tmp_path, tls_redis)), tmp_path)

    async def main() -> None:
        assert await check_fleet_redis(trust)
        c = Coordinator(trust.redis_url, trust.keys, trust.redis)
        try:
            await c.heartbeat("n1", cap("http://10.0.0.1:8000"), 30)
            assert [(n.node_id, n.url, n.trusted) for n in await c.nodes()] == [("n1", "http://10.0.0.1:8000", True)]
        finally:
            await c.close()
    asyncio.run(main())
    # the certificate names 127.0.0.1: dialled as "localhost", or checked against the
    # system's CAs instead of the fleet's, it is refused as such (not retried as unreachable)
    named = cluster_trust(ClusterConfig(redis_url=tls_redis.bare_url.replace("127.0.0.1", "localhost"),
                                        advertise_url="http://n:1", redis_ca_file=str(tls_redis.ca_file),
                                        **files(tmp_path, tls_redis)), tmp_path)
    with pytest.raises(RedisTrustError, match=r"TLS certificate is not trusted.*cluster\.redis_ca_file"):
        asyncio.run(check_fleet_redis(named))
    system_cas = cluster_trust(ClusterConfig(redis_url=tls_redis.bare_url, advertise_url="http://n:1",
                                             **files(tmp_path, tls_redis)), tmp_path)
    with pytest.raises(RedisTrustError, match="TLS certificate is not trusted"):
        asyncio.run(check_fleet_redis(system_cas))


# --- signed node records -------------------------------------------------------------------


def cap(url: str) -> Capacity:
    return Capacity(url=url, max_sandboxes=4, vcpus=2, mem_total_mib=4096, mem_avail_mib=4096, disk_free_mib=10_000,
                    sandbox_mem_mib=256, running=0, paused=1)


def test_a_strangers_record_is_ignored_and_a_gateway_keeps_the_signed_one(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    stranger = redis_server.client()        # the password, not the fleet secret
    stranger.flushall()

    async def main() -> None:
        node = Coordinator(redis_server.url, FleetKeys.parse(SECRET))
        gw = Coordinator(redis_server.url, FleetKeys.parse(SECRET))
        view = FleetView(gw)
        try:
            await node.heartbeat("n1", cap("http://10.0.0.1:8000"), 5)
            await view.refresh()
            assert view.url("n1") == "http://10.0.0.1:8000" and view.is_alive("n1")
            signed_deadline = view.nodes["n1"].lease_deadline

            # a forged URL in the plain field: the node's signed copy is what is read
            stranger.hset("aenv:node:n1", "url", "http://198.51.100.66:8000")
            [rec] = await gw.nodes()
            assert rec.trusted and rec.url == "http://10.0.0.1:8000" and rec.alive
            # a forged URL in the signed copy (the signature kept): the record says nothing ...
            signed = json.loads(stranger.hget("aenv:node:n1", "rec") or "")
            stranger.hset("aenv:node:n1", "rec", json.dumps({**signed, "url": "http://198.51.100.66:8000"}))
            [rec] = await gw.nodes()
            assert not rec.trusted and rec.url == "" and not rec.alive
            await view.refresh()
            assert view.url("n1") == "http://10.0.0.1:8000" and view.is_alive("n1")   # ... the signed one stays

            # a forged record of a node never seen signed: not in the view at all
            stranger.zadd("aenv:nodes", {"n9": time.time() * 1000 + 600_000})
            stranger.hset("aenv:node:n9", mapping={"url": "http://198.51.100.66:8000", "sig": "00" * 32})
            await view.refresh()
            assert "n9" not in view.nodes and "n9" not in {n.node_id for n in view.alive()}

            # the node signs again: its record is good; a stranger extending its lease extends nothing
            await node.heartbeat("n1", cap("http://10.0.0.1:8000"), 5)
            stranger.zadd("aenv:nodes", {"n1": time.time() * 1000 + 3_600_000})
            await view.refresh()
            assert view.nodes["n1"].trusted and view.nodes["n1"].lease_deadline < time.time() + 6
            assert view.nodes["n1"].lease_deadline >= signed_deadline

            # a node signing with another fleet's secret is no member of this one
            other = Coordinator(redis_server.url, FleetKeys.parse("another-fleets-secret-9876543210"))
            await other.heartbeat("n2", cap("http://10.0.0.2:8000"), 5)
            await other.close()
            await view.refresh()
            assert "n2" not in view.nodes
        finally:
            await node.close()
            await gw.close()
    try:
        asyncio.run(main())
    finally:
        stranger.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "aenv_fleet.coord"]
    assert any("'n1'" in m and "not what the node signed" in m for m in logged), logged      # the plain url
    assert any("'n1'" in m and "not signed with the fleet secret" in m for m in logged), logged  # the copy
    assert any("'n9'" in m for m in logged) and any("'n2'" in m for m in logged), logged


def test_a_gateway_judges_leases_as_of_its_last_read_of_them(redis_server: RedisServer) -> None:
    """A gateway whose refreshes run late (its loop busy) does not take a live node for a
    dead one: a lease whose end passed after the gateway last read it may have been
    renewed since. Once a read finds it not renewed, the node is dead."""
    redis_server.client().flushall()

    async def main() -> None:
        node = Coordinator(redis_server.url, FleetKeys.parse(SECRET))
        gw = Coordinator(redis_server.url, FleetKeys.parse(SECRET))
        view = FleetView(gw)
        try:
            await node.heartbeat("n1", cap("http://10.0.0.1:8000"), 1.0)
            await view.refresh()
            await asyncio.sleep(1.3)        # the lease's end passes; the node renews, unread yet
            await node.heartbeat("n1", cap("http://10.0.0.1:8000"), 1.0)
            assert view.nodes["n1"].lease_deadline < time.time()
            assert view.is_alive("n1") and [n.node_id for n in view.alive()] == ["n1"]
            await view.refresh()
            assert view.is_alive("n1")
            await asyncio.sleep(1.3)        # no renewal this time
            assert view.is_alive("n1")      # not read since: it may have renewed
            await view.refresh()
            assert not view.is_alive("n1") and view.alive() == []
            # back (it renews before it answers anything): the view is behind until its next
            # refresh, so a gateway about to answer "unreachable" or "lost" reads it again
            await node.heartbeat("n1", cap("http://10.0.0.1:8000"), 5.0)
            assert not view.is_alive("n1") and await view.alive_now("n1") and view.is_alive("n1")
        finally:
            await node.close()
            await gw.close()
    asyncio.run(main())


# --- a gateway in front of a node's API ----------------------------------------------------


class Stranger:
    """A TCP listener a forged URL points at: it only counts who connects."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1


def test_through_a_gateway_a_forged_url_redirects_nothing_and_clients_get_no_cluster_route(
        tmp_path: Path, redis_server: RedisServer) -> None:
    stranger_redis = redis_server.client()
    stranger_redis.flushall()
    stranger = Stranger()
    trust = gateway_trust(GatewayConfig(redis_url=redis_server.bare_url, **files(tmp_path, redis_server)), tmp_path)

    async def main() -> None:
        config = ServerConfig(port=0)
        metrics = Metrics()
        service = Holding()
        lifecycle = Lifecycle(service, config, metrics, tmp_path / "node")    # type: ignore[arg-type]
        await lifecycle.start()
        node = ApiServer(lifecycle, Credentials(KEY, "env", b"s" * 32), config, metrics, "test",
                         fleet_keys=trust.keys)
        node_port = await node.start("127.0.0.1", 0)
        node_url = f"http://127.0.0.1:{node_port}"
        agent = Coordinator(trust.redis_url, trust.keys, trust.redis)     # the node's side of Redis
        await agent.add_api_key(KEY)
        await agent.heartbeat("n1", cap(node_url), 30)
        await agent.bind("sbx-1", "n1", "paused", {"templateID": "tpl-1"})
        gateway = Gateway(GatewayConfig(redis_url=redis_server.bare_url), trust)
        gw_port = await gateway.start("127.0.0.1", 0)
        gw = f"http://127.0.0.1:{gw_port}"
        try:
            assert gateway.fleet.url("n1") == node_url
            forged = f"http://127.0.0.1:{stranger.port}"
            stranger_redis.hset("aenv:node:n1", "url", forged)
            await gateway.fleet.refresh()
            assert gateway.fleet.url("n1") == node_url
            signed = json.loads(stranger_redis.hget("aenv:node:n1", "rec") or "")
            stranger_redis.hset("aenv:node:n1", "rec", json.dumps({**signed, "url": forged}))
            await gateway.fleet.refresh()
            async with aiohttp.ClientSession(headers={"X-API-Key": KEY}) as http:
                async with http.get(f"{gw}/sandboxes/sbx-1") as r:     # reaches the real node
                    assert r.status == 200 and (await r.json())["sandboxID"] == "sbx-1"
                async with http.post(f"{gw}/_aenv/cluster/sandboxes/sbx-1/release") as r:
                    assert r.status == 403 and "clients" in (await r.json())["message"]
                async with http.post(f"{gw}//_aenv/cluster/sandboxes/sbx-1/release") as r:
                    assert r.status == 403
                assert service.released == []
                # the gateway's own call of a cluster route (drain --migrate: release) is taken
                async with http.post(f"{gw}/nodes/n1/drain", json={"migrate": True}) as r:
                    body = await r.json()
                    assert r.status == 200 and body["migrated"] == ["sbx-1"], body
                assert service.released == ["sbx-1"]
            assert stranger.connections() == 0
        finally:
            await gateway.close()
            await agent.close()
            await node.close()
    try:
        asyncio.run(main())
    finally:
        stranger.sock.close()
        stranger_redis.close()


# --- the CLI --------------------------------------------------------------------------------


def test_aenv_gateway_refuses_an_open_redis_with_a_message(tmp_path: Path, open_redis: RedisServer) -> None:
    files(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update(PYTHONPATH=str(REPO), AENV_GATEWAY__FLEET_SECRET_FILE="fleet-secret")
    base = [sys.executable, "-m", "aenv_cli.main", "gateway", "--data-dir", str(tmp_path), "--port", "0",
            "--redis-url", open_redis.bare_url]
    out = subprocess.run(base, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "gateway.redis_password_file is required" in out.stderr and "gateway.insecure_redis" in out.stderr
    (tmp_path / "pw").write_text("a-password-the-redis-ignores\n")
    env["AENV_GATEWAY__REDIS_PASSWORD_FILE"] = "pw"
    out = subprocess.run(base, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "answers commands without a password" in out.stderr and "gateway.insecure_redis" in out.stderr


def test_a_gateway_reaches_nodes_over_tls_checked_with_its_node_ca(tmp_path: Path, redis_server: RedisServer) -> None:
    """Gateway -> node over TLS: a node serving its API on ``[server] tls_cert`` and
    advertising ``https://``, a gateway given the CA of the nodes' certificates
    (``[gateway] node_ca_file``) reaches it; one that trusts only the system's CAs does
    not (the API key never goes to a node it cannot verify)."""
    from tests.tlsca import TestCa

    ca = TestCa("aenv test node CA")
    issued = ca.issue("127.0.0.1")
    (tmp_path / "node.pem").write_bytes(issued.cert_pem)
    (tmp_path / "node.key").write_bytes(issued.key_pem)
    (tmp_path / "node-ca.pem").write_bytes(ca.pem)
    base = dict(redis_url=redis_server.bare_url, **files(tmp_path, redis_server))
    verifying = gateway_trust(GatewayConfig(**base, node_ca_file="node-ca.pem"), tmp_path)
    system_only = gateway_trust(GatewayConfig(**base), tmp_path)
    redis_server.client().flushall()

    async def main() -> None:
        config = ServerConfig(port=0, tls_cert=str(tmp_path / "node.pem"), tls_key=str(tmp_path / "node.key"),
                              tls_port=0)
        metrics = Metrics()
        lifecycle = Lifecycle(Holding(), config, metrics, tmp_path / "node")    # type: ignore[arg-type]
        await lifecycle.start()
        node = ApiServer(lifecycle, Credentials(KEY, "env", b"s" * 32), config, metrics, "test",
                         fleet_keys=verifying.keys)
        await node.start("127.0.0.1", 0)
        agent = Coordinator(verifying.redis_url, verifying.keys, verifying.redis)
        await agent.add_api_key(KEY)
        await agent.heartbeat("n1", cap(f"https://127.0.0.1:{node.tls_port}"), 30)
        await agent.bind("sbx-1", "n1", "paused", {"templateID": "tpl-1"})
        gateways = []
        try:
            for trust in (verifying, system_only):
                gateway = Gateway(GatewayConfig(redis_url=redis_server.bare_url), trust)
                gateways.append(gateway)
                gw = f"http://127.0.0.1:{await gateway.start('127.0.0.1', 0)}"
                async with aiohttp.ClientSession(headers={"X-API-Key": KEY}) as http:
                    async with http.get(f"{gw}/sandboxes/sbx-1") as r:
                        body = await r.json()
                        if trust is verifying:
                            assert r.status == 200 and body["sandboxID"] == "sbx-1", body
                        else:
                            assert r.status == 502 and "certificate" in body["message"].lower(), body
        finally:
            for g in gateways:
                await g.close()
            await agent.close()
            await node.close()
    asyncio.run(main())
