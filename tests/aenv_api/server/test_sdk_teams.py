"""Teams on a real `aenv server` (QEMU guests) through the real e2b SDK, configured only
by E2B_* variables: team A's key creates a sandbox and runs in it; team B's key neither
lists, connects to, pauses nor kills it (404 as for an unknown id); the deployment key
still works as it did, and sees neither team's sandbox. Keys and ownership survive a
restart of the node (the keys in teams.json, the team in the sandbox's record). The npm
SDK and the Python async SDK do the same with forks, snapshots and volumes too."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from .conftest import Server, serving, use_sdk_env

pytestmark = pytest.mark.qemu

ADMIN = "sdk-teams-admin-" + "z" * 16


@pytest.fixture
def node(node_data_dir: Path, tmp_path: Path) -> Iterator[Server]:
    with serving(node_data_dir, tmp_path / "logs", env={"AENV_ADMIN_TOKEN": ADMIN}) as srv:
        yield srv


def new_team(node: Server, name: str) -> tuple[str, str]:
    admin = {"X-Admin-Token": ADMIN}
    status, _, team = node.request("POST", "/admin/teams", {"name": name}, headers=admin, key=None)
    assert status == 201, team
    status, _, key = node.request("POST", f"/admin/teams/{team['teamID']}/api-keys", {"name": "sdk"},
                                  headers=admin, key=None)
    assert status == 201, key
    return team["teamID"], key["key"]


def test_team_keys_through_the_sdk(node: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import NotFoundException, Sandbox

    team_a, key_a = new_team(node, "sdk-team-a")
    team_b, key_b = new_team(node, "sdk-team-b")
    use_sdk_env(node, monkeypatch)
    monkeypatch.setenv("E2B_API_KEY", key_a)
    a = Sandbox.create(metadata={"team": "a"}, timeout=300)
    try:
        assert a.commands.run("echo team-a").stdout.strip() == "team-a"
        assert [s.sandbox_id for s in Sandbox.list().next_items()] == [a.sandbox_id]

        monkeypatch.setenv("E2B_API_KEY", key_b)
        assert Sandbox.list().next_items() == []
        with pytest.raises(NotFoundException):
            Sandbox.connect(a.sandbox_id)
        with pytest.raises(NotFoundException):
            Sandbox.pause(a.sandbox_id)
        assert Sandbox.kill(a.sandbox_id) is False

        # the deployment key: creates and runs as before, and does not see team A's
        monkeypatch.setenv("E2B_API_KEY", node.api_key)
        d = Sandbox.create(timeout=300)
        try:
            assert d.commands.run("echo default").stdout.strip() == "default"
            assert [s.sandbox_id for s in Sandbox.list().next_items()] == [d.sandbox_id]
        finally:
            d.kill()

        # team A's sandbox lived through all that
        monkeypatch.setenv("E2B_API_KEY", key_a)
        again = Sandbox.connect(a.sandbox_id)
        assert again.commands.run("echo still").stdout.strip() == "still"
    finally:
        monkeypatch.setenv("E2B_API_KEY", key_a)
        Sandbox.kill(a.sandbox_id)
    admin = {"X-Admin-Token": ADMIN}
    for team in (team_a, team_b):
        assert node.request("DELETE", f"/admin/teams/{team}", headers=admin, key=None)[0] == 204


def test_keys_and_ownership_survive_a_restart(node_data_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import NotFoundException, Sandbox

    env = {"AENV_ADMIN_TOKEN": ADMIN}
    with serving(node_data_dir, tmp_path / "logs-1", env=env) as first:
        team_a, key_a = new_team(first, "restart-a")
        team_b, key_b = new_team(first, "restart-b")
        use_sdk_env(first, monkeypatch)
        monkeypatch.setenv("E2B_API_KEY", key_a)
        a = Sandbox.create(timeout=600)
        a.files.write("/home/user/mark", "kept")
        assert a.pause()
    with serving(node_data_dir, tmp_path / "logs-2", env=env) as second:
        use_sdk_env(second, monkeypatch)
        monkeypatch.setenv("E2B_API_KEY", key_b)
        assert Sandbox.list().next_items() == []
        with pytest.raises(NotFoundException):
            Sandbox.connect(a.sandbox_id)
        monkeypatch.setenv("E2B_API_KEY", key_a)
        assert [s.sandbox_id for s in Sandbox.list().next_items()] == [a.sandbox_id]
        back = Sandbox.connect(a.sandbox_id)
        try:
            assert back.files.read("/home/user/mark") == "kept"
        finally:
            back.kill()
        admin = {"X-Admin-Token": ADMIN}
        for team in (team_a, team_b):
            assert second.request("DELETE", f"/admin/teams/{team}", headers=admin, key=None)[0] == 204


def test_templates_are_their_teams_through_the_sdk(node: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Team A builds a template with the SDK's Template API; team B can neither create
    from it nor build from it (404, as a template that does not exist), but creates from
    the node's ``base``; once A publishes it (``PATCH`` ``public``), B creates from it."""
    from e2b import Sandbox, Template

    team_a, key_a = new_team(node, "tpl-sdk-a")
    team_b, key_b = new_team(node, "tpl-sdk-b")
    use_sdk_env(node, monkeypatch)
    monkeypatch.setenv("E2B_API_KEY", key_a)
    Template.build(Template().from_template("base").run_cmd("echo team-a > /home/user/made-by"), "sdk-a-own-tpl",
                   cpu_count=1, memory_mb=512)
    a = Sandbox.create("sdk-a-own-tpl", timeout=300)
    try:
        assert a.files.read("/home/user/made-by").strip() == "team-a"
    finally:
        a.kill()

    monkeypatch.setenv("E2B_API_KEY", key_b)
    with pytest.raises(Exception) as refused:
        Sandbox.create("sdk-a-own-tpl", timeout=300)
    assert "404" in str(refused.value) or "not found" in str(refused.value).lower(), refused.value
    with pytest.raises(Exception) as refused:
        Template.build(Template().from_template("sdk-a-own-tpl").run_cmd("true"), "sdk-b-child-tpl",
                       cpu_count=1, memory_mb=512)
    assert "sdk-a-own-tpl" in str(refused.value), refused.value
    b = Sandbox.create("base", timeout=300)
    try:
        assert b.commands.run("echo team-b").stdout.strip() == "team-b"
    finally:
        b.kill()

    # published by its team: every team's to create from (and still A's to change)
    status, _, _ = node.request("PATCH", "/v2/templates/sdk-a-own-tpl", {"public": True}, key=key_a)
    assert status == 200
    shared = Sandbox.create("sdk-a-own-tpl", timeout=300)
    try:
        assert shared.files.read("/home/user/made-by").strip() == "team-a"
    finally:
        shared.kill()
    assert node.request("DELETE", "/templates/sdk-a-own-tpl", key=key_b)[0] == 404
    assert node.request("DELETE", "/templates/sdk-a-own-tpl", key=key_a)[0] == 204
    # B's refused build still made B's template (the SDK names it before its build is
    # refused): a team that owns a template is not deleted until it goes
    admin = {"X-Admin-Token": ADMIN}
    status, _, body = node.request("DELETE", f"/admin/teams/{team_b}", headers=admin, key=None)
    assert status == 409 and "sdk-b-child-tpl" in body["message"], body
    assert node.request("DELETE", "/templates/sdk-b-child-tpl", key=key_b)[0] == 204
    for team in (team_a, team_b):
        assert node.request("DELETE", f"/admin/teams/{team}", headers=admin, key=None)[0] == 204


