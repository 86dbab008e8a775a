"""The real e2b SDK (sync) against `aenv server`, configured only by E2B_* env vars: what
looks into a guest or goes through the proxy to it. The API's own semantics (listing,
filters and pages, get_info, timeouts, API keys, the proxy's answer for an unknown
sandbox) are tested in-process (test_sdk_inprocess.py, test_lifecycle_inprocess.py)."""
from __future__ import annotations

import json
import time

import pytest

from tests.guest_servers import GUEST_SERVER
from .conftest import Server, use_sdk_env

pytestmark = pytest.mark.qemu


@pytest.fixture(scope="module")
def pair(server: Server):  # type: ignore[no-untyped-def]
    """Two sandboxes shared by the module's tests (creating VMs is the expensive part)."""
    from e2b import Sandbox

    with pytest.MonkeyPatch.context() as mp:   # module scope: no function-scoped monkeypatch
        use_sdk_env(server, mp)
        a = Sandbox.create(metadata={"suite": "api", "who": "a b&c=d/é"}, envs={"AENV_GREETING": "hi there"},
                           timeout=600)
        b = Sandbox.create(metadata={"suite": "api", "who": "b"}, timeout=600)
        yield a, b
        for s in (a, b):
            try:
                s.kill()
            except Exception:
                pass


def test_create_commands_and_files(sdk_env: Server, pair) -> None:  # type: ignore[no-untyped-def]
    from e2b import CommandExitException

    a, b = pair
    assert a.sandbox_id != b.sandbox_id and a.sandbox_id.startswith("sbx-")
    r = a.commands.run("echo $AENV_GREETING; hostname")
    assert r.stdout.split("\n")[:2] == ["hi there", a.sandbox_id]
    assert b.commands.run("echo ${AENV_GREETING:-unset}").stdout.strip() == "unset"  # envVars are per sandbox
    with pytest.raises(CommandExitException) as exc:
        a.commands.run("echo oops >&2; exit 3")
    assert exc.value.exit_code == 3 and "oops" in exc.value.stderr
    payload = "".join(chr(c) for c in range(32, 127)) * 50
    a.files.write("/home/user/notes/one.txt", payload)
    assert a.files.read("/home/user/notes/one.txt") == payload
    assert [e.name for e in a.files.list("/home/user/notes")] == ["one.txt"]
    assert not b.files.exists("/home/user/notes/one.txt")  # filesystems are separate
    blob = bytes(range(256)) * 4096  # 1 MiB through the proxy, both ways
    a.files.write("/tmp/blob.bin", blob)
    assert a.files.read("/tmp/blob.bin", format="bytes") == blob


def test_stream_frames_are_flushed_one_by_one(sdk_env: Server, pair) -> None:  # type: ignore[no-untyped-def]
    a, _ = pair
    seen: list[tuple[float, str]] = []
    a.commands.run("for i in 1 2 3; do echo line$i; sleep 1; done",
                   on_stdout=lambda line: seen.append((time.monotonic(), line.strip())))
    assert [s for _, s in seen] == ["line1", "line2", "line3"]
    assert seen[-1][0] - seen[0][0] > 1.5, "stdout arrived in one batch: the proxy buffered the stream"


def test_background_process_and_stdin(sdk_env: Server, pair) -> None:  # type: ignore[no-untyped-def]
    a, _ = pair
    h = a.commands.run("read x; echo got:$x", background=True, stdin=True)
    a.commands.send_stdin(h.pid, "42\n")  # a client-streamed RPC through the proxy
    assert h.wait().stdout.strip() == "got:42"


