"""Team quotas and team metrics through the API in-process (inprocess.py, a fake sandbox
service): the admin's quota routes and their 400s, a team at its running quota answered
E2B's 429 while another team's creates succeed (creates, forks, resumes, pauses), a real
burst held to a creates-per-second quota, the team metrics of what the test ran, and the
real e2b SDK's exception for a team over quota."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

from aenv_api.server.keystore import DEFAULT_TEAM_ID

from .conftest import use_sdk_env
from .inprocess import InProcessServer

ADMIN = "admin-" + "q" * 26
INTERVAL = 0.1      # the node's team metrics sample this often here (5 s by default)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("quotas"), admin_token=ADMIN, max_sandboxes=400,
                                server={"team_metrics_interval": INTERVAL})
    try:
        yield srv
    finally:
        srv.stop()


def admin(node: InProcessServer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, _, got = node.request(method, path, body, headers={"X-Admin-Token": ADMIN}, key=None)
    return status, got


def new_team(node: InProcessServer, name: str, **quota: Any) -> tuple[str, str]:
    status, team = admin(node, "POST", "/admin/teams", {"name": name})
    assert status == 201, team
    tid = team["teamID"]
    status, key = admin(node, "POST", f"/admin/teams/{tid}/api-keys", {"name": f"{name}-key"})
    assert status == 201, key
    if quota:
        status, got = admin(node, "PUT", f"/admin/teams/{tid}/quota", quota)
        assert status == 200, got
    return tid, key["key"]


def create(node: InProcessServer, key: str) -> tuple[int, dict[str, str], Any]:
    return node.request("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 300}, key=key)


def test_the_admin_sets_reads_and_clears_a_quota(node: InProcessServer) -> None:
    tid, key = new_team(node, "settings")
    path = f"/admin/teams/{tid}/quota"
    assert admin(node, "GET", path) == (200, {"runningSandboxes": None, "pausedSandboxes": None,
                                              "createsPerSecond": None, "concurrentBuilds": None,
                                              "volumeBytes": None, "snapshotBytes": None})
    status, got = admin(node, "PUT", path, {"runningSandboxes": 3, "createsPerSecond": 2.5, "concurrentBuilds": 0,
                                            "volumeBytes": 1 << 30, "snapshotBytes": 1 << 40})
    assert status == 200 and got == {"runningSandboxes": 3, "pausedSandboxes": None, "createsPerSecond": 2.5,
                                      "concurrentBuilds": 0, "volumeBytes": 1 << 30, "snapshotBytes": 1 << 40}
    assert admin(node, "GET", path)[1] == got
    status, teams = admin(node, "GET", "/admin/teams")
    assert next(t for t in teams if t["teamID"] == tid)["quota"] == got
    # refused, and nothing changed: bad values, unknown fields
    for bad, word in [({"snapshotBytes": -1}, "snapshotBytes"), ({"snapshotBytes": 0.5}, "snapshotBytes"),
                      ({"volumeBytes": -1}, "volumeBytes"), ({"volumeBytes": 1 << 61}, "volumeBytes"),
                      ({"runningSandboxes": -1}, "runningSandboxes"), ({"createsPerSecond": 0}, "createsPerSecond"),
                      ({"createsPerSecond": "fast"}, "createsPerSecond"), ({"running": 1}, "not a known field")]:
        status, err = admin(node, "PUT", path, bad)
        assert status == 400 and word in err["message"], (bad, err)
    assert admin(node, "GET", path)[1] == got
    assert admin(node, "PUT", "/admin/teams/no-such-team/quota", {})[0] == 404
    # a team's key is no admin credential
    assert node.request("PUT", path, {"runningSandboxes": 100}, key=key)[0] == 401
    assert admin(node, "PUT", path, {"volumeBytes": None})[1]["runningSandboxes"] is None   # all unlimited again


def test_a_teams_volumes_bounds_are_held_to_its_volume_bytes_quota(node: InProcessServer) -> None:
    """volumeBytes bounds the sum of the team's volumes' maxBytes: a volume past it is
    refused (507, nothing made), one without a byte bound too (400: this node's default is
    unbounded); deleting one makes room; concurrent creates never pass it; another team
    and the default team are not held."""
    mib = 1 << 20
    _, key_a = new_team(node, "vols", volumeBytes=10 * mib)
    _, key_b = new_team(node, "vols-free")

    def make(key: str, name: str, max_bytes: int | None) -> tuple[int, Any]:
        body: dict[str, Any] = {"name": name}
        if max_bytes is not None:
            body["maxBytes"] = max_bytes
        status, _, got = node.request("POST", "/volumes", body, key=key)
        return status, got

    def names(key: str) -> set[str]:
        return {v["name"] for v in node.request("GET", "/volumes", key=key)[2]}

    status, six = make(key_a, "qa-six", 6 * mib)
    assert status == 201, six
    status, err = make(key_a, "qa-five", 5 * mib)
    assert status == 507 and "volumeBytes" in err["message"] and str(6 * mib) in err["message"], err
    status, err = make(key_a, "qa-unbounded", None)
    assert status == 400 and "maxBytes" in err["message"], err
    assert make(key_a, "qa-four", 4 * mib)[0] == 201
    assert make(key_a, "qa-one-more", 1)[0] == 507
    assert names(key_a) == {"qa-six", "qa-four"}
    assert make(key_b, "qb-big", 1 << 40)[0] == 201 and make(key_b, "qb-unbounded", None)[0] == 201
    assert make(node.api_key, "q-default", 1 << 40)[0] == 201
    assert node.request("DELETE", f"/volumes/{six['volumeID']}", key=key_a)[0] == 204
    # 6 MiB free again; eight creates of 2 MiB at once: exactly three are made
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: make(key_a, f"qa-race-{i}", 2 * mib), range(8)))
    assert sorted(s for s, _ in got) == [201] * 3 + [507] * 5, got
    assert len(names(key_a)) == 4


def test_a_teams_snapshots_are_held_to_its_snapshot_bytes_quota(node: InProcessServer) -> None:
    """snapshotBytes bounds the sum of the team's named snapshots' own bytes (the fake's:
    its memory, 512 MiB each): one that does not fit is deleted again (507, not listed);
    at the quota none is taken; deleting one makes room; another team is not held."""
    mib = 1 << 20
    tid, key_a = new_team(node, "snaps", snapshotBytes=1200 * mib)
    _, key_b = new_team(node, "snaps-free")

    def snapshot(key: str, sid: str) -> tuple[int, Any]:
        status, _, got = node.request("POST", f"/sandboxes/{sid}/snapshots", {}, key=key)
        return status, got

    def listed(key: str) -> list[str]:
        return [s["snapshotID"] for s in node.request("GET", "/snapshots", key=key)[2]]

    sid = create(node, key_a)[2]["sandboxID"]
    made = [snapshot(key_a, sid) for _ in range(2)]
    assert [s for s, _ in made] == [201, 201], made
    status, err = snapshot(key_a, sid)          # 1 GiB held, < 1200 MiB: taken, does not fit, deleted
    assert status == 507 and "deleted again" in err["message"] and str(1024 * mib) in err["message"], err
    assert sorted(listed(key_a)) == sorted(m["snapshotID"] for _, m in made)
    assert admin(node, "PUT", f"/admin/teams/{tid}/quota", {"snapshotBytes": 1024 * mib})[0] == 200
    status, err = snapshot(key_a, sid)          # at the quota: refused before it is taken
    assert status == 507 and "deleted again" not in err["message"], err
    other = create(node, key_b)[2]["sandboxID"]
    assert all(snapshot(key_b, other)[0] == 201 for _ in range(3))
    assert node.request("DELETE", f"/templates/{made[0][1]['snapshotID']}", key=key_a)[0] == 204
    assert snapshot(key_a, sid)[0] == 201
    assert len(listed(key_a)) == 2


def test_a_team_at_its_running_quota_gets_429_while_another_creates(node: InProcessServer) -> None:
    _, key_a = new_team(node, "capped", runningSandboxes=2, pausedSandboxes=1)
    _, key_b = new_team(node, "free")
    first = [create(node, key_a)[2]["sandboxID"] for _ in range(2)]
    status, headers, body = create(node, key_a)
    assert status == 429, body
    assert body["code"] == 429 and body["message"].startswith(
        "You have reached the maximum number of concurrent E2B sandboxes (2).")
    assert headers["Should-Retry"] == "false" and headers["Retry-After"] == "5"
    assert all(create(node, key_b)[0] == 201 for _ in range(3))         # the other team is not held back
    assert create(node, node.api_key)[0] == 201                         # nor the default team
    # a fork of a team at its quota: no room for any child
    status, _, body = node.request("POST", f"/sandboxes/{first[0]}/fork", {"count": 2}, key=key_a)
    assert status == 429 and "concurrent E2B sandboxes (2)" in body["message"]
    # a pause frees a running place; the paused quota (1) holds the second pause
    assert node.request("POST", f"/sandboxes/{first[0]}/pause", {}, key=key_a)[0] == 204
    status, _, body = node.request("POST", f"/sandboxes/{first[1]}/pause", {}, key=key_a)
    assert status == 429 and "paused sandboxes (1)" in body["message"]
    third = create(node, key_a)[2]["sandboxID"]
    # at the running quota again: resuming the paused one is a start, refused
    status, _, body = node.request("POST", f"/sandboxes/{first[0]}/connect", {"timeout": 60}, key=key_a)
    assert status == 429 and "concurrent E2B sandboxes (2)" in body["message"]
    assert node.request("DELETE", f"/sandboxes/{third}", key=key_a)[0] == 204
    assert node.request("POST", f"/sandboxes/{first[0]}/connect", {"timeout": 60}, key=key_a)[0] == 201
    # a fork of 3 with room for none... and with room for one: one child, the others refused alone
    assert node.request("DELETE", f"/sandboxes/{first[1]}", key=key_a)[0] == 204
    status, _, kids = node.request("POST", f"/sandboxes/{first[0]}/fork", {"count": 3}, key=key_a)
    assert status == 201 and ["sandbox" in k for k in kids] == [True, False, False], kids
    assert kids[1]["error"]["code"] == 429
    node.kill_all()


def test_concurrent_creates_never_pass_a_running_quota(node: InProcessServer) -> None:
    _, key = new_team(node, "racing", runningSandboxes=4)
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda _: create(node, key)[0], range(24)))
    assert sorted(statuses) == [201] * 4 + [429] * 20
    node.kill_all()


def test_a_real_burst_holds_to_the_creates_per_second_quota(node: InProcessServer) -> None:
    rate, seconds = 20.0, 3.0
    _, key = new_team(node, "bursty", createsPerSecond=rate)
    made: list[float] = []
    refused = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def client() -> None:
        while time.monotonic() - t0 < seconds:
            status, headers, body = create(node, key)
            with lock:
                if status == 201:
                    made.append(time.monotonic() - t0)
                else:
                    assert status == 429 and headers["Should-Retry"] == "true" and int(headers["Retry-After"]) >= 1
                    refused.append(body["message"])
    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    # the bucket starts full (one second's worth), then gives the rate: within 10 % of it
    steady = (len(made) - rate) / elapsed
    assert abs(steady - rate) <= 0.1 * rate, (len(made), elapsed, len(refused))
    assert refused and "20 sandbox creates per second" in refused[0]
    node.kill_all()


def test_team_metrics_follow_the_sandboxes_the_test_ran(node: InProcessServer) -> None:
    tid, key = new_team(node, "measured")
    _, other = new_team(node, "other")
    start = int(time.time())
    sids = [create(node, key)[2]["sandboxID"] for _ in range(3)]
    time.sleep(INTERVAL * 4)
    assert node.request("DELETE", f"/sandboxes/{sids[0]}", key=key)[0] == 204
    after_kill = int(time.time()) + 1       # the first whole second after the kill
    time.sleep(after_kill - time.time() + INTERVAL * 4)
    status, _, series = node.request("GET", f"/teams/{tid}/metrics?start={start}", key=key)
    assert status == 200 and series, series
    assert set(series[0]) == {"timestamp", "timestampUnix", "concurrentSandboxes", "sandboxStartRate"}
    # 5 s buckets: one or two of them (the test straddles at most one boundary)
    assert max(b["concurrentSandboxes"] for b in series) == 3
    assert round(sum(b["sandboxStartRate"] * 5 for b in series)) == 3
    status, _, peak = node.request("GET", f"/teams/{tid}/metrics/max?metric=concurrent_sandboxes&start={start}",
                                   key=key)
    assert status == 200 and peak["value"] == 3 and peak["timestampUnix"] >= start
    status, _, rate = node.request("GET", f"/teams/{tid}/metrics/max?metric=sandbox_start_rate", key=key)
    assert status == 200 and rate["value"] >= 0.2 - 1e-9    # 3 starts in 5 s buckets: one at least in one
    # the samples since the kill show it
    status, _, now = node.request("GET", f"/teams/{tid}/metrics?start={after_kill}", key=key)
    assert status == 200 and now and [b["concurrentSandboxes"] for b in now] == [2] * len(now)
    assert all(b["sandboxStartRate"] == 0 for b in now)
    # another team's id, or one that does not exist: the same 403 (ids are no oracle)
    assert node.request("GET", f"/teams/{tid}/metrics", key=other)[0] == 403
    assert node.request("GET", "/teams/nope/metrics", key=key)[0] == 403
    assert node.request("GET", f"/teams/{tid}/metrics/max?metric=cpu", key=key)[0] == 400
    assert node.request("GET", f"/teams/{tid}/metrics/max", key=key)[0] == 400
    assert node.request("GET", f"/teams/{tid}/metrics?start=10&end=5", key=key)[0] == 400
    # the admin reads any team's, naming it
    status, _, got = node.request("GET", f"/teams/{tid}/metrics", key=None,
                                  headers={"X-Admin-Token": ADMIN, "X-Team-ID": tid})
    assert status == 200 and got
    # Prometheus: the team's sandboxes and starts, labelled by team
    status, _, text = node.request("GET", "/metrics")
    text = text.decode()
    assert f'aenv_team_sandbox_starts_total{{team="{tid}"}} 3' in text
    assert f'aenv_team_sandboxes{{team="{tid}",state="running"}} 2' in text
    node.kill_all()


def test_the_sdk_sees_its_rate_limit_exception_over_quota(node: InProcessServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import RateLimitException, Sandbox

    _, key = new_team(node, "sdk", runningSandboxes=1)
    use_sdk_env(node, monkeypatch)
    monkeypatch.setenv("E2B_API_KEY", key)
    first = Sandbox.create(timeout=300)
    with pytest.raises(RateLimitException, match="maximum number of concurrent E2B sandboxes"):
        Sandbox.create(timeout=300)
    first.kill()
    Sandbox.create(timeout=300).kill()      # room again
    node.kill_all()


def test_the_default_teams_quota_applies_to_the_deployment_key(node: InProcessServer) -> None:
    path = f"/admin/teams/{DEFAULT_TEAM_ID}/quota"
    assert admin(node, "PUT", path, {"runningSandboxes": 0})[0] == 200
    try:
        status, _, body = create(node, node.api_key)
        assert status == 429 and "(0)" in body["message"]
    finally:
        assert admin(node, "PUT", path, {})[0] == 200
    assert create(node, node.api_key)[0] == 201
    node.kill_all()


def test_the_concurrent_builds_quota_holds_a_teams_build_starts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A team at its concurrent-builds quota is refused the start (v2 with steps, and the
    legacy start of a Dockerfile request); the build stays waiting and starts once allowed."""
    # a short dir: the build node's run dir holds QEMU sockets (107 bytes at most)
    srv = InProcessServer.start(tmp_path_factory.mktemp("qb"), templates=True, admin_token=ADMIN)
    try:
        quota = f"/admin/teams/{DEFAULT_TEAM_ID}/quota"
        assert admin(srv, "PUT", quota, {"concurrentBuilds": 0})[0] == 200
        status, _, got = srv.request("POST", "/v2/templates", {"alias": "held", "cpuCount": 1, "memoryMB": 256})
        assert status == 202, got
        start = f"/v2/templates/held/builds/{got['buildID']}"
        steps = {"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["true"]}]}
        status, headers, err = srv.request("POST", start, steps)
        assert status == 429 and "concurrent template builds (0)" in err["message"], err
        assert headers["Should-Retry"] == "false"
        status, _, legacy = srv.request("POST", "/templates", {"dockerfile": "FROM base\nRUN true\n", "alias": "old"})
        assert status == 202, legacy
        status, _, err = srv.request("POST", f"/templates/old/builds/{legacy['buildID']}")
        assert status == 429 and "concurrent template builds (0)" in err["message"]
        _, _, st = srv.request("GET", f"/templates/held/builds/{got['buildID']}/status")
        assert st["status"] == "waiting"
        assert admin(srv, "PUT", quota, {"concurrentBuilds": 1})[0] == 200
        assert srv.request("POST", start, steps)[0] == 202
    finally:
        srv.stop()


def test_a_shutdown_pauses_a_teams_sandboxes_beyond_its_paused_quota(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A node stopping pauses every running sandbox (on_shutdown = "pause"): the paused
    quota never makes it lose one."""
    srv = InProcessServer.start(tmp_path / "stopping", admin_token=ADMIN)
    try:
        _, key = new_team(srv, "keeps", pausedSandboxes=0)
        sids = [create(srv, key)[2]["sandboxID"] for _ in range(2)]
        assert srv.request("POST", f"/sandboxes/{sids[0]}/pause", {}, key=key)[0] == 429
        srv.call(srv.lifecycle.shutdown())
        states = {i.sandbox_id: i.state.value for i in srv.call(srv.fake.list_sandboxes())}
        assert states == {sid: "paused" for sid in sids}
    finally:
        srv.stop()


def test_concurrent_connects_at_the_running_quota_both_succeed(node: InProcessServer) -> None:
    """Two connects resuming one paused sandbox of a team with room for exactly it: one
    start, not two; the one that loses the race finds it running and is answered."""
    import asyncio

    _, key = new_team(node, "racing-resume", runningSandboxes=1)
    sid = create(node, key)[2]["sandboxID"]
    assert node.request("POST", f"/sandboxes/{sid}/pause", {}, key=key)[0] == 204
    fake = node.fake
    original = fake.resume

    async def slow_resume(sandbox_id: str, timeout: float | None = None, memory: bool = True) -> Any:
        await asyncio.sleep(0.3)
        return await original(sandbox_id, timeout, memory)
    fake.resume = slow_resume       # type: ignore[method-assign]  # a slower node, for this test only
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = sorted(pool.map(lambda _: node.request("POST", f"/v2/sandboxes/{sid}/connect",
                                                             {"timeout": 60}, key=key)[0], range(2)))
    finally:
        fake.resume = original      # type: ignore[method-assign]
    assert answers == [200, 201]
    assert create(node, key)[0] == 429      # and the team is at its quota: the one resumed counts
    node.kill_all()
