"""Teams and API keys through the API in-process (inprocess.py, a fake sandbox service):
E2B's /teams and /api-keys routes, the admin routes, and what a team's key may see of
another team's sandboxes (nothing: 404, as for an id that does not exist). The real e2b
SDK, configured by environment variables only, takes part in the last test."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from aenv_api.server.keystore import DEFAULT_KEY_ID, DEFAULT_TEAM_ID, TEAMS_FILE

from .conftest import use_sdk_env
from .inprocess import InProcessServer

ADMIN = "admin-" + "x" * 26


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("teams"), admin_token=ADMIN)
    try:
        yield srv
    finally:
        srv.stop()


def admin(node: InProcessServer, method: str, path: str, body: Any = None,
          team: str | None = None) -> tuple[int, Any]:
    headers = {"X-Admin-Token": ADMIN, **({"X-Team-ID": team} if team else {})}
    status, _, got = node.request(method, path, body, headers=headers, key=None)
    return status, got


def new_team(node: InProcessServer, name: str) -> tuple[str, str]:
    """A new team and a key of it: (team id, key)."""
    status, team = admin(node, "POST", "/admin/teams", {"name": name})
    assert status == 201, team
    status, key = admin(node, "POST", f"/admin/teams/{team['teamID']}/api-keys", {"name": f"{name}-key"})
    assert status == 201, key
    return team["teamID"], key["key"]


def test_admin_credential_guards_team_management(node: InProcessServer) -> None:
    assert node.request("GET", "/admin/teams", key=None)[0] == 401
    status, _, body = node.request("GET", "/admin/teams", headers={"X-Admin-Token": "wrong" * 5}, key=None)
    assert status == 401 and "admin" in body["message"]
    # the deployment key is no admin credential
    assert node.request("POST", "/admin/teams", {"name": "nope"})[0] == 401
    status, teams = admin(node, "GET", "/admin/teams")
    assert status == 200 and {"teamID": DEFAULT_TEAM_ID, "name": "default", "isDefault": True}.items() <= \
        teams[0].items()
    assert admin(node, "POST", "/admin/teams", {})[0] == 400
    assert admin(node, "POST", "/admin/teams/nope/api-keys", {"name": "k"})[0] == 404
    assert admin(node, "DELETE", f"/admin/teams/{DEFAULT_TEAM_ID}")[0] == 409


def test_a_node_without_an_admin_credential_refuses_admin_calls(tmp_path: Path) -> None:
    srv = InProcessServer.start(tmp_path / "node")
    try:
        status, _, body = srv.request("GET", "/admin/teams", headers={"X-Admin-Token": ADMIN}, key=None)
        assert status == 403 and "AENV_ADMIN_TOKEN" in body["message"]
        # the deployment key works as it always did, and is the default team's
        status, _, teams = srv.request("GET", "/teams")
        assert status == 200 and teams == [{"teamID": DEFAULT_TEAM_ID, "name": "default", "apiKey": srv.api_key,
                                            "isDefault": True}]
        assert not (srv.data_dir / TEAMS_FILE).exists()
    finally:
        srv.stop()


def test_a_teams_keys_list_masked_create_once_rename_delete(node: InProcessServer) -> None:
    team, key = new_team(node, "keys")
    status, _, teams = node.request("GET", "/teams", key=key)
    assert status == 200 and teams == [{"teamID": team, "name": "keys", "apiKey": key, "isDefault": False}]
    status, _, made = node.request("POST", "/api-keys", {"name": "second"}, key=key)
    assert status == 201 and made["key"].startswith("e2b_") and made["name"] == "second"
    assert made["mask"] == {"prefix": "e2b_", "valueLength": 40, "maskedValuePrefix": made["key"][4:6],
                            "maskedValueSuffix": made["key"][-4:]}
    status, _, listed = node.request("GET", "/api-keys", key=made["key"])
    assert status == 200 and sorted(k["name"] for k in listed) == ["keys-key", "second"]
    text = json.dumps(listed)
    assert key not in text and made["key"] not in text and all("key" not in k for k in listed)
    status, _, renamed = node.request("PATCH", f"/api-keys/{made['id']}", {"name": "renamed"}, key=key)
    assert status == 200 and renamed["name"] == "renamed"
    # the admin acts for a team with X-Team-ID
    status, listed = admin(node, "GET", "/api-keys", team=team)
    assert status == 200 and sorted(k["name"] for k in listed) == ["keys-key", "renamed"]
    assert admin(node, "GET", "/api-keys")[0] == 400      # for which team?
    # another team's key id is not found; the team's own key stops working at once
    assert node.request("DELETE", f"/api-keys/{made['id']}")[0] == 404
    assert node.request("DELETE", f"/api-keys/{made['id']}", key=key)[0] == 204
    assert node.request("GET", "/teams", key=made["key"])[0] == 401
    assert node.request("GET", "/teams", key=key)[0] == 200
    # the default team sees its deployment key, masked, and cannot delete it through the API
    status, _, mine = node.request("GET", "/api-keys")
    assert status == 200 and mine[0]["id"] == DEFAULT_KEY_ID and node.api_key not in json.dumps(mine)
    assert node.request("DELETE", f"/api-keys/{DEFAULT_KEY_ID}")[0] == 409
    # no key is in the data dir in clear
    for k in (key, made["key"]):
        assert subprocess.run(["grep", "-r", "-F", k, str(node.data_dir)], capture_output=True).returncode == 1


def create(node: InProcessServer, key: str, **body: Any) -> str:
    status, _, got = node.request("POST", "/v2/sandboxes", {"templateID": "base", **body}, key=key)
    assert status == 201, got
    return str(got["sandboxID"])


def test_another_teams_sandbox_is_not_found(node: InProcessServer) -> None:
    _, key_a = new_team(node, "owner")
    team_b, key_b = new_team(node, "stranger")
    sid = create(node, key_a, metadata={"who": "a"})
    unknown = sid[:-3] + "zzz"
    for method, path, body in [("GET", "/sandboxes/{}", None), ("DELETE", "/sandboxes/{}", None),
                               ("POST", "/sandboxes/{}/timeout", {"timeout": 60}),
                               ("POST", "/sandboxes/{}/refreshes", {}),
                               ("PUT", "/sandboxes/{}/network", {}),
                               ("POST", "/v2/sandboxes/{}/connect", {"timeout": 60}),
                               ("POST", "/sandboxes/{}/connect", {"timeout": 60}),
                               ("POST", "/sandboxes/{}/pause", {}), ("POST", "/sandboxes/{}/resume", {}),
                               ("POST", "/sandboxes/{}/fork", {"count": 1}),
                               ("POST", "/sandboxes/{}/snapshots", {}),
                               ("GET", "/sandboxes/{}/logs", None), ("GET", "/v2/sandboxes/{}/logs", None),
                               ("GET", "/sandboxes/{}/metrics", None)]:
        status, _, got = node.request(method, path.format(sid), body, key=key_b)
        # exactly what an id that does not exist gets: no oracle
        status_unknown, _, got_unknown = node.request(method, path.format(unknown), body, key=key_b)
        assert status == status_unknown == 404, (method, path, got)
        assert got["message"] == got_unknown["message"].replace(unknown, sid), (method, path)
    # lists and counts leave it out, for B and for the default team
    for key in (key_b, node.api_key):
        status, headers, listed = node.request("GET", "/v2/sandboxes", key=key)
        assert status == 200 and sid not in [s["sandboxID"] for s in listed] and headers["X-Total-Running"] == "0"
        assert sid not in [s["sandboxID"] for s in node.request("GET", "/sandboxes", key=key)[2]]
        assert node.request("GET", f"/sandboxes/metrics?sandbox_ids={sid}", key=key)[2] == {"sandboxes": {}}
    status, headers, listed = node.request("GET", "/v2/sandboxes", key=key_a)
    assert [s["sandboxID"] for s in listed] == [sid] and headers["X-Total-Running"] == "1"
    # its owner's operations work; fork children are the owner's too
    status, _, forked = node.request("POST", f"/sandboxes/{sid}/fork", {"count": 1}, key=key_a)
    assert status == 201, forked
    child = forked[0]["sandbox"]["sandboxID"]
    assert node.request("GET", f"/sandboxes/{child}", key=key_b)[0] == 404
    assert node.request("GET", f"/sandboxes/{child}", key=key_a)[0] == 200
    # a paused sandbox of A is no snapshot B can start sandboxes from
    assert node.request("POST", f"/sandboxes/{sid}/pause", {}, key=key_a)[0] == 204
    status, _, got = node.request("POST", f"/snapshots/{sid}/fork", {"count": 1}, key=key_b)
    assert status == 404 and got["message"] == node.request("POST", f"/snapshots/{unknown}/fork", {"count": 1},
                                                            key=key_b)[2]["message"].replace(unknown, sid)
    status, _, batch = node.request("POST", f"/snapshots/{sid}/fork", {"count": 1}, key=key_a)
    assert status == 201 and "sandbox" in batch[0], batch
    assert node.request("GET", f"/sandboxes/{batch[0]['sandbox']['sandboxID']}", key=key_a)[0] == 200
    # a team with sandboxes is not deleted; once they are gone it is, and its keys fail
    assert admin(node, "DELETE", f"/admin/teams/{team_b}")[0] == 204
    assert node.request("GET", "/v2/sandboxes", key=key_b)[0] == 401
    status, counts = admin(node, "GET", "/admin/sandboxes/running-counts")
    assert status == 200
    owner_team = node.request("GET", "/teams", key=key_a)[2][0]["teamID"]
    assert {"teamID": owner_team, "runningSandboxes": 2, "pausedSandboxes": 1} in counts["teams"]
    assert admin(node, "DELETE", f"/admin/teams/{owner_team}")[0] == 409
    node.kill_all()
    assert admin(node, "DELETE", f"/admin/teams/{owner_team}")[0] == 204
    assert node.request("GET", "/teams", key=key_a)[0] == 401


def test_another_teams_named_snapshot_is_not_found(node: InProcessServer) -> None:
    """A named snapshot outlives its sandbox; it stays its team's: others neither list,
    fork, create from, nor delete it, and get what an unknown snapshot gets."""
    _, key_a = new_team(node, "snap-a")
    _, key_b = new_team(node, "snap-b")
    sid = create(node, key_a)
    status, _, snap = node.request("POST", f"/sandboxes/{sid}/snapshots", {"name": "a-task"}, key=key_a)
    assert status == 201, snap
    snap_id = snap["snapshotID"]
    assert node.request("DELETE", f"/sandboxes/{sid}", key=key_a)[0] == 204
    mine = create(node, node.api_key)
    status, _, own = node.request("POST", f"/sandboxes/{mine}/snapshots", {"name": "default-task"})
    assert status == 201
    for key in (key_b, node.api_key):
        listed = node.request("GET", "/snapshots", key=key)[2]
        assert snap_id not in [s["snapshotID"] for s in listed]
        for ref in ("a-task", snap_id):
            status, _, got = node.request("POST", f"/snapshots/{ref}/fork", {"count": 1}, key=key)
            status_unknown, _, unknown = node.request("POST", "/snapshots/no-such/fork", {"count": 1}, key=key)
            assert status == status_unknown == 404 and got["message"] == unknown["message"].replace("no-such", ref)
            status, _, got = node.request("POST", "/v2/sandboxes", {"templateID": ref}, key=key)
            status_unknown, _, unknown = node.request("POST", "/v2/sandboxes", {"templateID": "no-such"}, key=key)
            assert status == status_unknown == 404 and got["message"] == unknown["message"].replace("no-such", ref)
        status, _, got = node.request("DELETE", f"/templates/{snap_id}", key=key)
        assert status == 404, got
    # B does not see the default team's snapshot either; its owners do
    assert own["snapshotID"] not in [s["snapshotID"] for s in node.request("GET", "/snapshots", key=key_b)[2]]
    assert own["snapshotID"] in [s["snapshotID"] for s in node.request("GET", "/snapshots")[2]]
    assert [s["snapshotID"] for s in node.request("GET", "/snapshots", key=key_a)[2]] == [snap_id]
    status, _, batch = node.request("POST", "/snapshots/a-task/fork", {"count": 1}, key=key_a)
    assert status == 201 and "sandbox" in batch[0], batch
    assert node.request("POST", "/v2/sandboxes", {"templateID": "a-task"}, key=key_a)[0] == 201
    node.kill_all()
    assert node.request("DELETE", f"/templates/{snap_id}", key=key_a)[0] == 204
    assert node.request("DELETE", f"/templates/{own['snapshotID']}")[0] == 204


def test_another_teams_volume_is_not_found(node: InProcessServer) -> None:
    _, key_a = new_team(node, "vol-a")
    _, key_b = new_team(node, "vol-b")
    status, _, vol = node.request("POST", "/volumes", {"name": "team-a-data"}, key=key_a)
    assert status == 201, vol
    vid = vol["volumeID"]
    unknown = "00000000-0000-4000-8000-000000000000"
    for key in (key_b, node.api_key):
        assert vid not in [v["volumeID"] for v in node.request("GET", "/volumes", key=key)[2]]
        for method in ("GET", "DELETE"):
            status, _, got = node.request(method, f"/volumes/{vid}", key=key)
            assert (status, got) == node.request(method, f"/volumes/{unknown}", key=key)[::2] == \
                (404, {"code": 404, "message": "Volume not found"})
        mount = {"templateID": "base", "volumeMounts": [{"name": "team-a-data", "path": "/mnt/data"}]}
        status, _, got = node.request("POST", "/v2/sandboxes", mount, key=key)
        none = {"templateID": "base", "volumeMounts": [{"name": "no-such-vol", "path": "/mnt/data"}]}
        status_unknown, _, unknown_got = node.request("POST", "/v2/sandboxes", none, key=key)
        assert status == status_unknown == 404
        assert got["message"] == unknown_got["message"].replace("no-such-vol", "team-a-data")
    assert [v["volumeID"] for v in node.request("GET", "/volumes", key=key_a)[2]] == [vid]
    assert node.request("GET", f"/volumes/{vid}", key=key_a)[2]["token"] == vol["token"]
    create(node, key_a, volumeMounts=[{"name": "team-a-data", "path": "/mnt/data"}])
    node.kill_all()
    assert node.request("DELETE", f"/volumes/{vid}", key=key_a)[0] == 204


def test_the_nodes_own_routes_take_the_deployment_key_only(node: InProcessServer) -> None:
    """/metrics, /nodes (which drains the node) and the fleet's adopt/release are the
    node's, not a team's: another team's key gets 403; the deployment key as before
    (adopt/release take the fleet's node credential only: tests/aenv_api/server/test_cluster_auth.py)."""
    _, key = new_team(node, "not-the-operator")
    from aenv_wire.cluster import ADOPT_ROUTE, RELEASE_ROUTE

    sid = "sbx-" + "0" * 20
    for method, path, body in [("GET", "/metrics", None), ("GET", "/nodes", None),
                               ("GET", "/nodes/inprocess-node", None),
                               ("POST", "/nodes/inprocess-node", {"status": "draining"}),
                               ("POST", ADOPT_ROUTE.replace("{sandboxID}", sid), None),
                               ("POST", RELEASE_ROUTE.replace("{sandboxID}", sid), None)]:
        status, _, got = node.request(method, path, body, key=key)
        why = "X-Aenv-Node-Auth" if path.startswith("/_aenv/") else "deployment key"
        assert status == 403 and why in got["message"], (method, path, got)
    assert node.request("GET", "/metrics")[0] == 200
    assert node.request("GET", "/nodes")[0] == 200
    assert node.request("GET", "/v2/sandboxes", key=key)[0] == 200     # its own routes work


def test_idempotency_keys_are_per_team(node: InProcessServer) -> None:
    _, key_a = new_team(node, "idem-a")
    _, key_b = new_team(node, "idem-b")
    same = {"Idempotency-Key": "one-create"}
    a = node.request("POST", "/v2/sandboxes", {"templateID": "base"}, headers=same, key=key_a)[2]["sandboxID"]
    status, _, b = node.request("POST", "/v2/sandboxes", {"templateID": "base"}, headers=same, key=key_b)
    assert status == 201 and b["sandboxID"] != a     # B's create is B's own, not a replay of A's
    node.kill_all()


def test_sdk_team_keys_see_only_their_own(node: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real e2b SDK, configured only by E2B_* variables: team A's sandbox is invisible
    to team B's key (list, connect, kill); the deployment key still works as before."""
    from e2b import NotFoundException, Sandbox

    _, key_a = new_team(node, "sdk-a")
    _, key_b = new_team(node, "sdk-b")
    use_sdk_env(node, monkeypatch)
    monkeypatch.setenv("E2B_API_KEY", key_a)
    a = Sandbox.create(metadata={"team": "a"}, timeout=300)
    assert [s.sandbox_id for s in Sandbox.list().next_items()] == [a.sandbox_id]
    monkeypatch.setenv("E2B_API_KEY", key_b)
    assert Sandbox.list().next_items() == []
    with pytest.raises(NotFoundException):
        Sandbox.connect(a.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(a.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.pause(a.sandbox_id)
    assert Sandbox.kill(a.sandbox_id) is False        # the SDK's answer to a 404
    monkeypatch.setenv("E2B_API_KEY", node.api_key)
    d = Sandbox.create(timeout=300)
    assert [s.sandbox_id for s in Sandbox.list().next_items()] == [d.sandbox_id]
    assert d.get_info().sandbox_id == d.sandbox_id and d.is_running()
    monkeypatch.setenv("E2B_API_KEY", key_a)
    assert Sandbox.connect(a.sandbox_id).sandbox_id == a.sandbox_id
    assert Sandbox.kill(a.sandbox_id) is True
    node.kill_all()


def test_async_sdk_team_keys_see_only_their_own(node: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through the async SDK (AsyncSandbox), keys from E2B_API_KEY only."""
    import asyncio

    from e2b import AsyncSandbox, NotFoundException

    _, key_a = new_team(node, "async-a")
    _, key_b = new_team(node, "async-b")
    use_sdk_env(node, monkeypatch)

    async def scenario() -> None:
        monkeypatch.setenv("E2B_API_KEY", key_a)
        a = await AsyncSandbox.create(timeout=300)
        monkeypatch.setenv("E2B_API_KEY", key_b)
        assert await AsyncSandbox.list().next_items() == []
        with pytest.raises(NotFoundException):
            await AsyncSandbox.connect(a.sandbox_id)
        assert await AsyncSandbox.kill(a.sandbox_id) is False
        monkeypatch.setenv("E2B_API_KEY", key_a)
        assert [s.sandbox_id for s in await AsyncSandbox.list().next_items()] == [a.sandbox_id]
        assert await AsyncSandbox.kill(a.sandbox_id) is True

    asyncio.run(scenario())


def test_admin_kills_every_sandbox_of_a_team_and_no_other(node: InProcessServer) -> None:
    team_a, key_a = new_team(node, "kill-a")
    _, key_b = new_team(node, "kill-b")
    made_a = [node.request("POST", "/sandboxes", {"templateID": "base"}, key=key_a)[2]["sandboxID"] for _ in range(2)]
    keep_b = node.request("POST", "/sandboxes", {"templateID": "base"}, key=key_b)[2]["sandboxID"]
    assert node.request("POST", f"/sandboxes/{made_a[1]}/pause", key=key_a)[0] == 204    # paused ones too
    assert node.request("POST", f"/admin/teams/{team_a}/sandboxes/kill", key=key_a)[0] == 401   # admin only
    status, got = admin(node, "POST", f"/admin/teams/{team_a}/sandboxes/kill")
    assert status == 200 and got == {"killedCount": 2, "failedCount": 0}, got
    for sid in made_a:
        assert node.request("GET", f"/sandboxes/{sid}", key=key_a)[0] == 404
    assert node.request("GET", f"/sandboxes/{keep_b}", key=key_b)[0] == 200
    assert admin(node, "POST", f"/admin/teams/{team_a}/sandboxes/kill") == (200, {"killedCount": 0, "failedCount": 0})
    assert admin(node, "POST", "/admin/teams/no-such-team/sandboxes/kill")[0] == 404
    assert node.request("DELETE", f"/sandboxes/{keep_b}", key=key_b)[0] == 204


def test_access_tokens_are_e2bs_deprecated_answer(node: InProcessServer) -> None:
    status, _, body = node.request("POST", "/access-tokens", {"name": "ci"})
    assert status == 410 and "API key" in body["message"] and body["code"] == 410, body
    status, _, body = node.request("DELETE", "/access-tokens/0b1f5c7e-1111-4e4e-9999-000000000000")
    assert status == 404 and body["code"] == 404
    assert node.request("POST", "/access-tokens", {"name": "ci"}, key=None)[0] == 401
