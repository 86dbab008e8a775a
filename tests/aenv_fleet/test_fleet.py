"""Issue 16's acceptance on a real 3-node fleet (cluster.py): 3 `aenv server` nodes in
their own network namespaces, a real redis-server, a moto S3 server as the shared
repository, 2 gateways; driven through the real e2b SDK at a gateway.

One fleet for the module (QEMU under TCG is slow): the tests run in file order and
the destructive ones (Redis restart, node SIGKILL, rejoin) come last.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from e2b import Sandbox, SandboxQuery

from aenv_wire.cluster import ClusterCode, adopt_path, release_path

from tests.guest_servers import GUEST_SERVER
from .cluster import GATEWAY_PORTS, LEASE, REPO, Fleet, http, make_fleet
from .redisserver import RedisServer
from tests.support import require

pytestmark = pytest.mark.timeout(3600)
TIMEOUT = 600


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require(os.geteuid() == 0 and shutil.which("ip") is not None, "the fleet tests need root and iproute2")
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86_64 not installed")
    require(shutil.which("redis-server") is not None, "redis-server not installed")
    f = make_fleet(tmp_path_factory.mktemp("fleet"))
    try:
        f.make_network()
        f.start_services()
        first, *rest = f.nodes
        f.start_node(first)              # builds the base template into the shared repository
        for n in rest:
            f.start_node(n, wait=False)  # the others find it there
        for n in rest:
            f.wait_node(n)
        for port in GATEWAY_PORTS:
            f.start_gateway(port)
        yield f
    finally:
        f.stop()


def gw(fleet: Fleet, i: int) -> dict[str, Any]:
    """SDK options for gateway ``i`` (0 or 1): API and sandbox traffic both go there."""
    url = fleet.gateways[i].url
    return {"api_key": fleet.api_key, "api_url": url, "sandbox_url": url, "request_timeout": TIMEOUT}


def binding_node(fleet: Fleet, sid: str) -> str:
    assert fleet.redis is not None
    r = fleet.redis.client()
    try:
        return r.hget(f"aenv:sbx:{sid}", "node") or ""
    finally:
        r.close()


def nodes_of(fleet: Fleet, i: int = 0) -> dict[str, dict[str, Any]]:
    status, _, body = http("GET", fleet.gateways[i].url + "/nodes", key=fleet.api_key)
    assert status == 200, body
    return {n["nodeID"]: n for n in body}


def aenv(fleet: Fleet, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update(PYTHONPATH=str(REPO), E2B_API_KEY=fleet.api_key, AENV_GATEWAY_URL=fleet.gateways[0].url)
    return subprocess.run([sys.executable, "-m", "aenv_cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


def wait_committed(fleet: Fleet, sid: str, timeout: float = 300) -> None:
    """Until the pause of ``sid`` is in the shared repository (its node commits it in the
    background): its catalog record ``paused-<id>`` (docs/store-format.md)."""
    import boto3
    from botocore.exceptions import ClientError

    from tests.aenv_store.backends.motoserver import ACCESS_KEY, REGION, SECRET_KEY

    assert fleet.moto is not None
    s3 = boto3.client("s3", endpoint_url=fleet.moto.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=SECRET_KEY)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                s3.head_object(Bucket=fleet.bucket, Key=f"repo/catalog/paused-{sid}")
                return
            except ClientError:
                assert time.monotonic() < deadline, f"the pause of {sid} was not committed in {timeout} s"
                time.sleep(0.5)
    finally:
        s3.close()


def committed(fleet: Fleet, sid: str) -> bool:
    import boto3
    from botocore.exceptions import ClientError

    from tests.aenv_store.backends.motoserver import ACCESS_KEY, REGION, SECRET_KEY

    assert fleet.moto is not None
    s3 = boto3.client("s3", endpoint_url=fleet.moto.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=SECRET_KEY)
    try:
        s3.head_object(Bucket=fleet.bucket, Key=f"repo/catalog/paused-{sid}")
        return True
    except ClientError:
        return False
    finally:
        s3.close()


def kill_all(fleet: Fleet, sandboxes: list[Sandbox]) -> None:
    for s in sandboxes:
        Sandbox.kill(s.sandbox_id, **gw(fleet, 0))


# --- registry, placement, routing -----------------------------------------------------------


def test_nodes_registered_with_capacity(fleet: Fleet) -> None:
    for i in (0, 1):
        nodes = nodes_of(fleet, i)
        assert sorted(nodes) == ["node1", "node2", "node3"]
        for n in nodes.values():
            assert n["alive"] and not n["drained"] and n["maxSandboxes"] == fleet.max_sandboxes
            assert n["freeSlots"] == fleet.max_sandboxes and n["memTotalMiB"] > 0 and n["vcpus"] >= 1
            assert "base" in n["templates"] and n["url"].startswith(f"http://{fleet.prefix}1")
    out = aenv(fleet, "cluster", "nodes")
    assert out.returncode == 0 and all(f"node{i}" in out.stdout for i in (1, 2, 3)), out.stderr
    # the gateway checks the deployment's key itself
    assert http("GET", fleet.gateways[0].url + "/nodes", key="wrong")[0] == 401
    assert http("POST", fleet.gateways[0].url + "/nodes/nope/drain", {}, key=fleet.api_key)[0] == 404
    bad = aenv(fleet, "cluster", "drain", "nope")
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_creates_spread_and_every_call_works_through_either_gateway(fleet: Fleet) -> None:
    made = [Sandbox.create("base", metadata={"suite": "spread", "n": str(i)}, timeout=TIMEOUT, **gw(fleet, i % 2))
            for i in range(6)]
    try:
        placed = [binding_node(fleet, s.sandbox_id) for s in made]
        assert sorted(placed.count(n) for n in ("node1", "node2", "node3")) == [2, 2, 2], placed
        for i, s in enumerate(made):
            # on the gateway that created it
            assert s.commands.run(f"echo made-{i}").stdout.strip() == f"made-{i}"
            s.files.write("/tmp/who", f"sandbox {i}")
            # and through the other one, connected by id
            other = Sandbox.connect(s.sandbox_id, **gw(fleet, 1 - i % 2))
            assert other.files.read("/tmp/who") == f"sandbox {i}"
            assert other.commands.run("cat /tmp/who").stdout == f"sandbox {i}"
            info = other.get_info()
            assert info.sandbox_id == s.sandbox_id and info.metadata["n"] == str(i)
            other.set_timeout(TIMEOUT)
        # a signed file URL names no sandbox: the gateway finds the node that knows its signature
        url = made[0].download_url("/tmp/who", use_signature_expiration=120)
        assert url.startswith(fleet.gateways[0].url + "/files?") and made[0].sandbox_id not in url
        with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
            assert r.read() == b"sandbox 0"
        forged = url.replace("signature=", "signature=x")
        assert http("GET", forged)[0] in (400, 401, 404)
        counts = nodes_of(fleet, 1)
        assert sum(n["maxSandboxes"] - n["freeSlots"] for n in counts.values()) == 6
    finally:
        kill_all(fleet, made)
    for s in made:
        assert binding_node(fleet, s.sandbox_id) == ""
    left = Sandbox.list(query=SandboxQuery(metadata={"suite": "spread"}), **gw(fleet, 1)).next_items()
    assert left == []


def test_list_paginates_across_nodes(fleet: Fleet) -> None:
    made = [Sandbox.create("base", metadata={"suite": "list"}, timeout=TIMEOUT, **gw(fleet, 0)) for _ in range(4)]
    # a create retried with its Idempotency-Key, through the other gateway: the same sandbox
    made.append(Sandbox.create("base", metadata={"suite": "list"}, timeout=TIMEOUT, idempotency_key="fleet-k1",
                               **gw(fleet, 0)))
    again = Sandbox.create("base", metadata={"suite": "list"}, timeout=TIMEOUT, idempotency_key="fleet-k1",
                           **gw(fleet, 1))
    assert again.sandbox_id == made[-1].sandbox_id
    try:
        assert len({binding_node(fleet, s.sandbox_id) for s in made}) == 3
        for i in (0, 1):
            pager = Sandbox.list(query=SandboxQuery(metadata={"suite": "list"}), limit=2, **gw(fleet, i))
            pages = []
            while pager.has_next:
                pages.append([s.sandbox_id for s in pager.next_items()])
            assert [len(p) for p in pages][:2] == [2, 2] and sum(map(len, pages)) == 5
            ids = [x for p in pages for x in p]
            assert sorted(ids) == sorted(s.sandbox_id for s in made)   # each once
        status, headers, body = http("GET", fleet.gateways[0].url + "/v2/sandboxes?limit=3&order=asc",
                                     key=fleet.api_key)
        assert status == 200 and len(body) == 3 and headers.get("X-Next-Token")
        stamps = [b["startedAt"] for b in body]
        assert stamps == sorted(stamps)
        assert http("GET", fleet.gateways[0].url + "/v2/sandboxes?nextToken=bogus", key=fleet.api_key)[0] == 400
        assert http("GET", fleet.gateways[0].url + "/v2/sandboxes?limit=0", key=fleet.api_key)[0] == 400
    finally:
        kill_all(fleet, made)


def test_the_gateways_dashboard_shows_each_sandboxs_node_and_drains_one(fleet: Fleet, tmp_path: Path) -> None:
    """The dashboard a gateway serves (docs/dashboard.md), in Debian's Chromium, on the real
    fleet: each sandbox's row names the node running it (E2B's clientID), the nodes page
    shows the three nodes and drains one, and the gateway agrees."""
    from tests.dashboard.browser import launched, new_session, screenshot

    made = [Sandbox.create("base", metadata={"suite": "dash"}, timeout=TIMEOUT, **gw(fleet, i % 2)) for i in range(3)]
    try:
        where = {s.sandbox_id: binding_node(fleet, s.sandbox_id) for s in made}
        assert len(set(where.values())) == 3, where
        status, _, body = http("GET", fleet.gateways[1].url + "/v2/sandboxes?metadata=suite%3Ddash", key=fleet.api_key)
        assert status == 200 and {b["sandboxID"]: b["clientID"] for b in body} == where
        for sid, node in where.items():       # a sandbox's detail, relayed from its node, says so too
            assert http("GET", f"{fleet.gateways[0].url}/sandboxes/{sid}", key=fleet.api_key)[2]["clientID"] == node
        with launched() as browser:
            session = new_session(browser, fleet.gateways[0].url)
            page = session.page
            page.on("dialog", lambda d: d.accept())
            session.login(fleet.api_key)
            for sid, node in where.items():
                row = page.wait_for_selector(f'.vrow[data-id="{sid}"]')
                assert row is not None and node in row.inner_text(), (sid, node)
            session.open("/nodes")
            page.wait_for_selector('button.node-op[data-node="node3"]')
            assert page.locator("#fleet-nodes tbody tr").count() == 3
            page.click('button.node-op[data-node="node3"]')          # Drain (confirmed)
            page.wait_for_selector('button.node-op[data-node="node3"]:text-is("Undrain")')
            assert [n for n, v in nodes_of(fleet, 1).items() if v["drained"]] == ["node3"]
            screenshot(session, "fleet-nodes", tmp_path)
            page.click('button.node-op[data-node="node3"]')          # Undrain
            page.wait_for_selector('button.node-op[data-node="node3"]:text-is("Drain")')
            assert not any(v["drained"] for v in nodes_of(fleet, 1).values())
            page.context.close()
            assert not session.errors, session.errors
            assert session.requests and not session.foreign_requests(), session.foreign_requests()
    finally:
        kill_all(fleet, made)


def test_sandbox_ports_sse_and_websocket_through_the_gateway(fleet: Fleet) -> None:
    """A guest port's plain HTTP, SSE (flushed event by event) and a WebSocket session,
    each through both gateways; a WebSocket to a port nothing listens on is the node's
    HTTP refusal, not an accepted socket."""
    import asyncio

    import aiohttp

    s = Sandbox.create("base", metadata={"suite": "ports"}, timeout=TIMEOUT, **gw(fleet, 0))
    try:
        s.files.write("/tmp/guest_server.py", GUEST_SERVER)
        s.commands.run("python3 /tmp/guest_server.py", background=True)
        hdr = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8080"}

        async def through(url: str) -> None:
            async with aiohttp.ClientSession() as session:
                deadline = time.monotonic() + 90
                while True:
                    async with session.get(url + "/echo", headers=hdr) as r:
                        if r.status == 200 or time.monotonic() > deadline:
                            assert r.status == 200, await r.text()
                            break
                    await asyncio.sleep(0.5)
                arrivals = []
                async with session.get(url + "/sse", headers=hdr) as r:
                    async for line in r.content:
                        if line.startswith(b"data:"):
                            arrivals.append((time.monotonic(), line.strip()))
                assert [x for _, x in arrivals] == [b"data: 0", b"data: 1", b"data: 2"]
                assert arrivals[-1][0] - arrivals[0][0] > 1.0, "SSE events were buffered on the way"
                async with session.ws_connect(url + "/ws", headers=hdr) as ws:
                    await ws.send_str("through " + url)
                    msg = await ws.receive(timeout=60)
                    assert msg.type == aiohttp.WSMsgType.TEXT and msg.data == "echo:through " + url
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(url + "/ws", headers={**hdr, "E2b-Sandbox-Port": "8099"})
                assert refused.value.status == 502

        for i in (0, 1):
            asyncio.run(through(fleet.gateways[i].url))
    finally:
        kill_all(fleet, [s])


def test_guests_cannot_reach_the_fleet_services(fleet: Fleet) -> None:
    # nor the test's own namespace (host_ip): a listener there is tried with the rest
    listener = fleet.listen_on_host_link()
    with contextlib.ExitStack() as stack:
        stack.callback(listener.close)
        bound = [listener.getsockname()[1]]
        s = Sandbox.create("base", timeout=TIMEOUT, **gw(fleet, 0))
        stack.callback(kill_all, fleet, [s])
        hub = fleet.hub_ip
        targets = " ".join([f"{hub}:6379", f"{hub}:9000", f"{hub}:8081", *(f"{n.addr}:8000" for n in fleet.nodes),
                            f"{fleet.host_ip}:{bound[0]}"])
        probe = (f"for t in {targets}; do h=${{t%:*}}; p=${{t#*:}}; if timeout 3 bash -c \"</dev/tcp/$h/$p\" "
                 "2>/dev/null; then echo open $t; else echo closed $t; fi; done")
        out = s.commands.run(probe, timeout=120).stdout
        assert out.count("closed") == 7 and "open" not in out, out


# --- trust (issue 29: docs/cluster.md "Trust") ---------------------------------------------


def test_an_open_redis_or_no_credential_is_refused_at_start(fleet: Fleet) -> None:
    """A node and a gateway against a Redis that takes commands without a password (or
    configured with none) do not start: a message naming the setting, a non-zero exit,
    no traceback, nothing written to that Redis. Run in the hub's namespace (``in_hub``),
    before any VM (the check is the first thing a node does after reading its secrets)."""
    open_redis = fleet.in_hub(lambda: RedisServer.start(fleet.root / "open-redis", host=fleet.hub_ip, port=6390,
                                                        password=None))
    try:
        data = fleet.root / "refused-node"
        data.mkdir(exist_ok=True)
        (data / "redis-password").write_text("a-password-the-redis-ignores\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update(PYTHONPATH=str(REPO), AENV_API_KEY=fleet.api_key, AENV_ENVD_SECRET=fleet.envd_secret)
        cluster = {"AENV_CLUSTER__REDIS_URL": open_redis.bare_url,
                   "AENV_CLUSTER__ADVERTISE_URL": f"http://{fleet.hub_ip}:8999",
                   "AENV_CLUSTER__FLEET_SECRET_FILE": str(fleet.fleet_secret_file)}
        node = [sys.executable, "-m", "aenv_cli.main", "server", "--data-dir", str(data), "--port", "0"]
        for extra, needle in (({}, "cluster.redis_password_file is required"),
                              ({"AENV_CLUSTER__REDIS_PASSWORD_FILE": "redis-password"}, "without a password")):
            out = fleet.in_hub(lambda: subprocess.run(node, cwd=REPO, env={**env, **cluster, **extra},
                                                      capture_output=True, text=True, timeout=300))
            assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
            assert needle in out.stderr and "cluster.insecure_redis" in out.stderr, out.stderr[-3000:]
        gateway = [sys.executable, "-m", "aenv_cli.main", "gateway", "--data-dir", str(data), "--port", "0",
                   "--host", fleet.hub_ip, "--redis-url", open_redis.bare_url]
        gw_env = {**env, "AENV_GATEWAY__FLEET_SECRET_FILE": str(fleet.fleet_secret_file),
                  "AENV_GATEWAY__REDIS_PASSWORD_FILE": "redis-password"}
        out = fleet.in_hub(lambda: subprocess.run(gateway, cwd=REPO, env=gw_env, capture_output=True, text=True,
                                                  timeout=120))
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert "without a password" in out.stderr and "gateway.insecure_redis" in out.stderr, out.stderr[-3000:]
        r = open_redis.client()
        try:
            assert r.keys("aenv:*") == []       # refused before anything was written
        finally:
            r.close()
    finally:
        open_redis.stop()


def test_a_forged_node_url_in_redis_redirects_nothing(fleet: Fleet) -> None:
    """A stranger with Redis' password but not the fleet secret rewrites a node's URL (its
    plain field, over and over, and its signed copy) and adds a node of its own with room
    for 1000 sandboxes, all pointing at a listener of its own: through either gateway,
    every call still reaches the real nodes, creates land on real nodes, and the
    listener sees no connection."""
    listener = fleet.listen_on_host_link()
    listener.setblocking(False)
    forged = f"http://{fleet.host_ip}:{listener.getsockname()[1]}"
    stranger = fleet.redis.client() if fleet.redis is not None else None
    assert stranger is not None
    s = Sandbox.create("base", metadata={"suite": "forged"}, timeout=TIMEOUT, **gw(fleet, 0))
    made = [s]
    victim = binding_node(fleet, s.sandbox_id)
    stop = threading.Event()

    def forge() -> None:
        copy_forged_at = 0.0
        while not stop.is_set():
            stranger.hset(f"aenv:node:{victim}", "url", forged)
            if time.monotonic() - copy_forged_at > 3:   # now and then the signed copy too, its signature kept
                rec = json.loads(stranger.hget(f"aenv:node:{victim}", "rec") or "{}")
                stranger.hset(f"aenv:node:{victim}", "rec", json.dumps({**rec, "url": forged}))
                copy_forged_at = time.monotonic()
            stranger.zadd("aenv:nodes", {"node9": time.time() * 1000 + 600_000})
            stranger.zadd("aenv:free", {"node9": 1000})
            stranger.hset("aenv:node:node9", mapping={
                "url": forged, "state": "up", "max_sandboxes": 1000, "vcpus": 64, "mem_total_mib": 1 << 20,
                "mem_avail_mib": 1 << 20, "sandbox_mem_mib": 256, "disk_free_mib": 1 << 20, "drained": 0})
            stop.wait(0.05)

    t = threading.Thread(target=forge)
    t.start()
    try:
        time.sleep(3)       # the gateways' views have been refreshed with the forgeries
        for i in (0, 1):
            c = Sandbox.connect(s.sandbox_id, **gw(fleet, i))
            assert c.commands.run("echo real").stdout.strip() == "real"
            c.files.write("/home/user/forged.txt", f"through gateway {i}")
            assert c.files.read("/home/user/forged.txt") == f"through gateway {i}"
            assert Sandbox.get_info(s.sandbox_id, **gw(fleet, i)).sandbox_id == s.sandbox_id
            n = Sandbox.create("base", metadata={"suite": "forged"}, timeout=TIMEOUT, **gw(fleet, i))
            made.append(n)
            assert binding_node(fleet, n.sandbox_id) in ("node1", "node2", "node3")
            assert n.commands.run("echo new").stdout.strip() == "new"
        assert sorted(nodes_of(fleet)) == ["node1", "node2", "node3"]
        with pytest.raises(BlockingIOError):
            listener.accept()       # nobody was sent there
        logs = "".join(g.log.read_text(errors="replace") for g in fleet.gateways)
        assert "not signed with the fleet secret" in logs or "not what the node signed" in logs
    finally:
        stop.set()
        t.join(timeout=30)
        stranger.zrem("aenv:nodes", "node9")
        stranger.zrem("aenv:free", "node9")
        stranger.delete("aenv:node:node9", "aenv:node:node9:resv", "aenv:node:node9:sbx")
        stranger.close()
        listener.close()
        kill_all(fleet, made)
    # the node's next heartbeat put its own record back: nothing of the forgery stays
    time.sleep(2)
    assert nodes_of(fleet)[victim]["url"].startswith(f"http://{fleet.prefix}1")


def test_a_client_api_key_cannot_call_the_cluster_routes(fleet: Fleet) -> None:
    """On a node directly and through a gateway: 403 with E2B's JSON error body, the
    sandbox untouched."""
    s = Sandbox.create("base", timeout=TIMEOUT, **gw(fleet, 0))
    try:
        s.pause()
        victim = next(n for n in fleet.nodes if n.node_id == binding_node(fleet, s.sandbox_id))
        path = release_path(s.sandbox_id)
        for url in (victim.url, fleet.gateways[0].url):
            status, _, body = http("POST", url + path, key=fleet.api_key)
            assert status == 403 and body["code"] == 403 and "message" in body, body
        status, _, body = http("POST", fleet.nodes[0].url + adopt_path(s.sandbox_id), key=fleet.api_key)
        assert status == 403 and body["code"] == 403, body
        assert binding_node(fleet, s.sandbox_id) == victim.node_id
        assert Sandbox.connect(s.sandbox_id, **gw(fleet, 1)).commands.run("echo on").stdout.strip() == "on"
    finally:
        kill_all(fleet, [s])


# --- faults ---------------------------------------------------------------------------------


def test_gateway_sigkill_mid_traffic_leaves_the_other_unaffected(fleet: Fleet) -> None:
    s = Sandbox.create("base", metadata={"suite": "gwkill"}, timeout=TIMEOUT, **gw(fleet, 1))
    failures: list[str] = []
    calls = [0]
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                assert s.commands.run("echo ok").stdout.strip() == "ok"
                Sandbox.list(query=SandboxQuery(metadata={"suite": "gwkill"}), **gw(fleet, 1)).next_items()
                Sandbox.get_info(s.sandbox_id, **gw(fleet, 1))
                calls[0] += 3
            except Exception as e:     # every failure counts: the assertion is that there are none
                failures.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=traffic)
    t.start()
    try:
        time.sleep(3)
        victim = fleet.gateways[0]
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        before = calls[0]
        deadline = time.monotonic() + 30
        while calls[0] < before + 12 and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop.set()
        t.join(timeout=TIMEOUT)
    try:
        assert failures == [] and calls[0] >= 12, (failures, calls)
        fleet.start_gateway(GATEWAY_PORTS[0])
        assert Sandbox.connect(s.sandbox_id, **gw(fleet, 0)).commands.run("echo back").stdout.strip() == "back"
    finally:
        kill_all(fleet, [s])


def test_redis_restart_loses_nothing(fleet: Fleet) -> None:
    made = [Sandbox.create("base", metadata={"suite": "redis"}, timeout=TIMEOUT, **gw(fleet, i % 2))
            for i in range(3)]
    assert fleet.redis is not None
    r = fleet.redis.client()
    try:
        def state() -> dict[str, Any]:
            return {"bindings": {s.sandbox_id: r.hget(f"aenv:sbx:{s.sandbox_id}", "node") for s in made},
                    "keys": sorted(r.smembers("aenv:apikeys")),
                    "nodes": sorted(r.zrange("aenv:nodes", 0, -1)),
                    "sets": {n: sorted(r.smembers(f"aenv:node:{n}:sbx")) for n in ("node1", "node2", "node3")}}
        before = state()
        assert all(before["bindings"].values()) and before["keys"]
        fleet.in_hub(fleet.redis.restart)          # SIGKILL, then a start from the AOF
        assert state() == before
        # the fleet carries on: nodes heartbeat again, gateways route and list
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(n["alive"] for n in nodes_of(fleet).values()):
            time.sleep(0.5)
        assert all(n["alive"] for n in nodes_of(fleet).values())
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "redis"}), **gw(fleet, 1)).next_items()
        assert sorted(x.sandbox_id for x in listed) == sorted(s.sandbox_id for s in made)
        for s in made:
            assert Sandbox.connect(s.sandbox_id, **gw(fleet, 0)).commands.run("echo up").stdout.strip() == "up"
    finally:
        r.close()
        kill_all(fleet, made)


# --- cross-node lifecycle -------------------------------------------------------------------


def test_pause_then_drain_migrate_then_connect_resumes_on_another_node(fleet: Fleet) -> None:
    s = Sandbox.create("base", metadata={"suite": "move"}, timeout=TIMEOUT, **gw(fleet, 0))
    old = binding_node(fleet, s.sandbox_id)
    others: list[Sandbox] = []
    try:
        # written then renamed: a pause between ``>``'s truncation and the write would
        # otherwise leave the file empty for the resumed guest's first read
        s.commands.run("nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; "
                       "mv /tmp/counter.new /tmp/counter; sleep 0.2; done' "
                       ">/dev/null 2>&1 &")
        s.commands.run("until [ -s /tmp/counter ]; do sleep 0.1; done", timeout=60)   # counting before the pause
        s.files.write("/home/user/keep.txt", "kept across nodes")
        s.pause()
        # a running sandbox on the same node: drain --migrate pauses it too
        _drain_others(fleet, old, True)
        try:
            others.append(Sandbox.create("base", metadata={"suite": "move"}, timeout=TIMEOUT, **gw(fleet, 1)))
        finally:
            _drain_others(fleet, old, False)
        assert binding_node(fleet, others[0].sandbox_id) == old
        out = aenv(fleet, "cluster", "drain", old, "--migrate")
        assert out.returncode == 0, out.stderr + out.stdout
        assert "migrated 2" in out.stdout
        assert binding_node(fleet, s.sandbox_id) == "" and binding_node(fleet, others[0].sandbox_id) == ""
        assert nodes_of(fleet)[old]["drained"] and nodes_of(fleet)[old]["freeSlots"] is None
        listed = {x.sandbox_id: x.state.value for x in
                  Sandbox.list(query=SandboxQuery(metadata={"suite": "move"}), **gw(fleet, 1)).next_items()}
        assert listed == {s.sandbox_id: "paused", others[0].sandbox_id: "paused"}
        c = Sandbox.connect(s.sandbox_id, **gw(fleet, 1))
        new = binding_node(fleet, s.sandbox_id)
        assert new and new != old
        assert c.files.read("/home/user/keep.txt") == "kept across nodes"
        n1 = int(c.commands.run("cat /tmp/counter").stdout)
        time.sleep(1.5)
        assert int(c.commands.run("cat /tmp/counter").stdout) > n1      # the process runs on
        # a released sandbox killed without a connect: a node adopts and kills it, so its
        # pause record leaves the shared repository too
        wait_committed(fleet, others[0].sandbox_id)
        Sandbox.kill(others[0].sandbox_id, **gw(fleet, 0))
        assert binding_node(fleet, others[0].sandbox_id) == ""
        assert not committed(fleet, others[0].sandbox_id)
        others.clear()
    finally:
        aenv(fleet, "cluster", "undrain", old)
        kill_all(fleet, [s, *others])
    assert not nodes_of(fleet)[old]["drained"]


def _drain_others(fleet: Fleet, keep: str, drained: bool) -> None:
    for n in ("node1", "node2", "node3"):
        if n != keep:
            status, _, body = http("POST", fleet.gateways[0].url + f"/nodes/{n}/{'drain' if drained else 'undrain'}",
                                   {}, key=fleet.api_key)
            assert status == 200, body


def test_fork_of_24_across_nodes_children_diverge(fleet: Fleet) -> None:
    parent = Sandbox.create("base", metadata={"suite": "fork"}, timeout=TIMEOUT, **gw(fleet, 0))
    kids: list[Any] = []
    try:
        parent.files.write("/home/user/fork.txt", "from the parent")
        kids = list(parent.fork(count=20, timeout=TIMEOUT)) + list(
            Sandbox.fork(parent.sandbox_id, count=4, timeout=TIMEOUT, **gw(fleet, 1)))
        failed = [k for k in kids if not isinstance(k, Sandbox)]
        assert not failed, failed
        assert len(kids) == 24 and len({k.sandbox_id for k in kids}) == 24
        where = [binding_node(fleet, k.sandbox_id) for k in kids]
        assert len(set(where)) >= 2, where
        assert where.count(binding_node(fleet, parent.sandbox_id)) <= 16
        for k in kids:
            assert k.files.read("/home/user/fork.txt") == "from the parent"
            k.files.write("/home/user/fork.txt", k.sandbox_id)
        for k in kids:
            assert k.commands.run("cat /home/user/fork.txt").stdout == k.sandbox_id
        assert parent.files.read("/home/user/fork.txt") == "from the parent"
    finally:
        kill_all(fleet, [k for k in kids if isinstance(k, Sandbox)] + [parent])


# --- node failure and rejoin (last: they change the fleet) ----------------------------------


class CopyWatch:
    """Samples every 0.25 s the QEMUs of a sandbox on the machine (every node of the fleet
    is here) and how many of them run its guest: not stopped (SIGSTOP: the fence
    keeper's freeze), past their first 2 s (a QEMU's own start-up), and using CPU over the
    last second (a standby QEMU waiting for a device state, which a node keeps after a
    pause, runs no guest and is idle; the guest's counting loop keeps a running one
    busy). The fencing invariant is that no sample finds two."""

    WINDOW = 1.0

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.most_running = 0
        self.samples: list[tuple[float, int, int]] = []
        self._cpu: dict[int, list[tuple[float, int]]] = {}
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def qemus(self) -> dict[int, tuple[str, int, float]]:
        """pid -> (state, CPU ticks, age in seconds) of each QEMU of the sandbox."""
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if stat[stat.index("(") + 1:stat.rindex(")")].startswith("qemu-system") and self.sid.encode() in cmd:
                f = stat[stat.rindex(")") + 2:].split()
                found[int(entry.name)] = (f[0], int(f[11]) + int(f[12]), uptime - int(f[19]) / self._tick)
        return found

    def copies(self) -> tuple[int, int]:
        """(QEMUs of the sandbox, those not stopped)."""
        q = self.qemus()
        return len(q), sum(st != "T" for st, _, _ in q.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            q = self.qemus()
            running = 0
            for pid, (st, cpu, age) in q.items():
                hist = self._cpu.setdefault(pid, [])
                hist.append((now, cpu))
                old = [c for t, c in hist if t <= now - self.WINDOW]
                if st != "T" and age > 2.0 and old and cpu > old[-1]:
                    running += 1
            self.samples.append((now, len(q), running))
            self.most_running = max(self.most_running, running)
            time.sleep(0.25)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _counting_on(fleet: Fleet, node: str) -> tuple[Sandbox, int]:
    """A sandbox on ``node`` that counts in /tmp/counter, paused once (committed), then
    resumed there: its pause record says it runs on that node. Returns it and a count
    read after the resume."""
    deadline = time.monotonic() + 60        # placeable again (a test before may have cut it off)
    while not (nodes_of(fleet)[node]["alive"] and nodes_of(fleet)[node]["freeSlots"]):
        assert time.monotonic() < deadline, f"{node} is not placeable: {nodes_of(fleet)[node]}"
        time.sleep(0.5)
    _drain_others(fleet, node, True)
    try:
        s = Sandbox.create("base", metadata={"suite": "fence"}, timeout=TIMEOUT, **gw(fleet, 0))
    finally:
        _drain_others(fleet, node, False)
    assert binding_node(fleet, s.sandbox_id) == node
    s.commands.run("nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; "
                   "mv /tmp/counter.new /tmp/counter; sleep 0.2; done' >/dev/null 2>&1 &")
    s.commands.run("until [ -s /tmp/counter ]; do sleep 0.1; done", timeout=60)
    s.pause()
    wait_committed(fleet, s.sandbox_id)
    s = Sandbox.connect(s.sandbox_id, timeout=TIMEOUT, **gw(fleet, 0))
    assert binding_node(fleet, s.sandbox_id) == node
    time.sleep(1.0)
    return s, int(s.commands.run("cat /tmp/counter").stdout)


def _wait_alive(fleet: Fleet, node: str, alive: bool, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while nodes_of(fleet)[node]["alive"] != alive:
        assert time.monotonic() < deadline, f"{node} did not become {'alive' if alive else 'expired'} in {timeout} s"
        time.sleep(0.2)


def test_a_node_cut_off_from_redis_fences_itself_and_its_sandbox_moves_with_its_latest_state(fleet: Fleet) -> None:
    """Issue 29, acceptance 2: node A loses Redis (its packets to Redis dropped in its
    namespace) while a sandbox counts there. A pauses it itself before its lease ends; a
    client's connect through a gateway adopts that pause on another node, so the count
    goes on from A's latest state, never from the older pause; at no moment do two
    copies run. Once Redis is back, A drops its stale copy."""
    a = fleet.nodes[0]
    assert fleet.redis is not None
    s, before = _counting_on(fleet, a.node_id)
    watch = CopyWatch(s.sandbox_id)
    nft = ["ip", "netns", "exec", a.ns, "nft"]
    subprocess.run([*nft, "add", "table", "inet", "aenvfence"], check=True)
    try:
        subprocess.run([*nft, "add", "chain", "inet", "aenvfence", "out",
                        "{ type filter hook output priority 0 ; }"], check=True)
        subprocess.run([*nft, "add", "rule", "inet", "aenvfence", "out", "ip", "daddr", fleet.hub_ip,
                        "tcp", "dport", "6379", "drop"], check=True)
        _wait_alive(fleet, a.node_id, False, 30)
        c = Sandbox.connect(s.sandbox_id, timeout=TIMEOUT, **gw(fleet, 1))
        moved_to = binding_node(fleet, s.sandbox_id)
        assert moved_to not in ("", a.node_id)
        after = int(c.commands.run("cat /tmp/counter").stdout)
        assert after > before, f"the count went back from {before} to {after}: an older pause was resumed"
        assert "fencing" in a.log.read_text()
    finally:
        subprocess.run([*nft, "delete", "table", "inet", "aenvfence"], check=False)
        watch.stop()
    assert watch.most_running == 1, [x for x in watch.samples if x[2] > 1][:5]
    _wait_alive(fleet, a.node_id, True, 120)
    deadline = time.monotonic() + 120
    while s.sandbox_id in {x["sandboxID"] for x in http("GET", a.url + "/v2/sandboxes", key=fleet.api_key)[2]}:
        assert time.monotonic() < deadline, "the partitioned node kept its stale copy"
        time.sleep(1)
    assert binding_node(fleet, s.sandbox_id) == moved_to
    assert int(c.commands.run("cat /tmp/counter").stdout) > after
    Sandbox.kill(s.sandbox_id, **gw(fleet, 0))


def test_a_node_whose_loop_stalls_past_its_lease_keeps_its_sandbox_and_no_second_copy_runs(fleet: Fleet) -> None:
    """Issue 29, acceptance 2, the stall: node A's server is stopped (SIGSTOP) past its
    lease while a sandbox counts there. A's fence keeper freezes the guest; a client's
    connect through a gateway waits while the adopting node waits for A's self-fence;
    A comes back, reclaims the sandbox and the connect lands on A, the count going on
    from A's state. No second copy ever starts."""
    a = fleet.nodes[0]
    assert a.proc is not None
    s, before = _counting_on(fleet, a.node_id)
    watch = CopyWatch(s.sandbox_id)
    connected: list[Any] = []
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        _wait_alive(fleet, a.node_id, False, 30)
        deadline = time.monotonic() + 10
        while watch.copies()[1] != 0:     # the keeper froze the guest (and a standby if any)
            assert time.monotonic() < deadline, f"the guest was not frozen: {watch.copies()}"
            time.sleep(0.1)

        def connect() -> None:
            try:
                connected.append(Sandbox.connect(s.sandbox_id, timeout=TIMEOUT, **gw(fleet, 1)))
            except Exception as e:      # noqa: BLE001 -- checked below
                connected.append(e)
        t = threading.Thread(target=connect)
        t.start()
        time.sleep(3.0)         # the adopter waits for A's self-fence (2 leases)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    t.join(120)
    watch.stop()
    assert connected and isinstance(connected[0], Sandbox), connected
    assert binding_node(fleet, s.sandbox_id) == a.node_id
    after = int(connected[0].commands.run("cat /tmp/counter").stdout)
    assert after > before, f"the count went back from {before} to {after}"
    assert watch.most_running == 1, [x for x in watch.samples if x[2] > 1][:5]
    assert "frozen" in a.log.read_text() and "thawed" in a.log.read_text()
    Sandbox.kill(s.sandbox_id, **gw(fleet, 0))


