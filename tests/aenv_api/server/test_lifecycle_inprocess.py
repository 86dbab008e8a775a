"""aenv_api/server/lifecycle.py's behaviour, in-process over a ``FakeSandboxService``
(inprocess.py), through real HTTP and the real SDK: autoResume on traffic, the extras
file, sandbox-layer errors as HTTP statuses and E2B's error bodies, fork results,
connect and resume, timeouts and their expiry, list pages and filters, the logs and
metrics answers, shutdown. No VM: what a node does is pinned to the fake by
tests/aenv_vm/test_service_contract.py."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import pytest

from aenv_api.server.lifecycle import Lifecycle
from aenv_api.server.metrics import Metrics
from aenv_vm.errors import Unsupported, VmError
from aenv_vm.service import MetricSample

from .inprocess import InProcessServer


def create(api: InProcessServer, **body: Any) -> dict[str, Any]:
    status, headers, got = api.request("POST", "/v2/sandboxes", {"templateID": "base", **body})
    assert status == 201, got
    return got


def detail(api: InProcessServer, sid: str) -> dict[str, Any]:
    status, _, got = api.request("GET", f"/sandboxes/{sid}")
    assert status == 200, got
    return got


def traffic(api: InProcessServer, sid: str, token: str | None = None) -> tuple[int, Any]:
    headers = {"E2b-Sandbox-Id": sid, **({"X-Access-Token": token} if token is not None else {})}
    status, _, body = api.request("GET", "/health", headers=headers, key=None)
    return status, body


def extras_file(api: InProcessServer) -> dict[str, Any]:
    path = api.data_dir / "api-sandboxes.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture
def fake_api(api_env: InProcessServer) -> Iterator[InProcessServer]:
    yield api_env


# -- autoResume: traffic resumes only what resumes as it was -------------------------------------

def test_auto_resume_on_traffic(fake_api: InProcessServer) -> None:
    api = fake_api
    sbx = create(api, autoResume={"enabled": True}, autoPause=True)
    sid, token = sbx["sandboxID"], sbx["envdAccessToken"]
    assert detail(api, sid)["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}
    assert traffic(api, sid, token)[0] == 204
    assert api.request("POST", f"/sandboxes/{sid}/pause")[0] == 204
    # a stranger's request (no token, a wrong one) is refused before anything is resumed
    for given in (None, "not-the-token"):
        status, body = traffic(api, sid, given)
        assert status == 401 and "X-Access-Token" in body["message"], (given, body)
        assert detail(api, sid)["state"] == "paused"
    assert traffic(api, sid, token)[0] == 204           # the owner's traffic resumed it
    assert detail(api, sid)["state"] == "running"
    # a filesystem-only pause is never booted by traffic
    assert api.request("POST", f"/sandboxes/{sid}/pause", {"memory": False})[0] == 204
    status, body = traffic(api, sid, token)
    assert status == 502 and "must be resumed explicitly" in body["message"] and body["sandboxId"] == sid
    assert detail(api, sid)["state"] == "paused"
    status, _, _ = api.request("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60})
    assert status == 201 and detail(api, sid)["state"] == "running"
    # without autoResume: E2B's proxy answer to anyone
    other = create(api)
    api.request("POST", f"/sandboxes/{other['sandboxID']}/pause")
    status, body = traffic(api, other["sandboxID"], other["envdAccessToken"])
    assert status == 502 and "autoResume is off" in body["message"]


def test_an_unresponsive_pause_resumes_only_by_reboot(fake_api: InProcessServer) -> None:
    from e2b import GuestUnresponsiveException, Sandbox, SandboxState, ServiceBusyException

    api = fake_api
    sbx = create(api, autoResume={"enabled": True}, autoPause=True)
    sid, token = sbx["sandboxID"], sbx["envdAccessToken"]
    api.do(lambda: api.fake.set_guest_responsive(sid, False))
    with pytest.raises(ServiceBusyException):
        Sandbox.pause(sid, strict=True)                  # 503, and the sandbox keeps running
    with pytest.raises(ServiceBusyException):
        Sandbox.pause(sid, mode="filesystem")
    status, headers, body = api.request("POST", f"/sandboxes/{sid}/pause", {"requireHealthyGuest": True})
    assert status == 503 and headers.get("Should-Retry") == "false" and "not responding" in body["message"]
    assert Sandbox.get_info(sid).state == SandboxState.RUNNING
    assert Sandbox.pause(sid) is True                    # taken and marked
    assert Sandbox.get_info(sid).envd_unresponsive_at_pause is True
    assert detail(api, sid)["envdUnresponsiveAtPause"] is True
    status, body = traffic(api, sid, token)
    assert status == 502 and "must be resumed explicitly" in body["message"]
    status, _, body = api.request("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60})
    assert status == 409 and body["error_code"] == "sandbox_snapshot_guest_agent_unresponsive"
    assert body["code"] == 409 and "resumes only by cold boot" in body["message"]
    with pytest.raises(GuestUnresponsiveException):
        Sandbox.connect(sid)
    back = Sandbox.connect(sid, on_resume="reboot")
    info = back.get_info()
    assert info.state == SandboxState.RUNNING and info.envd_unresponsive_at_pause is None
    events = [e["message"] for e in api.request("GET", f"/v2/sandboxes/{sid}/logs")[2]["logs"]]
    assert "sandbox booted from its disk" in events


def test_a_lost_sandbox_is_not_shown_but_can_be_killed(fake_api: InProcessServer) -> None:
    api = fake_api
    sid = create(api, metadata={"suite": "lost"})["sandboxID"]
    api.do(lambda: api.fake.lose(sid, "found dead at start with no committed pause to resume from"))
    status, _, body = api.request("GET", f"/sandboxes/{sid}")
    assert status == 404 and "its state is lost" in body["message"]
    assert api.request("GET", "/v2/sandboxes?metadata=suite%3Dlost")[2] == []
    status, body = traffic(api, sid)
    assert (status, body["message"]) == (502, "The sandbox was not found")
    assert api.request("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60})[0] == 404
    assert api.request("POST", f"/sandboxes/{sid}/pause")[0] == 404
    assert api.request("DELETE", f"/sandboxes/{sid}")[0] == 204
    assert api.request("DELETE", f"/sandboxes/{sid}")[0] == 404


# -- connect, resume, pause ---------------------------------------------------------------------

def test_connect_resume_and_pause_answers(fake_api: InProcessServer) -> None:
    from e2b import Sandbox

    api = fake_api
    sid = create(api, timeout=300)["sandboxID"]
    end = detail(api, sid)["endAt"]
    status, _, body = api.request("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 10})
    assert status == 200 and body["sandboxID"] == sid            # was running
    assert detail(api, sid)["endAt"] == end                       # a connect never shortens the TTL
    api.request("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 3000})
    assert detail(api, sid)["endAt"] > end                        # only extends it
    status, _, body = api.request("POST", f"/sandboxes/{sid}/resume", {})
    assert (status, body["message"]) == (409, f"sandbox {sid} is already running")
    assert Sandbox.pause(sid) is True
    status, _, body = api.request("POST", f"/sandboxes/{sid}/pause")
    assert (status, body) == (409, {"code": 409, "message": f"Error pausing sandbox - sandbox '{sid}' is already paused"})
    assert Sandbox.pause(sid) is False                            # the SDK's reading of that 409
    status, _, body = api.request("POST", f"/sandboxes/{sid}/fork", {"count": 1})
    assert (status, body["message"]) == (409, f"sandbox {sid} is paused; only a running sandbox can be forked")
    status, _, body = api.request("POST", f"/sandboxes/{sid}/snapshots", {})
    assert status == 409 and body["message"] == f"snapshot of {sid}: sandbox {sid} is not running (state: paused)"
    status, _, body = api.request("POST", f"/sandboxes/{sid}/resume", {"timeout": 120})
    assert status == 201 and body["sandboxID"] == sid
    assert abs(api.call(api.fake.get(sid)).end_at - time.time() - 120) < 30
    api.request("POST", f"/sandboxes/{sid}/pause")
    status, _, _ = api.request("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60, "memory": False})
    assert status == 201
    events = [e["message"] for e in api.request("GET", f"/v2/sandboxes/{sid}/logs")[2]["logs"]]
    assert events.count("sandbox paused") == 2 and "sandbox resumed" in events
    assert events[-1] == "sandbox booted from its disk"


def test_concurrent_connects_of_a_paused_sandbox_both_succeed(fake_api: InProcessServer) -> None:
    """A connect that loses the race to resume finds the sandbox running: the node now
    refuses a resume of a running sandbox (E2B's 409), the API answers the connect."""
    api = fake_api
    sid = create(api)["sandboxID"]
    api.request("POST", f"/sandboxes/{sid}/pause")
    fake = api.fake
    original = fake.resume
    lock = asyncio.Lock()

    async def slow_resume(sandbox_id: str, timeout: float | None = None, memory: bool = True) -> Any:
        async with lock:                       # a node's resume holds the sandbox's lock
            await asyncio.sleep(0.3)
            return await original(sandbox_id, timeout, memory)
    fake.resume = slow_resume       # type: ignore[method-assign]  # a slower node, for this test only
    try:
        answers: list[int] = []

        def connect() -> None:
            answers.append(api.request("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60})[0])
        threads = [threading.Thread(target=connect) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        fake.resume = original      # type: ignore[method-assign]  # as it was
    assert sorted(answers) == [200, 201], answers
    events = api.request("GET", f"/v2/sandboxes/{sid}/logs?level=error")[2]["logs"]
    assert events == []                          # the lost race is no failed resume


# -- errors as E2B's answers ---------------------------------------------------------------------

def test_sandbox_layer_errors_as_http(fake_api: InProcessServer) -> None:
    api = fake_api
    status, _, body = api.request("POST", "/v2/sandboxes", {"templateID": "no-such"})
    assert (status, body) == (404, {"code": 404, "message": "template 'no-such' not found"})
    status, _, body = api.request("POST", "/v2/sandboxes", {"templateID": "base",
                                                            "volumeMounts": [{"name": "nope", "path": "/data"}]})
    assert (status, body["message"]) == (404, "volumeMounts: Volume 'nope' not found")
    sid = create(api)["sandboxID"]
    fake = api.fake
    full, fake.max_sandboxes = fake.max_sandboxes, 1
    try:
        status, headers, body = api.request("POST", "/v2/sandboxes", {"templateID": "base"})
        assert (status, body) == (429, {"code": 429, "message": "this node holds its maximum of 1 sandboxes",
                                        "error_code": "sandbox_capacity_unavailable"})
        assert headers["Should-Retry"] == "false"                # the SDK must not retry it
        assert headers["Retry-After"] == "5"
        status, headers, body = api.request("POST", f"/sandboxes/{sid}/fork", {"count": 2})
        assert status == 429 and "holds its maximum of 1 sandboxes" in body["message"]
        fake.max_sandboxes = 2      # room for one of two children: the other fails alone, 429
        status, _, body = api.request("POST", f"/sandboxes/{sid}/fork", {"count": 2})
        assert status == 201 and "sandbox" in body[0]
        assert body[1] == {"error": {"code": 429, "message": "this node holds its maximum of 2 sandboxes"}}
        api.request("DELETE", f"/sandboxes/{body[0]['sandbox']['sandboxID']}")
    finally:
        fake.max_sandboxes = full
    original = fake.snapshot
    for error, want in ((Unsupported("no snapshots on this node"), 501), (VmError("disk full"), 500)):
        async def failing(*_a: Any, **_k: Any) -> Any:
            raise error
        fake.snapshot = failing     # type: ignore[method-assign]  # a failing node, for this case only
        try:
            status, headers, body = api.request("POST", f"/sandboxes/{sid}/snapshots", {})
        finally:
            fake.snapshot = original    # type: ignore[method-assign]  # as it was
        assert status == want and body["code"] == want and str(error) in body["message"], body
        assert set(body) == {"code", "message"}
        assert headers.get("Should-Retry") == ("false" if want == 501 else None)
    for method, path in (("GET", "/sandboxes/sbx-nope"), ("DELETE", "/sandboxes/sbx-nope"),
                         ("POST", "/sandboxes/sbx-nope/pause"), ("POST", "/sandboxes/sbx-nope/timeout"),
                         ("GET", "/sandboxes/sbx-nope/metrics"), ("GET", "/v2/sandboxes/sbx-nope/logs")):
        status, _, body = api.request(method, path, {"timeout": 5} if path.endswith("timeout") else None)
        assert status == 404 and body["code"] == 404, (method, path, body)


# -- forks -----------------------------------------------------------------------------------------

def test_fork_results_per_child(fake_api: InProcessServer) -> None:
    from e2b import Sandbox, SandboxException

    api = fake_api
    parent = create(api, autoResume={"enabled": True}, autoPause=True, metadata={"k": "v"})
    sid = parent["sandboxID"]
    api.fake.fork_failures = [VmError("child 0 did not restore"), None]
    status, _, results = api.request("POST", f"/sandboxes/{sid}/fork", {"count": 2, "timeout": 90})
    assert status == 201 and len(results) == 2
    assert results[0] == {"error": {"code": 500, "message": "child 0 did not restore"}}
    child = results[1]["sandbox"]
    assert child["sandboxID"] != sid and child["envdAccessToken"] == api.envd_token(child["sandboxID"])
    assert child["alias"] == "base" and child["domain"] == "aenv.test"
    shown = detail(api, child["sandboxID"])
    assert shown["metadata"] == {"k": "v", "forked_from": sid}
    assert shown["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}     # the parent's extras
    assert extras_file(api)[child["sandboxID"]] == extras_file(api)[sid]
    logs = api.request("GET", f"/v2/sandboxes/{sid}/logs")[2]["logs"]
    forked = [e for e in logs if e["message"] == "sandbox forked"][-1]
    assert forked["fields"]["children"] == child["sandboxID"] and forked["fields"]["failed"] == "1"
    # through the SDK: an exception in the failed child's place
    api.fake.fork_failures = [None, VmError("child 1 did not restore")]
    kids = Sandbox.fork(sid, count=2)
    assert isinstance(kids[1], SandboxException) and "child 1 did not restore" in str(kids[1])
    assert not isinstance(kids[0], Exception) and kids[0].get_info().metadata["forked_from"] == sid
    status, _, body = api.request("POST", f"/sandboxes/{sid}/fork", {"count": 101})
    assert status == 400 and body["code"] == 400


# -- timeouts ----------------------------------------------------------------------------------------

def test_timeouts_and_their_expiry(fake_api: InProcessServer) -> None:
    api = fake_api
    keep = create(api, timeout=600, autoPause=True)["sandboxID"]
    drop = create(api, timeout=600)["sandboxID"]
    assert api.request("POST", f"/sandboxes/{keep}/timeout", {"timeout": 1234})[0] == 204
    assert abs(api.call(api.fake.get(keep)).end_at - time.time() - 1234) < 30
    status, _, body = api.request("POST", f"/sandboxes/{keep}/timeout", {"timeout": 86401})
    assert status == 400 and "timeout" in body["message"]
    for sid in (keep, drop):
        api.request("POST", f"/sandboxes/{sid}/timeout", {"timeout": 0})
    deadline = time.monotonic() + 10
    while (detail(api, keep)["state"] != "paused" or api.request("GET", f"/sandboxes/{drop}")[0] != 404):
        assert time.monotonic() < deadline, "the TTL did not act"
        time.sleep(0.05)
    events = [e["message"] for e in api.request("GET", f"/v2/sandboxes/{keep}/logs")[2]["logs"]]
    assert "sandbox paused: its timeout expired" in events
    assert drop not in extras_file(api) and keep in extras_file(api)         # a kill forgets its extras
    assert api.request("GET", f"/v2/sandboxes/{drop}/logs")[0] == 404
    # a paused sandbox has no timeout to set: 404, as E2B answers (the JS SDK before 2.7
    # connects by setting one and resumes when that fails); connect gives it one
    status, _, body = api.request("POST", f"/sandboxes/{keep}/timeout", {"timeout": 77})
    assert status == 404 and "is paused" in body["message"], body
    status, _, _ = api.request("POST", f"/v2/sandboxes/{keep}/connect", {"timeout": 77})
    assert status == 201 and api.call(api.fake.get(keep)).timeout == 77
    # a refresh extends a running sandbox only
    assert api.request("POST", f"/sandboxes/{keep}/refreshes", {"duration": 500})[0] == 204
    assert api.call(api.fake.get(keep)).timeout == 500


# -- the extras file -------------------------------------------------------------------------------

def test_extras_file_follows_the_sandboxes(fake_api: InProcessServer, tmp_path: Path) -> None:
    api = fake_api
    a = create(api, autoResume={"enabled": True}, autoPause=True,
               network={"allowPublicTraffic": False, "maskRequestHost": "${PORT}-x.test"})
    sid = a["sandboxID"]
    kept = extras_file(api)[sid]
    assert kept["alias"] == "base" and kept["auto_resume"] is True and kept["public_traffic"] is False
    assert kept["mask_request_host"] == "${PORT}-x.test" and kept["disk_mb"] > 0
    assert a["trafficAccessToken"] == api.traffic_token(sid)
    by_id = create(api, templateID=a["templateID"])
    assert "alias" not in by_id and extras_file(api)[by_id["sandboxID"]]["alias"] is None
    # moved to another node and back: the extras travel in the sandbox's annotation
    api.request("POST", f"/sandboxes/{sid}/pause")
    assert api.cluster_request(f"/_aenv/cluster/sandboxes/{sid}/release")[0] == 204
    assert sid not in extras_file(api) and api.request("GET", f"/sandboxes/{sid}")[0] == 404
    status, _, listed = api.cluster_request(f"/_aenv/cluster/sandboxes/{sid}/adopt")
    assert status == 200 and listed["state"] == "paused" and listed["sandboxID"] == sid
    assert extras_file(api)[sid] == kept
    assert detail(api, sid)["lifecycle"]["autoResume"] is True
    status, _, body = api.cluster_request(f"/_aenv/cluster/sandboxes/{sid}/adopt")
    assert status == 409 and "already holds" in body["message"]
    # a restart keeps only the extras of sandboxes the service still has
    api.do(lambda: api.lifecycle.extras.put("sbx-gone", api.lifecycle.extras.get(sid)))
    assert "sbx-gone" in extras_file(api)

    async def restart() -> None:
        again = Lifecycle(api.fake, api.config, Metrics(), api.data_dir)
        await again.start()
    api.call(restart())
    assert "sbx-gone" not in extras_file(api) and sid in extras_file(api)


# -- list pages and filters --------------------------------------------------------------------------

def test_list_pages_and_filters(fake_api: InProcessServer) -> None:
    api = fake_api
    ids = [create(api, metadata={"suite": "list", "n": str(i)})["sandboxID"] for i in range(5)]
    api.request("POST", f"/sandboxes/{ids[0]}/pause")
    status, headers, running = api.request("GET", "/v2/sandboxes?state=running&metadata=suite%3Dlist")
    assert status == 200 and {s["sandboxID"] for s in running} == set(ids[1:])
    assert headers["X-Total-Running"] == "4"
    paused = api.request("GET", "/v2/sandboxes?state=paused")[2]
    assert [s["sandboxID"] for s in paused] == [ids[0]] and paused[0]["state"] == "paused"
    assert [s["sandboxID"] for s in api.request("GET", "/v2/sandboxes?metadata=n%3D3")[2]] == [ids[3]]
    assert {s["sandboxID"] for s in api.request("GET", "/sandboxes")[2]} == set(ids[1:])   # v1: running only
    seen: list[str] = []
    token = None
    while True:
        q = "/v2/sandboxes?limit=2&order=asc" + (f"&nextToken={token}" if token else "")
        status, headers, page = api.request("GET", q)
        assert status == 200 and len(page) <= 2
        seen += [s["sandboxID"] for s in page]
        token = headers.get("X-Next-Token")
        if not token:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))
    starts = [s["startedAt"] for s in api.request("GET", "/v2/sandboxes?order=asc")[2]]
    assert starts == sorted(starts)
    for template in ("base", api.call(api.fake.get(ids[1])).template_id):
        got = api.request("GET", f"/v2/sandboxes?template={template}&state=running")[2]
        assert {s["sandboxID"] for s in got} == set(ids[1:]), template
    assert api.request("GET", "/v2/sandboxes?template=other")[2] == []
    listed = api.request("GET", "/v2/sandboxes?metadata=n%3D1")[2][0]
    assert set(listed) >= {"templateID", "sandboxID", "clientID", "envdVersion", "startedAt", "endAt", "cpuCount",
                           "memoryMB", "diskSizeMB", "metadata", "state"}


# -- logs and metrics --------------------------------------------------------------------------------

def test_logs_shapes_and_console_lines(fake_api: InProcessServer) -> None:
    api = fake_api
    sid = create(api)["sandboxID"]
    api.do(lambda: api.fake.write_console(sid, b"hello from the console\nhalf a li"))
    v1 = api.request("GET", f"/sandboxes/{sid}/logs")[2]
    assert set(v1) == {"logs", "logEntries"}
    assert {"timestamp", "line"} == set(v1["logs"][0])
    assert {"timestamp", "level", "message", "fields"} == set(v1["logEntries"][0])
    lines = [e["message"] for e in v1["logEntries"]]
    assert lines[0] == "sandbox created" and "hello from the console" in lines and "half a li" not in lines
    console = [e for e in v1["logEntries"] if e["message"] == "hello from the console"][0]
    assert console["fields"]["source"] == "console"
    api.request("POST", f"/sandboxes/{sid}/pause")          # the console is read before its VM goes
    v2 = api.request("GET", f"/v2/sandboxes/{sid}/logs?direction=backward&limit=1")[2]
    assert set(v2) == {"logs"} and [e["message"] for e in v2["logs"]] == ["sandbox paused"]
    found = api.request("GET", f"/v2/sandboxes/{sid}/logs?search=console")[2]["logs"]
    assert [e["message"] for e in found] == ["hello from the console"]


def test_metrics_shapes(fake_api: InProcessServer) -> None:
    api = fake_api
    sid = create(api)["sandboxID"]
    other = create(api)["sandboxID"]
    status, _, samples = api.request("GET", f"/sandboxes/{sid}/metrics")
    assert status == 200 and len(samples) == 1            # the sample of its start
    assert set(samples[0]) == {"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal",
                               "memCache", "diskUsed", "diskTotal"}
    now = time.time()
    api.do(lambda: api.fake.add_sample(sid, MetricSample(now + 10, 2, 50.0, 1, 2, 0, 1, 2)))
    status, _, late = api.request("GET", f"/sandboxes/{sid}/metrics?start={int(now) + 5}")
    assert status == 200 and [m["cpuUsedPct"] for m in late] == [50.0]
    status, _, body = api.request("GET", f"/sandboxes/{sid}/metrics?start=20&end=10")
    assert status == 400 and "time range" in body["message"]
    api.request("POST", f"/sandboxes/{sid}/pause")
    assert len(api.request("GET", f"/sandboxes/{sid}/metrics")[2]) == 2      # kept across the pause
    status, _, body = api.request("GET", f"/sandboxes/metrics?sandbox_ids={sid},{other},nosuch")
    assert status == 200 and set(body["sandboxes"]) == {sid} and body["sandboxes"][sid]["cpuUsedPct"] == 50.0
    many = ",".join(f"id{i}" for i in range(101))
    status, _, body = api.request("GET", f"/sandboxes/metrics?sandbox_ids={many}")
    assert status == 400 and "maximum is 100" in body["message"]


# -- shutdown ------------------------------------------------------------------------------------------

def test_shutdown_pauses_running_sandboxes(tmp_path: Path) -> None:
    api = InProcessServer.start(tmp_path / "node")
    try:
        a, b = create(api)["sandboxID"], create(api)["sandboxID"]
        api.request("POST", f"/sandboxes/{b}/pause")
        api.call(api.lifecycle.shutdown())
        assert {i.sandbox_id: i.state.value for i in api.call(api.fake.list_sandboxes())} == {
            a: "paused", b: "paused"}
        status, _, body = api.request("POST", "/v2/sandboxes", {"templateID": "base"})
        assert (status, body["message"]) == (503, "the node is shutting down")
    finally:
        api.stop()


def test_a_batch_from_a_named_snapshot_after_its_sandbox_is_gone(api: InProcessServer) -> None:
    """E2B's RFC ``POST /snapshots/{snapshotID}/fork``: count sandboxes from a named
    snapshot (by id or name), each with the request's timeout and metadata, each its own
    result; the snapshot's sandbox may be gone; capacity fails the extra ones alone."""
    sid = create(api, metadata={"role": "task"})["sandboxID"]
    status, _, snap = api.request("POST", f"/sandboxes/{sid}/snapshots", {"name": "prepared-task"})
    assert status == 201, snap
    assert api.request("DELETE", f"/sandboxes/{sid}")[0] == 204
    for ref in ("prepared-task", snap["snapshotID"]):
        status, _, body = api.request("POST", f"/snapshots/{ref}/fork",
                                      {"count": 3, "timeout": 120, "metadata": {"rollout": "a"}})
        assert status == 201 and len(body) == 3, body
        ids = {r["sandbox"]["sandboxID"] for r in body}
        assert len(ids) == 3 and sid not in ids
        for r in body:
            s = r["sandbox"]
            assert s["templateID"] == snap["snapshotID"] and s["envdAccessToken"]
            shown = detail(api, s["sandboxID"])
            assert shown["metadata"] == {"rollout": "a"} and shown["state"] == "running"
            ttl = datetime.fromisoformat(shown["endAt"]) - datetime.fromisoformat(shown["startedAt"])
            assert abs(ttl.total_seconds() - 120) < 5
            assert api.request("DELETE", f"/sandboxes/{s['sandboxID']}")[0] == 204
    status, _, body = api.request("POST", "/snapshots/no-such/fork", {"count": 1})
    assert status == 404 and "snapshot 'no-such' not found" in body["message"]
    for bad in ({"count": 0}, {"count": 101}, {"count": 1, "timeout": -1}, {"count": 1, "metadata": {"a": 1}}):
        assert api.request("POST", "/snapshots/prepared-task/fork", bad)[0] == 400, bad
    fake = api.fake
    full, fake.max_sandboxes = fake.max_sandboxes, 2
    try:
        status, _, body = api.request("POST", "/snapshots/prepared-task/fork", {"count": 3})
        assert status == 201
        assert sum("sandbox" in r for r in body) == 2
        assert [r["error"]["code"] for r in body if "error" in r] == [429]
        for r in body:
            if "sandbox" in r:
                api.request("DELETE", f"/sandboxes/{r['sandbox']['sandboxID']}")
    finally:
        fake.max_sandboxes = full
    api.request("DELETE", f"/templates/{snap['snapshotID']}")


def test_a_batch_from_a_paused_sandboxs_last_pause(api: InProcessServer) -> None:
    """``POST /snapshots/{id}/fork`` with a paused sandbox's id: its last pause as a hidden
    snapshot, each new sandbox its own id and token, the request's timeout and metadata;
    the paused sandbox stays paused (and resumes); the batch outlives it; a killed or
    never-made sandbox is a 404, a running one or one paused without memory a 409."""
    sid = create(api, metadata={"role": "source"})["sandboxID"]
    status, _, body = api.request("POST", f"/snapshots/{sid}/fork", {"count": 1})
    assert status == 409 and "is running: only a paused sandbox" in body["message"], body
    assert api.request("POST", f"/sandboxes/{sid}/pause")[0] == 204
    status, _, body = api.request("POST", f"/snapshots/{sid}/fork",
                                  {"count": 3, "timeout": 120, "metadata": {"rollout": "b"}})
    assert status == 201 and len(body) == 3, body
    kids = [r["sandbox"] for r in body]
    assert len({k["sandboxID"] for k in kids} | {sid}) == 4
    assert len({k["envdAccessToken"] for k in kids}) == 3
    hidden = {k["templateID"] for k in kids}
    assert len(hidden) == 1 and hidden.pop().startswith("tpl-")
    for k in kids:
        shown = detail(api, k["sandboxID"])
        assert shown["state"] == "running" and shown["metadata"] == {"rollout": "b"}
    status, _, listed = api.request("GET", "/snapshots")
    assert status == 200 and kids[0]["templateID"] not in {s["snapshotID"] for s in listed}   # hidden
    source = detail(api, sid)
    assert source["state"] == "paused" and source["metadata"] == {"role": "source"}
    assert api.request("POST", f"/sandboxes/{sid}/connect", {"timeout": 60})[0] == 201
    assert api.request("POST", f"/sandboxes/{sid}/pause")[0] == 204
    assert api.request("DELETE", f"/sandboxes/{sid}")[0] == 204
    status, _, body = api.request("POST", f"/snapshots/{sid}/fork", {"count": 1})
    assert status == 404 and f"snapshot {sid!r} not found" in body["message"], body
    for k in kids:      # the batch outlives its source: paused and resumed
        assert api.request("POST", f"/sandboxes/{k['sandboxID']}/pause")[0] == 204
        assert api.request("POST", f"/sandboxes/{k['sandboxID']}/connect", {"timeout": 60})[0] == 201
        assert api.request("DELETE", f"/sandboxes/{k['sandboxID']}")[0] == 204
    status, _, body = api.request("POST", "/v2/sandboxes", {"templateID": kids[0]["templateID"]})
    assert status == 404, body      # dropped with its last sandbox
    other = create(api)["sandboxID"]
    assert api.request("POST", f"/sandboxes/{other}/pause", {"memory": False})[0] == 204
    status, _, body = api.request("POST", f"/snapshots/{other}/fork", {"count": 1})
    assert status == 409 and "paused without its memory" in body["message"], body
    api.request("DELETE", f"/sandboxes/{other}")