def test_envd_tokens(sdk_env: Server, pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    server = sdk_env
    hdr = {"E2b-Sandbox-Id": a.sandbox_id, "E2b-Sandbox-Port": "49983"}
    status, _, body = server.request("GET", "/files?path=/etc/hostname", headers=hdr, key=None)
    assert status == 401 and body["code"] == 401  # no token
    status, _, body = server.request("GET", "/files?path=/etc/hostname",
                                     headers={**hdr, "X-Access-Token": b._envd_access_token}, key=None)
    assert status == 401  # another sandbox's token does not open this one
    status, _, body = server.request("GET", "/files?path=/etc/hostname",
                                     headers={**hdr, "X-Access-Token": a._envd_access_token}, key=None)
    assert status == 200 and body.decode().strip()
    for s in (a, b):  # the token is the deployment's HMAC of the sandbox id
        assert s._envd_access_token == server.envd_token(s.sandbox_id)
    off = a._envd_access_token[:-1] + ("B" if a._envd_access_token.endswith("A") else "A")
    status, _, body = server.request("GET", "/files?path=/etc/hostname", headers={**hdr, "X-Access-Token": off},
                                     key=None)
    assert status == 401 and body["code"] == 401  # one character off


def test_proxied_responses_carry_request_ids(sdk_env: Server, pair) -> None:  # type: ignore[no-untyped-def]
    from .test_raw_http import exchange

    a, _ = pair
    hdr = {"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": a._envd_access_token}
    status, headers, _ = sdk_env.request("GET", "/files?path=/etc/hostname", headers={**hdr, "X-Request-Id": "req-42"},
                                         key=None)
    assert status == 200 and headers["X-Request-Id"] == "req-42"  # the client's id, echoed
    status, headers, _ = sdk_env.request("GET", "/files?path=/etc/hostname", headers=hdr, key=None)
    rid = headers["X-Request-Id"]
    assert status == 200 and len(rid) == 16
    deadline = time.monotonic() + 5  # the log line is written just after the answer left
    while not any(rid in line and "proxy" in line and a.sandbox_id in line for line in sdk_env.log().splitlines()):
        assert time.monotonic() < deadline, f"request {rid} not in the server log"
        time.sleep(0.05)
    status, headers, _ = sdk_env.request("GET", "/files?path=/etc/hostname", headers={**hdr, "X-Access-Token": "x"},
                                         key=None)
    assert status == 401 and len(headers["X-Request-Id"]) == 16
    # a chunked upload whose framing breaks mid-stream: the client's fault, 400 JSON (not 502)
    head = (f"POST /files?path=/tmp/x HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {a.sandbox_id}\r\n"
            f"X-Access-Token: {a._envd_access_token}\r\nContent-Type: application/octet-stream\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n2\r\nab\r\n").encode()
    status, headers, body = exchange(sdk_env, head, b"zz\r\n")
    assert status == 400 and json.loads(body)["code"] == 400 and "chunk" in json.loads(body)["message"]


def test_other_guest_port_sse_websocket_and_host_routing(sdk_env: Server, pair) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    import aiohttp

    a, _ = pair
    a.files.write("/tmp/guest_server.py", GUEST_SERVER)
    a.commands.run("python3 /tmp/guest_server.py", background=True)
    deadline = time.monotonic() + 90
    hdr = {"E2b-Sandbox-Id": a.sandbox_id, "E2b-Sandbox-Port": "8080", "X-Probe": "yes"}
    while True:
        status, _, body = sdk_env.request("GET", "/echo", headers=hdr)  # carries X-API-Key
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 200, body
    seen = {k.lower() for k in json.loads(body)}
    assert "x-probe" in seen and "x-api-key" not in seen and "e2b-sandbox-id" not in seen

    # host routing: <port>-<id>.<domain> (the test servers run with domain aenv.test)
    status, _, body = sdk_env.request("GET", "/echo", key=None,
                                      headers={"Host": f"8080-{a.sandbox_id}.aenv.test", "X-Probe": "host"})
    assert status == 200 and json.loads(body)["X-Probe"] == "host"
    status, _, body = sdk_env.request("GET", "/health", key=None,
                                      headers={"Host": f"49983-{a.sandbox_id}.aenv.test"})
    assert status == 401  # envd port, no token
    status, _, _ = sdk_env.request("GET", "/health", key=None, headers={
        "Host": f"49983-{a.sandbox_id}.aenv.test", "X-Access-Token": a._envd_access_token})
    assert status == 204

    async def streams() -> None:
        async with aiohttp.ClientSession() as session:
            arrivals = []
            async with session.get(sdk_env.url + "/sse", headers=hdr) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                async for line in r.content:
                    if line.startswith(b"data:"):
                        arrivals.append((time.monotonic(), line.strip()))
            assert [x for _, x in arrivals] == [b"data: 0", b"data: 1", b"data: 2"]
            assert arrivals[-1][0] - arrivals[0][0] > 1.0, "SSE events were buffered by the proxy"
            async with session.ws_connect(sdk_env.url + "/ws", headers=hdr) as ws:
                await ws.send_str("hello")
                msg = await ws.receive(timeout=30)
                assert msg.type == aiohttp.WSMsgType.TEXT and msg.data == "echo:hello"
    asyncio.run(streams())


def test_kill_then_list(sdk_env: Server) -> None:
    from e2b import Sandbox, SandboxQuery

    s = Sandbox.create(metadata={"suite": "kill"})
    assert s.commands.run("echo alive").stdout.strip() == "alive"
    assert [x.sandbox_id for x in Sandbox.list(query=SandboxQuery(metadata={"suite": "kill"})).next_items()] \
        == [s.sandbox_id]
    s.kill()
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "kill"})).next_items() == []
    assert not s.is_running()
    assert Sandbox.kill(s.sandbox_id) is False  # 404 → False in the SDK