def test_node_sigkill_paused_resume_elsewhere_running_reported_lost(fleet: Fleet) -> None:
    victim = fleet.nodes[2]
    _drain_others(fleet, victim.node_id, True)
    try:
        paused = Sandbox.create("base", metadata={"suite": "kill"}, timeout=TIMEOUT, **gw(fleet, 0))
        running = Sandbox.create("base", metadata={"suite": "kill"}, timeout=TIMEOUT, **gw(fleet, 0))
    finally:
        _drain_others(fleet, victim.node_id, False)
    fleet.state["killed"] = (paused.sandbox_id, running.sandbox_id)
    assert {binding_node(fleet, paused.sandbox_id), binding_node(fleet, running.sandbox_id)} == {victim.node_id}
    paused.files.write("/home/user/before.txt", "before the crash")
    paused.pause()
    wait_committed(fleet, paused.sandbox_id)    # the host dies after its pause reached the repository
    fleet.sigkill_node(victim)
    t0 = time.monotonic()
    while nodes_of(fleet)[victim.node_id]["alive"]:
        assert time.monotonic() - t0 < LEASE + 5, "the lease did not expire"
        time.sleep(0.2)
    time.sleep(1.5)     # a gateway sweep marks it expired
    listed = {x.sandbox_id: x.state.value for x in
              Sandbox.list(query=SandboxQuery(metadata={"suite": "kill"}), **gw(fleet, 1)).next_items()}
    assert listed == {paused.sandbox_id: "paused"}
    status, headers, body = http("GET", fleet.gateways[0].url + "/v2/sandboxes?state=lost", key=fleet.api_key)
    assert status == 200 and victim.node_id in headers.get("X-Aenv-Down-Nodes", "")
    lost = {x["sandboxID"]: x for x in body}
    assert running.sandbox_id in lost and victim.node_id in lost[running.sandbox_id]["note"]
    status, _, body = http("GET", fleet.gateways[1].url + f"/sandboxes/{running.sandbox_id}", key=fleet.api_key)
    assert status == 410 and body["state"] == "lost" and body["error_code"] == ClusterCode.LOST, body
    assert http("GET", fleet.gateways[1].url + f"/sandboxes/{paused.sandbox_id}", key=fleet.api_key)[0] == 200
    c = Sandbox.connect(paused.sandbox_id, **gw(fleet, 1))
    assert binding_node(fleet, paused.sandbox_id) not in ("", victim.node_id)
    assert c.files.read("/home/user/before.txt") == "before the crash"


