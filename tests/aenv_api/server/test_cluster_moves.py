"""Moving sandboxes between nodes that share one repository (issue 16; docs/api.md
"Moving sandboxes"): two real ``aenv server`` processes, each with its own data dir,
node cache and run dir, one repository (a posix_fs directory, or moto's S3 server as
``oss``), driven through the real e2b SDK and the node endpoints
``POST /_aenv/cluster/sandboxes/{id}/adopt|release``."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from aenv_api.server.keystore import TEAMS_FILE, KeyStore
from aenv_wire.cluster import ClusterCode, adopt_path, release_path
from aenv_wire.fleet_auth import NODE_AUTH_HEADER, FleetKeys
from tests.aenv_store.backends.motoserver import MotoServer
from .conftest import AENV, REPO, Server, start_server
from tests.support import require

pytestmark = [pytest.mark.qemu]
# Checks that do not depend on the repository's backend run once, with the posix_fs pair
# (the suite stays lean; never a skip)
POSIX_FS_ONLY = pytest.mark.parametrize("pair", ["posix_fs"], indirect=True)


@dataclass
class Pair:
    a: Server
    b: Server
    repo_env: dict[str, str]
    backend: str
    team_keys: dict[str, str]       # "a", "b": a key of each of two teams both nodes know

    def sdk(self, node: Server) -> dict[str, Any]:
        """Connection options of the e2b SDK for ``node`` (two nodes: no environment variables).
        A node's first restore of a template it never ran fetches the template's memory from
        the repository (moto's S3 server takes minutes for it on a loaded 2-core box): a
        request timeout above the SDK's 60 s."""
        return {"api_key": node.api_key, "api_url": node.url, "sandbox_url": node.url, "request_timeout": 600}

    def aenv(self, node: Server, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update(self.repo_env)
        return subprocess.run([*AENV, "--data-dir", str(node.data_dir), *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)


def envd_token(node: Server, sid: str, generation: int = 0) -> str:
    """docs/api.md's client envd token, computed independently from the deployment's secret."""
    key = hmac.new(node.env["AENV_ENVD_SECRET"].encode(), b"aenv envd client token v1", hashlib.sha256).digest()
    mac = hmac.new(key, f"{sid}/{generation}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def traffic_token(node: Server, sid: str) -> str:
    """docs/api.md's traffic access token, computed independently."""
    key = hmac.new(node.env["AENV_ENVD_SECRET"].encode(), b"aenv traffic access token v1", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(hmac.new(key, sid.encode(), hashlib.sha256).digest()).rstrip(b"=").decode()


# the nodes' cluster routes take the fleet's node credential, never the API key
# (docs/security.md): the pair shares a fleet secret as a fleet's nodes and gateways do
FLEET_SECRET = "moves-fleet-secret-" + secrets.token_hex(8)
FLEET = FleetKeys.parse(FLEET_SECRET)


def cluster_call(node: Server, path: str, auth: str | None) -> tuple[int, Any]:
    """POST a cluster route with ``auth``: "fleet" (a gateway's credential for it), "api-key"
    (the deployment's key), another ``X-Aenv-Node-Auth`` value, or None (nothing)."""
    if auth == "api-key":
        status, _, body = node.request("POST", path)
        return status, body
    value = FLEET.request_credential("POST", path, time.time()) if auth == "fleet" else auth
    status, _, body = node.request("POST", path, key=None, headers={NODE_AUTH_HEADER: value} if value else None)
    return status, body


def adopt(node: Server, sid: str, auth: str | None = "fleet", force: bool = False) -> tuple[int, Any]:
    return cluster_call(node, adopt_path(sid, force), auth)


def adopt_committed(node: Server, sid: str, force: bool = False) -> tuple[int, Any]:
    """Adopt as soon as the holder's background commit of its pause is done: until then
    the repository has no such paused sandbox (404), as after a crash inside the commit."""
    deadline = time.monotonic() + 120
    while True:
        status, body = adopt(node, sid, force=force)
        if status != 404 or time.monotonic() > deadline:
            return status, body
        time.sleep(0.2)


def release(node: Server, sid: str, auth: str | None = "fleet") -> tuple[int, Any]:
    return cluster_call(node, release_path(sid), auth)


@pytest.fixture(scope="module", params=["posix_fs", "oss"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86_64 not installed")
    require(os.geteuid() == 0, "building the guest image needs root")
    root = tmp_path_factory.mktemp(f"moves-{request.param}")
    if request.param == "oss":
        moto: MotoServer = request.getfixturevalue("moto")
        cfg = moto.repository_config(moto.new_bucket())
        repo_env = {f"AENV_REPOSITORY__{k.upper()}": str(v) for k, v in cfg.items()}
    else:
        # the run's base (tests/seed.py) in the shared repository; the oss pair's first node
        # builds it there itself
        request.getfixturevalue("base_seed").copy_repository(root / "shared-repo")
        repo_env = {"AENV_REPOSITORY__BACKEND": "posix_fs", "AENV_REPOSITORY__PATH": str(root / "shared-repo")}
    # one deployment: the API key and the envd secret are shared by every node
    (root / "fleet-secret").write_text(FLEET_SECRET + "\n")
    env = {**repo_env, "AENV_API_KEY": "moves-" + secrets.token_hex(8), "AENV_ENVD_SECRET": secrets.token_hex(32),
           "AENV_CLUSTER__FLEET_SECRET_FILE": str(root / "fleet-secret"),
           "AENV_VM__POOL_SIZE": "0", "AENV_VM__MEMORY_MIB": "256"}
    team_keys = _shared_teams(root / "node-a", root / "node-b", api_key=env["AENV_API_KEY"])
    a = start_server(root / "node-a", root / "logs", env=env)   # oss: builds the base template into the repository
    b = None
    try:
        b = start_server(root / "node-b", root / "logs", env=env)   # finds it there
        yield Pair(a, b, repo_env, request.param, team_keys)
    finally:
        for srv in (b, a):
            if srv is not None:
                srv.stop()


def _shared_teams(*data_dirs: Path, api_key: str) -> dict[str, str]:
    """Two teams with a key each, in the same teams file of every node (as a fleet's
    nodes share one teams document): written before the nodes start."""
    store = KeyStore(data_dirs[0] / TEAMS_FILE, api_key)
    keys = {name: store.create_key(store.create_team(f"moves-{name}").team_id, "key")[1] for name in ("a", "b")}
    for d in data_dirs[1:]:
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy2(data_dirs[0] / TEAMS_FILE, d / TEAMS_FILE)
    return keys


def test_pause_release_adopt_connect_continues_on_the_other_node(pair: Pair) -> None:
    from e2b import Sandbox, SandboxState

    a, b = pair.a, pair.b
    s = Sandbox.create(metadata={"suite": "moves"}, timeout=600, network={"allow_public_traffic": False},
                       lifecycle={"on_timeout": "pause", "auto_resume": True}, **pair.sdk(a))
    sid = s.sandbox_id
    moved = False
    try:
        s.files.write("/home/user/moved.txt", "written on A")
        h = s.commands.run("sleep 3600", background=True)
        # a rotated token moves with the sandbox: its generation is in the record the pause commits
        first = s._envd_access_token
        status, _, rotated = a.request("POST", f"/sandboxes/{sid}/rotate-token")
        assert status == 200, rotated
        token = rotated["envdAccessToken"]
        assert token == envd_token(a, sid, 1) != first == envd_token(a, sid)
        s.pause()
        status, body = release(a, sid)
        assert status == 204, body
        assert a.request("GET", f"/sandboxes/{sid}")[0] == 404           # A forgot it
        status, body = release(a, sid)
        assert status == 404 and body["error_code"] == ClusterCode.NOT_HELD, body
        # gc while nobody holds it: the repository keeps everything the pause needs
        gc = pair.aenv(a, "repo", "gc", "--grace", "0")
        assert gc.returncode == 0, gc.stderr[-3000:]
        status, body = adopt(b, sid)
        assert status == 200, body
        moved = True
        assert body["sandboxID"] == sid and body["state"] == "paused" and body["metadata"] == {"suite": "moves"}
        status, again = adopt(b, sid)
        assert status == 409 and again["code"] == 409 and "already holds" in again["message"], again
        assert again["error_code"] == ClusterCode.ALREADY_HELD, again
        status, _, listed = b.request("GET", "/v2/sandboxes?state=paused")
        assert status == 200, listed
        assert sid in [x["sandboxID"] for x in listed]
        t = Sandbox.connect(sid, timeout=600, **pair.sdk(b))                # resumes it on B
        assert Sandbox.get_info(sid, **pair.sdk(b)).state == SandboxState.RUNNING
        assert t.files.read("/home/user/moved.txt") == "written on A"
        assert t.commands.run(f"kill -0 {h.pid} && echo alive").stdout.strip() == "alive"
        assert t._envd_access_token == token == envd_token(b, sid, 1)     # same id and generation, same token
        for old, want in ((first, 401), (token, 200)):
            status, _, _ = b.request("GET", "/files?path=/home/user/moved.txt", key=None,
                                     headers={"E2b-Sandbox-Id": sid, "X-Access-Token": old})
            assert status == want, (old == first, status)
        info = Sandbox.get_info(sid, **pair.sdk(b))
        assert info.metadata == {"suite": "moves"}
        # what the proxy applies moved too (the API's annotation): autoResume, the traffic token
        status, _, detail = b.request("GET", f"/sandboxes/{sid}")
        assert status == 200 and detail["lifecycle"]["autoResume"] is True, detail
        assert detail["network"]["allowPublicTraffic"] is False, detail
        status, _, body = b.request("POST", f"/v2/sandboxes/{sid}/connect", body={"timeout": 600})
        assert status == 200 and body["trafficAccessToken"] == traffic_token(b, sid), body
        # a second pause on B (over the files it fetched) and a resume there
        t.files.write("/home/user/moved.txt", "written on B")
        t.pause()
        t = Sandbox.connect(sid, timeout=600, **pair.sdk(b))
        assert t.files.read("/home/user/moved.txt") == "written on B"
        assert t.commands.run(f"kill -0 {h.pid} && echo alive").stdout.strip() == "alive"
        status, body = release(b, sid)
        assert status == 409 and "running" in body["message"], body           # release of a running one
        assert body["error_code"] == ClusterCode.NOT_PAUSED, body
    finally:
        Sandbox.kill(sid, **pair.sdk(b if moved else a))
    assert b.request("GET", f"/sandboxes/{sid}")[0] == 404


def test_a_stale_copy_does_not_resume_nor_delete_the_moved_sandbox(pair: Pair) -> None:
    """A adopted elsewhere without releasing (as after a SIGKILL of A and a move by the fleet):
    A's local paused record is stale; resuming it is a 409, killing it only forgets it."""
    from e2b import Sandbox

    a, b = pair.a, pair.b
    s = Sandbox.create(timeout=600, **pair.sdk(a))
    sid = s.sandbox_id
    try:
        s.files.write("/home/user/f.txt", "one")
        s.pause()
        status, body = adopt_committed(b, sid)
        assert status == 200, body
        status, _, body = a.request("POST", f"/v2/sandboxes/{sid}/connect", body={"timeout": 300})
        assert status == 409 and "moved" in body["message"] and "holds it now" in body["message"], body
        assert body["error_code"] == ClusterCode.MOVED, body
        assert a.request("DELETE", f"/sandboxes/{sid}")[0] == 204     # forgets the stale copy only
        t = Sandbox.connect(sid, timeout=600, **pair.sdk(b))
        assert t.files.read("/home/user/f.txt") == "one"
    finally:
        Sandbox.kill(sid, **pair.sdk(b))
        Sandbox.kill(sid, **pair.sdk(a))


def test_adopt_refuses_a_sandbox_resumed_after_its_pause_unless_forced(pair: Pair) -> None:
    """The holder resumed it (it may be running there): adopt is 409 unless forced (the
    caller knows that node is gone); forced, it continues from that pause on B, and the
    old node's copy can neither commit its next pause over it nor resume."""
    from e2b import Sandbox

    a, b = pair.a, pair.b
    s = Sandbox.create(timeout=600, **pair.sdk(a))
    sid = s.sandbox_id
    try:
        s.files.write("/home/user/f.txt", "at the pause")
        s.pause()
        s = Sandbox.connect(sid, timeout=600, **pair.sdk(a))            # running on A again
        s.files.write("/home/user/f.txt", "after the pause, on A")
        status, body = adopt_committed(b, sid)
        assert status == 409 and "was resumed on node" in body["message"], body
        assert body["error_code"] == ClusterCode.RESUMED_ELSEWHERE, body
        assert b.request("GET", f"/sandboxes/{sid}")[0] == 404
        status, body = adopt(b, sid, force=True)
        assert status == 200 and body["state"] == "paused", body
        s.pause()                            # A's pause: kept locally, not committed over B's
        status, _, body = a.request("POST", f"/v2/sandboxes/{sid}/connect", body={"timeout": 300})
        assert status == 409 and "moved" in body["message"], body
        t = Sandbox.connect(sid, timeout=600, **pair.sdk(b))
        assert t.files.read("/home/user/f.txt") == "at the pause"       # from the pause it was adopted at
        assert release(a, sid)[0] == 204                                 # the fleet clears A's copy
        assert a.request("GET", f"/sandboxes/{sid}")[0] == 404
        assert Sandbox.connect(sid, **pair.sdk(b)).files.read("/home/user/f.txt") == "at the pause"
    finally:
        Sandbox.kill(sid, **pair.sdk(b))
        Sandbox.kill(sid, **pair.sdk(a))


def test_snapshot_and_fork_snapshot_of_a_create_sandboxes_on_b(pair: Pair) -> None:
    from e2b import Sandbox

    a, b = pair.a, pair.b
    s = Sandbox.create(timeout=600, **pair.sdk(a))
    made: list[tuple[Server, str]] = [(a, s.sandbox_id)]
    name = f"moves-{secrets.token_hex(4)}"
    try:
        s.files.write("/home/user/snap.txt", "in the snapshot")
        h = s.commands.run("sleep 3600", background=True)
        status, _, snap = a.request("POST", f"/sandboxes/{s.sandbox_id}/snapshots", body={"name": name})
        assert status == 201, snap
        c = Sandbox.create(name, timeout=600, **pair.sdk(b))      # by name, on the other node
        made.append((b, c.sandbox_id))
        assert c.files.read("/home/user/snap.txt") == "in the snapshot"
        assert c.commands.run(f"kill -0 {h.pid} && echo alive").stdout.strip() == "alive"
        assert c.commands.run("hostname").stdout.strip() == c.sandbox_id
        # a fork's hidden snapshot is a template on every node: children beyond the parent's node
        status, _, forked = a.request("POST", f"/sandboxes/{s.sandbox_id}/fork", body={"count": 1})
        assert status == 201, forked
        child = forked[0]["sandbox"]
        made.append((a, child["sandboxID"]))
        deadline = time.monotonic() + 120     # its background commit, then it is in the repository
        while True:
            status, _, kid = b.request("POST", "/v2/sandboxes", body={"templateID": child["templateID"],
                                                                       "timeout": 600})
            if status == 201 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert status == 201, kid
        made.append((b, kid["sandboxID"]))
        k = Sandbox.connect(kid["sandboxID"], **pair.sdk(b))
        assert k.files.read("/home/user/snap.txt") == "in the snapshot"
    finally:
        for node, sid in reversed(made):
            Sandbox.kill(sid, **pair.sdk(node))
    Sandbox.delete_snapshot(snap["snapshotID"], **pair.sdk(a))


@POSIX_FS_ONLY
def test_a_teams_snapshot_is_its_own_on_the_other_node(pair: Pair) -> None:
    """A named snapshot's team is in its record in the repository (issue 31): on the node
    that did not take it, its team lists it and creates from it, another team and the
    default team get what an unknown snapshot gets."""
    from e2b import Sandbox

    a, b = pair.a, pair.b
    key_a, key_b = pair.team_keys["a"], pair.team_keys["b"]

    def sdk(node: Server, key: str) -> dict[str, Any]:
        return {**pair.sdk(node), "api_key": key}

    s = Sandbox.create(timeout=300, **sdk(a, key_a))
    made: list[tuple[Server, str]] = [(a, s.sandbox_id)]
    name = f"team-{secrets.token_hex(4)}"
    snap_id = None
    try:
        s.files.write("/home/user/team.txt", "team a's")
        status, _, snap = a.request("POST", f"/sandboxes/{s.sandbox_id}/snapshots", body={"name": name}, key=key_a)
        assert status == 201, snap
        snap_id = snap["snapshotID"]
        assert [x["snapshotID"] for x in b.request("GET", f"/snapshots?name={name}", key=key_a)[2]] == [snap_id]
        assert snap_id in [x["snapshotID"] for x in b.request("GET", "/snapshots", key=key_a)[2]]
        for key in (key_b, b.api_key):      # another team, and the default team (the deployment key)
            assert snap_id not in [x["snapshotID"] for x in b.request("GET", "/snapshots", key=key)[2]]
            assert b.request("GET", f"/snapshots?name={name}", key=key)[2] == []
            for ref in (snap_id, name):
                status, _, got = b.request("POST", "/v2/sandboxes", body={"templateID": ref}, key=key)
                assert status == 404, got
                status, _, got = b.request("POST", f"/snapshots/{ref}/fork", body={"count": 1}, key=key)
                assert status == 404, got
            status, _, got = b.request("DELETE", f"/templates/{snap_id}", key=key)
            assert status == 404, got
        c = Sandbox.create(name, timeout=300, **sdk(b, key_a))      # by name, on the other node
        made.append((b, c.sandbox_id))
        assert c.files.read("/home/user/team.txt") == "team a's"
    finally:
        for node, sid in reversed(made):
            Sandbox.kill(sid, **sdk(node, key_a))
        if snap_id is not None:     # its team deletes it on the node that did not take it
            assert b.request("DELETE", f"/templates/{snap_id}", key=key_a)[0] == 204


def test_bad_input(pair: Pair) -> None:
    a, b = pair.a, pair.b
    status, body = adopt(b, "sbx-0000000000000000")
    assert status == 404 and body["code"] == 404 and body["error_code"] == ClusterCode.NOT_COMMITTED, body
    status, body = release(b, "sbx-0000000000000000")
    assert status == 404 and body["error_code"] == ClusterCode.NOT_HELD, body
    for node in (a, b):   # the fleet's credential only: not the API key every client holds
        for call in (adopt, release):
            for auth in (None, "api-key", "v1 0 00", FLEET.request_credential("POST", "/sandboxes", time.time())):
                status, body = call(node, "sbx-0000000000000000", auth)
                assert status == 403 and body["code"] == 403, body
    status, body = cluster_call(b, "/_aenv/cluster/sandboxes/sbx-0000000000000000/adopt?force=maybe", "fleet")
    assert status == 400 and "force" in body["message"], body
    assert adopt(b, "sbx-!")[0] == 404      # "!" cannot be in a record name: no such sandbox


@POSIX_FS_ONLY
def test_a_sandbox_with_volumes_cannot_move(pair: Pair) -> None:
    from e2b import Sandbox

    a, b = pair.a, pair.b
    status, _, body = a.request("POST", "/volumes", body={"name": f"mv{secrets.token_hex(4)}"})
    assert status == 201, body
    vol = body
    s = Sandbox.create(timeout=600, volume_mounts={"/data": vol["name"]}, **pair.sdk(a))
    try:
        s.pause()
        status, body = release(a, s.sandbox_id)
        assert status == 409 and "volumes" in body["message"] and body["error_code"] == ClusterCode.NOT_MOVABLE, body
        status, body = adopt_committed(b, s.sandbox_id)
        assert status == 409 and "volumes" in body["message"] and body["error_code"] == ClusterCode.NOT_MOVABLE, body
        assert b.request("GET", f"/sandboxes/{s.sandbox_id}")[0] == 404       # nothing left on B
    finally:
        s.kill()
    a.request("DELETE", f"/volumes/{vol['volumeID']}")


@POSIX_FS_ONLY
def test_a_guest_cannot_reach_the_node_endpoints(pair: Pair) -> None:
    """The endpoints are on the API port, which no guest can open a connection to
    (tests/aenv_vm/isolation tries every port of the node); here a guest tries this API port
    through every address it could name the node by."""
    from e2b import Sandbox

    b = pair.b
    port = int(b.url.rsplit(":", 1)[1])
    s = Sandbox.create(timeout=300, **pair.sdk(b))
    try:
        probe = ("import json, socket\nout = {}\nfor h in ('10.0.2.2', '10.0.2.3', '127.0.0.1', '10.0.2.15'):\n"
                 "    try:\n        socket.create_connection((h, %d), 3).close(); out[h] = 'ok'\n"
                 "    except OSError as e:\n        out[h] = 'blocked'\nprint(json.dumps(out))\n" % port)
        s.files.write("/tmp/probe.py", probe)
        got = json.loads(s.commands.run("python3 /tmp/probe.py", timeout=60).stdout.strip())
        assert set(got.values()) == {"blocked"}, got
    finally:
        s.kill()


def test_the_repository_verifies_clean_after_the_moves(pair: Pair) -> None:
    """Last in the module: every move, stale copy and cross-node create above is done."""
    for args in (("repo", "gc", "--grace", "0"), ("repo", "verify", "--read-data")):
        done = pair.aenv(pair.b, *args)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
