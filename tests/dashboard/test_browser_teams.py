"""The admin's pages of the dashboard in Chromium, against a node's real API over the
in-memory sandbox service (no VMs) with an admin credential: the admin logs in with it,
creates a team, sets its quota (a byte quota refused with the API's message), makes a
key that the real e2b SDK uses until the quota answers 429 (the page shows the use at
the quota), kills the team's sandboxes and deletes its key and the team from the page.
A team's key sees no Teams page and the admin routes refuse it. Every request the page
makes goes to the server's own host."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from aenv_wire.team_keys import DEFAULT_TEAM_ID
from tests.aenv_api.server.conftest import use_sdk_env
from tests.aenv_api.server.inprocess import InProcessServer

from . import test_browser_inprocess as node_tests
from .browser import Session, screenshot

# the node's browser tests' page: at its end no script error and no request to another host
session = node_tests.session

ADMIN = "dashboard-admin-token-teams-0123"
ADMIN_HEADERS = {"X-Admin-Token": ADMIN}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    # team metrics sampled every 0.2 s (5 s by default): the chart has samples within the test
    srv = InProcessServer.start(tmp_path_factory.mktemp("dash-teams"), templates=True, admin_token=ADMIN,
                                server={"team_metrics_interval": 0.2})
    try:
        yield srv
    finally:
        srv.stop()


def admin(node: InProcessServer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, _, got = node.request(method, path, body, headers=ADMIN_HEADERS, key=None)
    return status, got


def admin_login(session: Session, token: str = ADMIN) -> None:
    session.open()
    session.page.check("#login-as-admin")
    session.page.fill("#api-key", token)
    session.page.click("form.login button[type=submit]")


def team_key(node: InProcessServer, name: str) -> tuple[str, str]:
    status, team = admin(node, "POST", "/admin/teams", {"name": name})
    assert status == 201, team
    status, made = admin(node, "POST", f"/admin/teams/{team['teamID']}/api-keys", {"name": "k"})
    assert status == 201, made
    return team["teamID"], made["key"]


def test_the_admin_runs_a_team_from_the_page(session: Session, node: InProcessServer, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import RateLimitException, Sandbox

    page = session.page
    admin_login(session)
    page.wait_for_selector("#teams a.team")
    assert page.locator('#nav a[href="#/teams"]').is_visible()
    assert page.locator('#nav a[href="#/sandboxes"]').is_hidden() and page.locator('#nav a[href="#/keys"]').is_hidden()
    assert page.evaluate("sessionStorage.getItem('aenv.apiKey')") is None
    # a team made from the keyboard: its page opens
    page.focus("#team-name")
    page.keyboard.type("dash-admin")
    page.keyboard.press("Enter")
    page.wait_for_url("**#/teams/*")
    tid = page.url.rsplit("/", 1)[-1]
    assert any(t["teamID"] == tid and t["name"] == "dash-admin" for t in admin(node, "GET", "/admin/teams")[1])
    page.wait_for_selector("#team-title:text('dash-admin')")
    # its quota; a byte quota is the API's 400, shown as its message
    page.fill("#quota-createsPerSecond", "0")
    page.click("#quota-save")
    page.wait_for_selector("#quota-error:not(:empty)")
    status, refused = admin(node, "PUT", f"/admin/teams/{tid}/quota", {"createsPerSecond": 0})
    assert status == 400 and page.inner_text("#quota-error") == refused["message"]
    for field, value in (("runningSandboxes", "2"), ("pausedSandboxes", "1"), ("createsPerSecond", "50"),
                         ("concurrentBuilds", "1"), ("volumeBytes", "1000000"), ("snapshotBytes", "2000000")):
        page.fill(f"#quota-{field}", value)
    page.click("#quota-save")
    page.wait_for_selector("#toast.show:text('quota saved')")
    assert page.inner_text("#quota-error") == ""
    assert admin(node, "GET", f"/admin/teams/{tid}/quota")[1] == {
        "runningSandboxes": 2, "pausedSandboxes": 1, "createsPerSecond": 50.0, "concurrentBuilds": 1,
        "volumeBytes": 1000000, "snapshotBytes": 2000000}
    # a key, shown once; the real SDK creates with it until the quota answers 429
    page.fill("#key-name", "sdk")
    page.click("#key-create")
    page.wait_for_selector("#new-key-value")
    key = page.inner_text("#new-key-value")
    use_sdk_env(node, monkeypatch)
    monkeypatch.setenv("E2B_API_KEY", key)
    made = []
    with pytest.raises(RateLimitException, match=r"maximum number of concurrent E2B sandboxes \(2\)"):
        for _ in range(3):
            made.append(Sandbox.create(timeout=300))
    assert len(made) == 2
    made[0].pause()
    page.wait_for_selector("#team-running:has-text('1 of 2 running')")
    page.wait_for_selector("#team-paused:has-text('1 of 1 paused')")
    assert Sandbox.connect(made[0].sandbox_id).is_running()          # resumed: the team is at its quota again
    page.wait_for_selector("#team-running:has-text('2 of 2 running')")
    page.wait_for_function("Number(document.querySelector('#chart-concurrent').dataset.samples) > 0")
    assert page.get_attribute("#team-running .bar .fill", "class") == "fill high"
    screenshot(session, "team", tmp_path)
    session.open("/teams")                       # the list: the team at its quota, its key counted
    row = page.locator("tr", has=page.locator(f'a.team[data-team="{tid}"]'))
    row.locator(":text('2 of 2 running')").wait_for()
    assert "0 of 1 paused" in row.inner_text() and "\t1\t" in row.inner_text()
    screenshot(session, "teams", tmp_path)
    # the API's refusal as its message: a team with sandboxes is not deleted
    asked: list[str] = []
    answer = {"accept": False}
    page.on("dialog", lambda d: (asked.append(d.message), d.accept() if answer["accept"] else d.dismiss()))
    row.locator("button.team-delete").click()
    page.wait_for_timeout(300)
    assert asked and "dash-admin" in asked[-1]                       # asked, refused: nothing happened
    answer["accept"] = True
    row.locator("button.team-delete").click()
    page.wait_for_selector("#toast.show.error")
    assert "still has 2 sandbox(es)" in page.inner_text("#toast")
    # kill them all from the team's page: confirmed, and the API agrees
    page.click(f'a.team[data-team="{tid}"]')
    page.wait_for_selector("#team-running:has-text('2 of 2 running')")
    page.click("#team-kill")
    page.wait_for_selector("#team-action-result:text('killed 2, failed 0')")
    assert node.request("GET", "/v2/sandboxes", key=key)[2] == []
    counts = admin(node, "GET", "/admin/sandboxes/running-counts")[1]["teams"]
    assert {"teamID": tid, "runningSandboxes": 0, "pausedSandboxes": 0} in counts
    page.wait_for_selector("#team-running:has-text('0 of 2 running')")
    # a build the team requested (not started) is cancelled from the page
    status, _, build = node.request("POST", "/v2/templates", {"alias": "dash-admin-tpl", "cpuCount": 1,
                                                              "memoryMB": 256}, key=key)
    assert status == 202, build
    page.click("#team-cancel-builds")
    page.wait_for_selector("#team-action-result:text('cancelled 1 build(s), failed 0')")
    status, _, ended = node.request("GET", f"/templates/{build['templateID']}/builds/{build['buildID']}/status",
                                    key=key)
    assert status == 200 and ended["status"] == "error" and "cancelled by the admin" in json.dumps(ended), ended
    # a team that owns a template is not deleted (the API's 409, shown); the template goes first
    page.click("#team-delete")
    page.wait_for_selector("#toast.show.error:has-text('template')")
    assert "still owns 1 template(s) (dash-admin-tpl)" in page.inner_text("#toast")
    assert node.request("DELETE", f"/templates/{build['templateID']}", key=key)[0] == 204
    # the key deleted on the page is refused at once
    kid = next(k["id"] for k in admin(node, "GET", f"/admin/teams/{tid}/api-keys")[1] if k["name"] == "sdk")
    page.click(f'button[data-key="{kid}"]')
    page.wait_for_selector(f'button[data-key="{kid}"]', state="detached")
    assert node.request("GET", "/v2/sandboxes", key=key)[0] == 401
    page.click("#team-delete")
    page.wait_for_url("**#/teams")
    page.wait_for_selector("#teams a.team")
    assert page.locator(f'a.team[data-team="{tid}"]').count() == 0
    assert admin(node, "GET", f"/admin/teams/{tid}/quota")[0] == 404
    assert not [u for u in session.requests if "/v2/sandboxes" in u]   # the admin's page asks no team route


def test_a_teams_key_sees_no_teams_page(session: Session, node: InProcessServer) -> None:
    tid, key = team_key(node, "dash-keyonly")
    session.login(key)
    page = session.page
    page.wait_for_selector("#list-info:not(:empty)")
    assert page.locator('#nav a[href="#/teams"]').is_hidden()
    for route in ("/teams", f"/teams/{tid}"):
        session.open(route)
        page.wait_for_selector("#wrong-credential")
        assert "admin token" in page.inner_text("#wrong-credential")
    assert not [u for u in session.requests if "/admin/" in u]          # the page did not even ask
    # and the API refuses the key on every admin route
    for method, path in (("GET", "/admin/teams"), ("POST", f"/admin/teams/{tid}/sandboxes/kill"),
                         ("PUT", f"/admin/teams/{tid}/quota"), ("GET", f"/admin/teams/{tid}/api-keys"),
                         ("POST", f"/admin/teams/{tid}/builds/cancel"), ("DELETE", f"/admin/teams/{tid}")):
        status, _, _ = node.request(method, path, {} if method in ("POST", "PUT") else None, key=key)
        assert status in (401, 403, 404), (method, path, status)
    assert admin(node, "DELETE", f"/admin/teams/{tid}")[0] == 204


def test_a_wrong_admin_token_sees_only_the_login(session: Session, node: InProcessServer) -> None:
    page = session.page
    admin_login(session, "not-the-admin-token-0000000000")
    page.wait_for_selector("#login-error:not(:empty)")
    status, _, refused = node.request("GET", "/admin/teams", key=None,
                                      headers={"X-Admin-Token": "not-the-admin-token-0000000000"})
    assert status == 401 and page.inner_text("#login-error") == refused["message"]
    assert page.evaluate("sessionStorage.getItem('aenv.adminToken')") is None and page.locator("#nav").is_hidden()
    # the right one: a team key's page is not the admin's (and does not log it out)
    admin_login(session)
    page.wait_for_selector("#teams a.team")
    session.open("/sandboxes")
    page.wait_for_selector("#wrong-credential")
    assert "API key" in page.inner_text("#wrong-credential")
    # a team that does not exist: the API's message, no blank page
    session.open("/teams/no-such-team")
    page.wait_for_selector(".api-error")
    status, gone = admin(node, "GET", "/admin/teams/no-such-team/quota")
    page.wait_for_selector("#quota-error:not(:empty)")
    assert status == 404 and page.inner_text("#quota-error") == gone["message"], gone
    session.open("/teams")
    page.wait_for_selector("#teams a.team")
    # the keyboard: a team's link keeps the focus across the list's redraws (every 3 s); Enter opens it
    page.focus(f'a.team[data-team="{DEFAULT_TEAM_ID}"]')
    page.wait_for_timeout(3500)
    assert page.evaluate("document.activeElement.dataset.team") == DEFAULT_TEAM_ID
    page.keyboard.press("Enter")
    page.wait_for_selector("#team-title:has-text('the default team')")
    # log out: the token is gone
    page.click("#logout")
    page.wait_for_selector("#api-key")
    assert page.evaluate("sessionStorage.getItem('aenv.adminToken')") is None