def test_node_rejoin_reconciles(fleet: Fleet) -> None:
    victim = fleet.nodes[2]
    paused_id, running_id = fleet.state["killed"]
    moved_to = binding_node(fleet, paused_id)
    fleet.start_node(victim)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, _, mine = http("GET", victim.url + "/v2/sandboxes", key=fleet.api_key)
        if status == 200 and paused_id not in {x["sandboxID"] for x in mine}:
            break
        time.sleep(1)
    assert paused_id not in {x["sandboxID"] for x in mine}     # its stale copy was released
    assert binding_node(fleet, paused_id) == moved_to             # the fleet's choice stands
    got = [x.sandbox_id for x in Sandbox.list(query=SandboxQuery(metadata={"suite": "kill"}),
                                              **gw(fleet, 0)).next_items()]
    assert got == [paused_id]
    assert Sandbox.connect(paused_id, **gw(fleet, 0)).commands.run("echo one").stdout.strip() == "one"
    for sid in (paused_id, running_id):
        Sandbox.kill(sid, **gw(fleet, 0))


def test_nothing_leaks_and_repository_verifies(fleet: Fleet) -> None:
    for s in Sandbox.list(**gw(fleet, 0)).next_items():
        Sandbox.kill(s.sandbox_id, **gw(fleet, 0))
    assert fleet.redis is not None
    r = fleet.redis.client()
    try:
        assert r.keys("aenv:sbx:*") == [] and r.smembers("aenv:released") == set()
        for n in ("node1", "node2", "node3"):
            assert r.smembers(f"aenv:node:{n}:sbx") == set() and r.zcard(f"aenv:node:{n}:resv") == 0
    finally:
        r.close()
    cfg = fleet.root / "verify.toml"
    cfg.write_text((fleet.nodes[0].data_dir / "config.toml").read_text().split("[vm]")[0])
    out = aenv(fleet, "--data-dir", str(fleet.root / "verify-data"), "--config", str(cfg), "repo", "verify")
    assert out.returncode == 0, out.stdout + out.stderr
