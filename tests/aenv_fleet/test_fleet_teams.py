"""Teams across a real fleet (cluster.py: two `aenv server` nodes in their own network
namespaces, a password- and TLS-protected redis-server, a moto S3 repository, one
gateway; the real e2b SDK at the gateway). Team A's key, made through node 1, works on
node 2 and at the gateway; team B's key neither sees, connects to, pauses, snapshots,
forks nor kills A's sandbox through the gateway (404, as an id that does not exist);
A's named snapshot is A's on every node (its record names its team);
a deleted key fails on every node and at the gateway within the bound docs/cluster.md
states; no key is in clear in Redis or in any log.

One fleet for the module (QEMU under TCG is slow); the tests run in file order."""
from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest
from e2b import Sandbox

from .cluster import GATEWAY_PORTS, Fleet, make_fleet
from tests.support import require

pytestmark = pytest.mark.timeout(3600)
ADMIN = "fleet-teams-admin-" + "q" * 16
BOUND = 2.0         # docs/cluster.md: a deleted key fails everywhere within this (seconds)
TIMEOUT = 600


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require(os.geteuid() == 0 and shutil.which("ip") is not None, "the fleet tests need root and iproute2")
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86_64 not installed")
    require(shutil.which("redis-server") is not None, "redis-server not installed")
    f = make_fleet(tmp_path_factory.mktemp("fleetteams"))
    f.admin_token = ADMIN
    try:
        f.make_network()
        f.start_services()
        first, second = f.nodes[:2]      # two nodes are enough: the third stays unstarted
        f.start_node(first)              # builds the base template into the shared repository
        f.start_node(second)
        f.start_gateway(GATEWAY_PORTS[0])
        yield f
    finally:
        f.stop()