def test_pause_and_connect_resume_keep_processes_and_files(sdk_env: Server) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    s = Sandbox.create(metadata={"suite": "pause"}, timeout=600)
    try:
        s.files.write("/home/user/kept.txt", "survives pause")
        h = s.commands.run("sleep 1000", background=True)
        s.pause()
        info = Sandbox.get_info(s.sandbox_id)
        assert info.state == SandboxState.PAUSED
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "pause"}, state=[SandboxState.PAUSED]))
        assert [x.sandbox_id for x in listed.next_items()] == [s.sandbox_id]
        status, _, body = sdk_env.request("POST", f"/sandboxes/{s.sandbox_id}/pause")
        assert status == 409 and body["code"] == 409  # already paused
        # sandbox traffic to a paused sandbox without autoResume: 502 as E2B's proxy answers
        status, _, body = sdk_env.request("GET", "/health", headers={"E2b-Sandbox-Id": s.sandbox_id}, key=None)
        assert status == 502 and "was not found" in body["message"]
        status, _, body = sdk_env.request("POST", f"/v2/sandboxes/{s.sandbox_id}/connect", body={"timeout": 300})
        assert status == 201 and body["sandboxID"] == s.sandbox_id  # resumed
        status, _, body = sdk_env.request("POST", f"/v2/sandboxes/{s.sandbox_id}/connect", body={"timeout": 300})
        assert status == 200  # was running
        again = Sandbox.connect(s.sandbox_id)
        assert again.files.read("/home/user/kept.txt") == "survives pause"
        assert str(h.pid) in again.commands.run("ps -eo pid,args").stdout  # the process survived
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
    finally:
        s.kill()


def test_auto_resume_on_traffic(sdk_env: Server) -> None:
    from e2b import Sandbox, SandboxState

    s = Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": True}, timeout=600)
    try:
        info = s.get_info()
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True} or (
            str(info.lifecycle["on_timeout"]).endswith("pause") and info.lifecycle["auto_resume"] is True)
        s.files.write("/home/user/ar.txt", "kept")
        s.pause()
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        # a stranger's request to envd (no token, or a wrong one) is refused and wakes nothing
        for token in (None, "not-the-token"):
            headers = {"E2b-Sandbox-Id": s.sandbox_id, **({"X-Access-Token": token} if token else {})}
            status, _, body = sdk_env.request("GET", "/health", headers=headers, key=None)
            assert status == 401 and "X-Access-Token" in body["message"], (status, body)
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        assert s.files.read("/home/user/ar.txt") == "kept"  # the proxied request resumed it
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
    finally:
        s.kill()


def test_snapshot_create_from_it_list_and_delete(sdk_env: Server, pair) -> None:  # type: ignore[no-untyped-def]
    from e2b import Sandbox

    a, _ = pair
    a.files.write("/home/user/snap.txt", "in the snapshot")
    snap = a.create_snapshot()
    assert snap.snapshot_id
    ids = [x.snapshot_id for x in Sandbox.list_snapshots().next_items()]
    assert snap.snapshot_id in ids
    child = Sandbox.create(snap.snapshot_id)  # a snapshot id is a valid templateID
    try:
        assert child.files.read("/home/user/snap.txt") == "in the snapshot"
        assert child.commands.run("hostname").stdout.strip() == child.sandbox_id
        assert child._envd_access_token == sdk_env.envd_token(child.sandbox_id) != a._envd_access_token
    finally:
        child.kill()
    assert a.commands.run("echo parent-ok").stdout.strip() == "parent-ok"  # the parent kept running
    Sandbox.delete_snapshot(snap.snapshot_id)
    assert snap.snapshot_id not in [x.snapshot_id for x in Sandbox.list_snapshots().next_items()]
    status, _, body = sdk_env.request("DELETE", f"/templates/{snap.snapshot_id}")
    assert status == 404 and body["code"] == 404


def test_fork(sdk_env: Server, pair) -> None:  # type: ignore[no-untyped-def]
    a, _ = pair
    a.files.write("/home/user/fork.txt", "from the parent")
    children = a.fork(count=16)
    try:
        assert len(children) == 16 and all(not isinstance(c, Exception) for c in children), children
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 16 and a.sandbox_id not in ids
        for c in children:
            assert c.files.read("/home/user/fork.txt") == "from the parent"
            assert c.commands.run("echo $AENV_GREETING").stdout.strip() == "hi there"  # env inherited
            assert c._envd_access_token == sdk_env.envd_token(c.sandbox_id) != a._envd_access_token
        children[0].files.write("/home/user/fork.txt", "changed in child 0")
        assert children[1].files.read("/home/user/fork.txt") == "from the parent"
        assert a.files.read("/home/user/fork.txt") == "from the parent"
    finally:
        for c in children:
            if not isinstance(c, Exception):
                c.kill()
    status, _, got = sdk_env.request("POST", f"/sandboxes/{a.sandbox_id}/fork", body={"count": 0})
    assert status == 400 and got["code"] == 400


def test_node_endpoints(sdk_env: Server) -> None:
    status, _, _ = sdk_env.request("GET", "/health", key=None)
    assert status == 204
    status, _, doc = sdk_env.request("GET", "/openapi.json", key=None)
    assert status == 200 and "/v2/sandboxes" in doc["paths"] and "post" in doc["paths"]["/v2/sandboxes"]
    status, headers, text = sdk_env.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = text.decode()
    assert 'aenv_sandboxes{state="running"}' in text and "aenv_lifecycle_seconds_bucket" in text
    assert 'aenv_node_cache{stat="hit_ratio"}' in text and "aenv_store_bytes" in text
    # [vm] ksm is on by default: the server started ksmd and reports what it saved
    assert 'aenv_ksm{stat="running"} 1' in text and 'aenv_ksm{stat="saved_bytes"}' in text
    status, _, _ = sdk_env.request("GET", "/metrics", key=None)
    assert status == 401