NODE_DIR = Path(__file__).resolve().parent / "node"


def test_two_teams_through_the_npm_and_async_sdks(node: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The npm SDK (node/teams_flow.mjs) and the Python async SDK, each with two teams'
    keys: A creates, lists, forks, snapshots, pauses, connects and makes a volume; B sees
    none of it and gets "not found" wherever it names A's, as for an id that does not exist."""
    import asyncio
    import json
    import os
    import shutil
    import subprocess

    from e2b import AsyncSandbox, NotFoundException

    from tests.support import require

    require(shutil.which("node") is not None, "node is not installed (scripts/install.sh installs it)")
    require((NODE_DIR / "node_modules" / "e2b").is_dir(), "e2b npm package missing: run scripts/install.sh")
    team_a, key_a = new_team(node, "npm-team-a")
    team_b, key_b = new_team(node, "npm-team-b")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(node.sdk_env(), KEY_A=key_a, KEY_B=key_b)
    env.pop("E2B_API_KEY", None)
    done = subprocess.run(["node", "teams_flow.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(got["aLists"]) == 1 and got["bLists"] == [], got
    for what in ("bConnect", "bInfo", "bFork", "bSnapshot", "bFromSnapshot", "bVolumeInfo", "bResume"):
        assert got[what] == "not found", (what, got)
    assert got["bKill"] is False and got["bVolumes"] is False and got["aVolumes"] is True, got
    assert got["aFromSnapshot"] == got["aForked"] == got["aResumed"] == "from team a", got
    assert got["aPaused"] and got["bListsSnapshots"] == [] and got["aDeletesSnapshot"] is True, got
    assert got["bDeletesSnapshot"] in (False, "not found"), got      # and A's delete after it found it

    use_sdk_env(node, monkeypatch)

    async def async_flow() -> None:
        a = await AsyncSandbox.create(api_key=key_a, timeout=300)
        try:
            await a.files.write("/home/user/async", "a's")
            assert [s.sandbox_id for s in await AsyncSandbox.list(api_key=key_a).next_items()] == [a.sandbox_id]
            assert await AsyncSandbox.list(api_key=key_b).next_items() == []
            with pytest.raises(NotFoundException):
                await AsyncSandbox.connect(a.sandbox_id, api_key=key_b)
            with pytest.raises(NotFoundException):
                await AsyncSandbox.get_info(a.sandbox_id, api_key=key_b)
            assert await AsyncSandbox.kill(a.sandbox_id, api_key=key_b) is False
            await a.pause()
            with pytest.raises(NotFoundException):
                await AsyncSandbox.connect(a.sandbox_id, api_key=key_b)     # nor resumes it
            back = await AsyncSandbox.connect(a.sandbox_id, api_key=key_a)
            assert await back.files.read("/home/user/async") == "a's"
        finally:
            await AsyncSandbox.kill(a.sandbox_id, api_key=key_a)
    asyncio.run(async_flow())
    admin = {"X-Admin-Token": ADMIN}
    for team in (team_a, team_b):
        status, _, body = node.request("DELETE", f"/admin/teams/{team}", headers=admin, key=None)
        assert status == 204, body