def call(method: str, url: str, body: Any = None, key: str | None = None, admin: bool = False,
         team: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["X-API-Key"] = key
    if admin:
        headers["X-Admin-Token"] = ADMIN
    if team:
        headers["X-Team-ID"] = team
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw


def redis_text(r: Any) -> bytes:
    """Every key and value in Redis, read by type (DUMP would compress long strings)."""
    out = bytearray()
    for k in r.scan_iter("*"):
        kind = r.type(k)
        out += k
        if kind == b"hash":
            out += b"".join(a + b for a, b in r.hgetall(k).items())
        elif kind == b"string":
            out += r.get(k) or b""
        elif kind == b"set":
            out += b"".join(r.smembers(k))
        elif kind == b"zset":
            out += b"".join(m for m, _ in r.zrange(k, 0, -1, withscores=True))
        elif kind == b"stream":
            out += b"".join(a + b for _, fields in r.xrange(k) for a, b in fields.items())
    return bytes(out)


def sdk(fleet: Fleet, key: str) -> dict[str, Any]:
    url = fleet.gateways[0].url
    return {"api_key": key, "api_url": url, "sandbox_url": url, "request_timeout": TIMEOUT}


def test_a_key_made_on_one_node_works_on_the_other_and_at_the_gateway(fleet: Fleet) -> None:
    n1, n2, gw = fleet.nodes[0].url, fleet.nodes[1].url, fleet.gateways[0].url
    status, team_a = call("POST", n1 + "/admin/teams", {"name": "fleet-a"}, admin=True)
    assert status == 201, team_a
    status, key_a = call("POST", n1 + f"/admin/teams/{team_a['teamID']}/api-keys", {"name": "a1"}, admin=True)
    assert status == 201, key_a
    # at once, on the other node and at the gateway (a key they do not know makes them read Redis)
    for url in (n2, gw, n1):
        status, teams = call("GET", url + "/teams", key=key_a["key"])
        assert status == 200 and teams[0]["teamID"] == team_a["teamID"], (url, teams)
    # team B made through the gateway (its admin routes: any node answers, the node checks the credential)
    status, team_b = call("POST", gw + "/admin/teams", {"name": "fleet-b"}, admin=True)
    assert status == 201, team_b
    status, key_b = call("POST", gw + "/api-keys", {"name": "b1"}, admin=True, team=team_b["teamID"])
    assert status == 201, key_b
    assert call("GET", n1 + "/teams", key=key_b["key"])[1][0]["teamID"] == team_b["teamID"]
    assert call("POST", gw + "/admin/teams", {"name": "x"})[0] == 401          # no credential
    assert call("GET", gw + "/admin/teams", key=fleet.api_key)[0] == 401       # a key is no admin credential
    status, a2 = call("POST", n2 + "/api-keys", {"name": "a2"}, key=key_a["key"])     # a team's own key makes keys
    assert status == 201, a2
    assert sorted(k["name"] for k in call("GET", gw + "/api-keys", key=a2["key"])[1]) == ["a1", "a2"]
    assert call("GET", gw + "/teams", key="e2b_" + "0" * 40)[0] == 401
    fleet.state.update(team_a=team_a["teamID"], key_a=key_a["key"], key_a_id=key_a["id"], key_a2=a2["key"],
                       team_b=team_b["teamID"], key_b=key_b["key"])


def test_another_teams_sandbox_is_unknown_through_the_gateway(fleet: Fleet) -> None:
    gw, st = fleet.gateways[0].url, fleet.state
    a = Sandbox.create(metadata={"team": "a"}, timeout=600, **sdk(fleet, st["key_a"]))
    st["sandbox"] = sid = a.sandbox_id
    assert a.commands.run("echo team-a").stdout.strip() == "team-a"
    r = fleet.redis.client()    # type: ignore[union-attr]
    try:
        assert json.loads(r.hget(f"aenv:sbx:{sid}", "info"))["teamID"] == st["team_a"]
    finally:
        r.close()
    assert [s.sandbox_id for s in Sandbox.list(**sdk(fleet, st["key_a"])).next_items()] == [sid]
    # team B: nothing of it, whichever route; the same answer as an id that does not exist
    kb = st["key_b"]
    assert Sandbox.list(**sdk(fleet, kb)).next_items() == []
    assert call("GET", gw + "/v2/sandboxes?state=running,paused", key=kb) == (200, [])
    for method, path, body in (("GET", "/sandboxes/{}", None), ("POST", "/sandboxes/{}/connect", {"timeout": 60}),
                               ("POST", "/sandboxes/{}/resume", {"timeout": 60}),
                               ("POST", "/sandboxes/{}/pause", None), ("POST", "/sandboxes/{}/fork", {"count": 1}),
                               ("POST", "/sandboxes/{}/snapshots", {}), ("POST", "/sandboxes/{}/timeout",
                                                                          {"timeout": 30}),
                               ("DELETE", "/sandboxes/{}", None)):
        status, got = call(method, gw + path.format(sid), body, key=kb)
        assert status == 404, (method, path, got)
    from e2b import NotFoundException
    with pytest.raises(NotFoundException):
        Sandbox.connect(sid, **sdk(fleet, kb))
    assert Sandbox.kill(sid, **sdk(fleet, kb)) is False
    # the default team (the deployment key) is another team too
    assert call("GET", gw + f"/sandboxes/{sid}", key=fleet.api_key)[0] == 404
    # a team's key is not the operator's: the fleet's own routes are the deployment key's
    assert call("GET", gw + "/nodes", key=kb)[0] == 403
    # A's sandbox lived through it, reachable from A's other key through the gateway
    again = Sandbox.connect(sid, **sdk(fleet, st["key_a2"]))
    assert again.commands.run("echo still").stdout.strip() == "still"
    # the admin cannot delete a team that holds a sandbox anywhere in the fleet
    status, got = call("DELETE", gw + f"/admin/teams/{st['team_a']}", admin=True)
    assert status == 409 and "sandbox" in got["message"], got
    status, counts = call("GET", gw + "/admin/sandboxes/running-counts", admin=True)
    assert status == 200 and any(c["teamID"] == st["team_a"] and c["runningSandboxes"] == 1
                                  for c in counts["teams"]), counts


def test_a_teams_snapshot_is_its_own_on_every_node(fleet: Fleet) -> None:
    """A named snapshot's team is in its record in the shared repository: every node lists
    it to its team only, and a create from it, placed on any node, is its team's alone."""
    gw, st = fleet.gateways[0].url, fleet.state
    ka, kb = st["key_a"], st["key_b"]
    a = Sandbox.connect(st["sandbox"], **sdk(fleet, ka))
    a.files.write("/home/user/team.txt", "team a's")
    status, snap = call("POST", gw + f"/sandboxes/{a.sandbox_id}/snapshots", {"name": "fleet-a-snap"}, key=ka)
    assert status == 201, snap
    sid = snap["snapshotID"]
    try:
        for url in (fleet.nodes[0].url, fleet.nodes[1].url, gw):
            assert [x["snapshotID"] for x in call("GET", url + "/snapshots", key=ka)[1]] == [sid], url
            for key in (kb, fleet.api_key):      # team B, and the default team
                assert call("GET", url + "/snapshots", key=key) == (200, []), url
                for ref in (sid, "fleet-a-snap"):
                    status, got = call("POST", url + "/v2/sandboxes", {"templateID": ref}, key=key)
                    assert status == 404, (url, got)
                assert call("DELETE", url + f"/templates/{sid}", key=key)[0] == 404, url
        c = Sandbox.create("fleet-a-snap", timeout=TIMEOUT, **sdk(fleet, ka))
        try:
            assert c.files.read("/home/user/team.txt") == "team a's"
        finally:
            c.kill()
    finally:
        assert call("DELETE", gw + f"/templates/{sid}", key=ka)[0] == 204


def test_a_teams_volume_through_the_gateway_is_mounted_on_its_node_and_only_for_it(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Volumes through the gateway with the real SDK (``E2B_VOLUME_API_URL`` = the
    gateway): team A makes one (the gateway places it on a node and records it), writes
    it through the content routes, and a sandbox that mounts it, placed on the volume's
    node, reads it; team B neither sees it nor mounts it (404)."""
    from e2b import Volume
    from e2b.exceptions import NotFoundException as SdkNotFound

    gw, st = fleet.gateways[0].url, fleet.state
    monkeypatch.setenv("E2B_VOLUME_API_URL", gw)
    conn = {"api_key": st["key_a"], "api_url": gw, "request_timeout": TIMEOUT}
    vol = Volume.create("fleet-team-a-data", **conn)
    try:
        r = fleet.redis.client()    # type: ignore[union-attr]
        try:
            where = r.hget(f"aenv:vol:{vol.volume_id}", "node")
        finally:
            r.close()
        assert where in (fleet.nodes[0].node_id, fleet.nodes[1].node_id)
        vol.write_file("/hello.txt", "from team a, through the gateway")
        s = Sandbox.create(volume_mounts={"/mnt/data": vol.name}, timeout=600, **sdk(fleet, st["key_a"]))
        try:
            r = fleet.redis.client()    # type: ignore[union-attr]
            try:
                assert r.hget(f"aenv:sbx:{s.sandbox_id}", "node") == where
            finally:
                r.close()
            assert s.commands.run("cat /mnt/data/hello.txt").stdout == "from team a, through the gateway"
            s.commands.run("echo back > /mnt/data/back.txt")
            assert vol.read_file("/back.txt") == "back\n"
        finally:
            s.kill()
        kb = st["key_b"]
        assert [v.name for v in Volume.list(api_key=kb, api_url=gw, request_timeout=TIMEOUT)] == []
        with pytest.raises(SdkNotFound):
            Volume.get_info(vol.volume_id, api_key=kb, api_url=gw, request_timeout=TIMEOUT)
        status, got = call("POST", gw + "/sandboxes", {"templateID": "base", "volumeMounts": [
            {"name": vol.name, "path": "/mnt/data"}]}, key=kb)
        assert status == 404, got
    finally:
        assert Volume.destroy(vol.volume_id, **conn)


def test_a_teams_template_built_through_the_gateway_is_its_own(fleet: Fleet) -> None:
    """Team A builds a template through the gateway with the SDK's Template API (built on
    a node, committed to the shared repository with A's name on it): A creates from it,
    B can neither create nor build from it (as a template that does not exist)."""
    from e2b import Template

    gw, st = fleet.gateways[0].url, fleet.state
    conn_a = {"api_key": st["key_a"], "api_url": gw, "request_timeout": TIMEOUT}
    Template.build(Template().from_template("base").run_cmd("echo fleet-team-a > /home/user/made-by"),
                   "fleet-a-tpl", cpu_count=1, memory_mb=512, **conn_a)
    a = Sandbox.create("fleet-a-tpl", timeout=600, **sdk(fleet, st["key_a"]))
    try:
        assert a.files.read("/home/user/made-by").strip() == "fleet-team-a"
    finally:
        a.kill()
    with pytest.raises(Exception) as refused:
        Sandbox.create("fleet-a-tpl", timeout=600, **sdk(fleet, st["key_b"]))
    assert "404" in str(refused.value) or "not found" in str(refused.value).lower(), refused.value
    status, got = call("POST", gw + "/sandboxes", {"templateID": "fleet-a-tpl"}, key=st["key_b"])
    assert status == 404, got
    assert call("DELETE", gw + "/templates/fleet-a-tpl", key=st["key_b"])[0] == 404
    assert call("DELETE", gw + "/templates/fleet-a-tpl", key=st["key_a"])[0] == 204


def test_two_teams_through_the_npm_sdk_at_the_gateway(fleet: Fleet) -> None:
    """The npm SDK's two-team flow (tests/aenv_api/server/node/teams_flow.mjs) against the
    gateway: A creates, lists, forks, snapshots, pauses, connects and makes a volume; B
    sees none of it and gets "not found" wherever it names A's."""
    import subprocess

    from tests.aenv_api.server.test_sdk_teams import NODE_DIR

    require(shutil.which("node") is not None, "node is not installed (scripts/install.sh installs it)")
    require((NODE_DIR / "node_modules" / "e2b").is_dir(), "e2b npm package missing: run scripts/install.sh")
    gw, st = fleet.gateways[0].url, fleet.state
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=gw, E2B_SANDBOX_URL=gw, E2B_VOLUME_API_URL=gw, KEY_A=st["key_a"], KEY_B=st["key_b"])
    done = subprocess.run(["node", "teams_flow.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(got["aLists"]) >= 1 and got["bLists"] == [], got
    for what in ("bConnect", "bInfo", "bFork", "bSnapshot", "bFromSnapshot", "bVolumeInfo", "bResume"):
        assert got[what] == "not found", (what, got)
    assert got["bKill"] is False and got["bVolumes"] is False and got["aVolumes"] is True, got
    assert got["aFromSnapshot"] == got["aForked"] == got["aResumed"] == "from team a", got
    assert got["aPaused"] and got["bListsSnapshots"] == [] and got["aDeletesSnapshot"] is True, got


def test_a_deleted_key_fails_everywhere_within_the_bound(fleet: Fleet) -> None:
    st = fleet.state
    urls = [fleet.nodes[0].url, fleet.nodes[1].url, fleet.gateways[0].url]
    for u in urls:      # every node and the gateway has verified the key (and caches it)
        assert call("GET", u + "/teams", key=st["key_a"])[0] == 200
    t0 = time.monotonic()
    status, got = call("DELETE", fleet.nodes[1].url + f"/api-keys/{st['key_a_id']}", key=st["key_a2"])
    assert status == 204, got
    refused: dict[str, float] = {}
    while len(refused) < len(urls) and time.monotonic() - t0 < 10:
        for u in urls:
            if u not in refused and call("GET", u + "/teams", key=st["key_a"])[0] == 401:
                refused[u] = time.monotonic() - t0
        time.sleep(0.05)
    print(f"deleted key refused after (s): {refused}")
    assert len(refused) == len(urls) and max(refused.values()) <= BOUND, refused
    # and stays refused, on sandbox routes too
    assert call("GET", fleet.gateways[0].url + f"/sandboxes/{st['sandbox']}", key=st["key_a"])[0] == 401


def test_no_key_in_clear_in_redis_or_logs_and_the_team_goes(fleet: Fleet) -> None:
    st, gw = fleet.state, fleet.gateways[0].url
    assert Sandbox.kill(st["sandbox"], **sdk(fleet, st["key_a2"])) is True
    deadline = time.monotonic() + 30
    while call("DELETE", gw + f"/admin/teams/{st['team_a']}", admin=True)[0] != 204:
        assert time.monotonic() < deadline, "team A could not be deleted after its sandbox went"
        time.sleep(0.5)
    t0 = time.monotonic()       # the team's keys go with it, everywhere within the bound
    while any(call("GET", u + "/teams", key=st["key_a2"])[0] != 401
              for u in (fleet.nodes[0].url, fleet.nodes[1].url, gw)):
        assert time.monotonic() - t0 <= BOUND, "a deleted team's key still works"
        time.sleep(0.05)
    keys = [st["key_a"], st["key_a2"], st["key_b"]]
    r = fleet.redis.client(decode_responses=False)     # type: ignore[union-attr]
    try:
        dump = redis_text(r)
    finally:
        r.close()
    logs = b"".join(p.read_bytes() for p in [*(n.log for n in fleet.nodes if n.log.exists()),
                                             *(g.log for g in fleet.gateways)])
    aof = b"".join(p.read_bytes() for p in (fleet.root / "redis").rglob("*.aof*") if p.is_file())
    assert b"fleet-b" in dump and logs and aof
    for key in keys:
        for where, text in (("redis", dump), ("logs", logs), ("aof", aof)):
            assert key[4:].encode() not in text, f"a key in clear in {where}"
