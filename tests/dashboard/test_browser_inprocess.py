"""The dashboard in Chromium against a node's real API over the in-memory sandbox service
(no VMs): the login and its key, the live list (a new sandbox within a second, filters,
1,000 rows virtualised), the actions agreeing with the API, and the API's errors shown as
its messages. Every request the page makes goes to the server's own host."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.aenv_api.server.inprocess import InProcessServer

from .browser import Session, new_session, screenshot

FAKE_ROWS = 1000
ADMIN = "dashboard-admin-token-0123456789"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("dash-node"), templates=True, admin_token=ADMIN)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def session(browser: Any, node: InProcessServer) -> Iterator[Session]:
    s = new_session(browser, node.url)
    try:
        yield s
    finally:
        s.page.context.close()
    assert not s.errors, s.errors
    assert s.requests and not s.foreign_requests(), s.foreign_requests()


def create(node: InProcessServer, **body: Any) -> str:
    status, _, answer = node.request("POST", "/sandboxes", {"templateID": "base", **body})
    assert status == 201, answer
    return str(answer["sandboxID"])


def state_of(node: InProcessServer, sid: str) -> str | None:
    status, _, body = node.request("GET", f"/sandboxes/{sid}")
    return body["state"] if status == 200 else None


def logged_in(session: Session, node: InProcessServer) -> None:
    session.login(node.api_key)
    session.page.wait_for_selector("#list-info:not(:empty)")


def test_a_wrong_key_sees_only_the_login(session: Session, node: InProcessServer, tmp_path: Path) -> None:
    page = session.page
    session.login("e2b_" + "0" * 40)
    page.wait_for_selector("#login-error:not(:empty)")
    assert "API key" in page.inner_text("#login-error")         # the API's own message
    screenshot(session, "login", tmp_path)
    assert page.locator("#nav").is_hidden() and page.locator("#sandbox-rows").count() == 0
    assert page.evaluate("sessionStorage.getItem('aenv.apiKey')") is None
    session.open("/sandboxes")                                   # no way around the login
    assert page.locator("#api-key").is_visible() and page.locator("#sandbox-rows").count() == 0
    # a key that stops working (deleted, rotated) sends the page back to the login at its next call
    page.evaluate("sessionStorage.setItem('aenv.apiKey', 'e2b_' + 'f'.repeat(40))")
    page.reload()
    page.wait_for_function("sessionStorage.getItem('aenv.apiKey') === null")
    page.wait_for_selector("#api-key")
    assert page.locator("#sandbox-rows").count() == 0 and page.url.endswith("#/login")


def test_the_list_shows_a_new_sandbox_within_a_second(session: Session, node: InProcessServer) -> None:
    logged_in(session, node)
    session.watch_rows()
    sid = create(node, metadata={"suite": "dashboard"})
    seen = session.row_seen_after(sid, time.time())
    print(f"\nthe list showed a new sandbox {seen * 1000:.0f} ms after its create answered")
    assert seen < 1.0, seen
    row = session.page.inner_text(f'.vrow[data-id="{sid}"]')
    assert "running" in row and "base" in row and "suite=dashboard" in row


def test_filters(session: Session, node: InProcessServer) -> None:
    a = create(node, metadata={"team": "red"})
    b = create(node, metadata={"team": "blue"})
    logged_in(session, node)
    page = session.page
    page.fill("#filter", "team=red")              # the API's metadata filter
    page.wait_for_function(f"""() => document.querySelector('.vrow[data-id="{a}"]') &&
                                     !document.querySelector('.vrow[data-id="{b}"]')""")
    page.fill("#filter", b[-6:])                  # text matched on the page
    page.wait_for_function(f"""() => document.querySelector('.vrow[data-id="{b}"]') &&
                                     !document.querySelector('.vrow[data-id="{a}"]')""")
    assert node.request("POST", f"/sandboxes/{b}/pause", {})[0] == 204
    page.fill("#filter", "")
    page.select_option("#state-filter", "paused")
    page.wait_for_function(f"""() => document.querySelector('.vrow[data-id="{b}"]') &&
                                     !document.querySelector('.vrow[data-id="{a}"]')""")


def fake_rows(n: int) -> list[dict[str, Any]]:
    start = time.time() - 3600
    return [{"templateID": "tpl-fake", "alias": "base", "sandboxID": f"sbx-fake{i:05d}", "clientID": "aenv",
             "envdVersion": "0.5.7", "startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start + i)),
             "endAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start + 7200)), "cpuCount": 2,
             "memoryMB": 512, "diskSizeMB": 2048, "metadata": {"row": str(i)}, "state": "running"}
            for i in range(n)]


def test_a_thousand_rows_render_and_scroll(session: Session, node: InProcessServer, tmp_path: Path) -> None:
    """The list call answered by a fixture of 1,000 records (the browser's own routing):
    the rows render and scroll, with only those in view in the DOM. Times are reported."""
    body = json.dumps(fake_rows(FAKE_ROWS))
    page = session.page
    page.route("**/v2/sandboxes?*", lambda route: route.fulfill(
        status=200, body=body, content_type="application/json", headers={"X-Total-Running": str(FAKE_ROWS)}))
    session.login(node.api_key)
    t0 = time.monotonic()
    page.wait_for_selector('.vrow[data-index="0"]')
    rendered = time.monotonic() - t0
    assert f"{FAKE_ROWS} of {FAKE_ROWS} shown" in page.inner_text("#list-info")
    in_dom = page.locator(".vbody .vrow").count()
    assert 0 < in_dom < 100, in_dom                       # virtualised: the rows in view only
    t1 = time.monotonic()
    page.eval_on_selector(".vscroll", "e => { e.scrollTop = e.scrollHeight; }")
    page.wait_for_selector(f'.vrow[data-index="{FAKE_ROWS - 1}"]')
    scrolled = time.monotonic() - t1
    assert page.is_visible(f'.vrow[data-id="sbx-fake{FAKE_ROWS - 1:05d}"]')
    assert page.locator(".vbody .vrow").count() < 100
    # a scroll step by step through the whole list, as a reader's wheel does it
    t2 = time.monotonic()
    page.evaluate("""async () => { const e = document.querySelector('.vscroll');
        for (let y = e.scrollHeight; y >= 0; y -= e.clientHeight) {
          e.scrollTop = y; await new Promise(requestAnimationFrame); }
        e.scrollTop = 0; }""")
    page.wait_for_selector('.vrow[data-index="0"]')
    stepped = time.monotonic() - t2
    page.eval_on_selector(".vscroll", "e => { e.scrollTop = 500 * 36; }")
    page.wait_for_selector('.vrow[data-index="505"]')
    screenshot(session, "list-1000", tmp_path)
    print(f"\n{FAKE_ROWS} rows: first rows drawn {rendered * 1000:.0f} ms after the login, a jump to the end "
          f"{scrolled * 1000:.0f} ms, a screen-by-screen scroll through all {stepped * 1000:.0f} ms "
          f"({in_dom} rows in the DOM)")


def test_actions_agree_with_the_api(session: Session, node: InProcessServer) -> None:
    sid = create(node)
    logged_in(session, node)
    page = session.page
    page.on("dialog", lambda d: d.accept())
    session.open(f"/sandboxes/{sid}")
    page.wait_for_selector("#sandbox-state:text('running')")
    page.click("#pause")
    page.wait_for_selector("#sandbox-state:text('paused')")
    assert state_of(node, sid) == "paused"
    page.click("#resume")
    page.wait_for_selector("#sandbox-state:text('running')")
    assert state_of(node, sid) == "running"
    page.fill("#fork-count", "2")
    page.click("#fork")
    page.wait_for_selector("#action-result a.child >> nth=1")
    children = page.eval_on_selector_all("#action-result a.child", "els => els.map(e => e.dataset.id)")
    assert len(children) == 2 and all(state_of(node, c) == "running" for c in children)
    page.fill("#snapshot-name", "dash-snap")
    page.click("#snapshot")
    page.wait_for_selector("#snapshot-id")
    snap = page.inner_text("#snapshot-id").split()[-1]
    listed = node.request("GET", "/snapshots")[2]
    assert any(s["snapshotID"] == snap and "dash-snap" in s["names"] for s in listed), listed
    page.fill("#timeout-seconds", "1234")
    page.click("#set-timeout")
    page.wait_for_selector("#toast.show:text('ends in 1234 s')")
    end = node.request("GET", f"/sandboxes/{sid}")[2]["endAt"]
    left = time.mktime(time.strptime(end[:19], "%Y-%m-%dT%H:%M:%S")) - time.mktime(time.gmtime())
    assert 1200 < left <= 1235, left
    page.click("#kill")
    page.wait_for_selector("#filter")             # back on the list
    assert state_of(node, sid) is None


def test_a_refused_kill_changes_nothing(session: Session, node: InProcessServer) -> None:
    sid = create(node)
    logged_in(session, node)
    page = session.page
    asked: list[str] = []
    page.on("dialog", lambda d: (asked.append(d.message), d.dismiss()))
    session.open(f"/sandboxes/{sid}")
    page.wait_for_selector("#sandbox-state:text('running')")
    page.click("#kill")
    page.wait_for_timeout(300)
    assert asked and sid in asked[0]
    assert state_of(node, sid) == "running"


def test_an_api_error_is_shown_as_its_message(session: Session, node: InProcessServer) -> None:
    sid = create(node)
    logged_in(session, node)
    page = session.page
    session.open(f"/sandboxes/{sid}")
    page.wait_for_selector("#sandbox-state:text('running')")
    page.fill("#fork-count", "1000")              # over [server] max_forks: the API says 400
    page.click("#fork")
    page.wait_for_selector("#toast.show.error")
    status, _, body = node.request("POST", f"/sandboxes/{sid}/fork", {"count": 1000})
    assert status == 400 and page.inner_text("#toast") == body["message"]
    session.open("/sandboxes/sbx-nosuchsandbox")
    page.wait_for_selector("#sandbox-state:text('gone')")
    assert "not found" in page.inner_text("#toast")


def test_resource_pages(session: Session, node: InProcessServer, tmp_path: Path) -> None:
    logged_in(session, node)
    page = session.page
    assert node.request("POST", "/volumes", {"name": "dash-vol"})[0] == 201
    session.open("/volumes")
    page.wait_for_selector("a.volume:text('dash-vol')")
    session.open("/templates")
    page.wait_for_selector("table.grid")
    session.open("/nodes")
    page.wait_for_selector("button.node-op")
    node_id = page.get_attribute("button.node-op", "data-node")
    page.on("dialog", lambda d: d.accept())
    page.click("button.node-op")                  # drain
    page.wait_for_selector("span.state:text('draining')")
    assert node.request("GET", "/nodes")[2][0]["status"] == "draining"
    page.click("button.node-op")                  # ready again
    page.wait_for_selector("span.state:text('ready')")
    assert node.request("GET", f"/nodes/{node_id}")[2]["status"] == "ready"


def test_a_failing_build_shows_its_step_and_log(session: Session, node: InProcessServer, tmp_path: Path) -> None:
    """This node boots no VM: a build started here fails, and its page says where and why."""
    status, _, got = node.request("POST", "/v2/templates", {"alias": "dash-fails", "cpuCount": 1, "memoryMB": 256})
    assert status == 202, got
    bid = got["buildID"]
    status, _, _ = node.request("POST", f"/v2/templates/dash-fails/builds/{bid}",
                                {"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["echo never"]}]})
    assert status == 202
    logged_in(session, node)
    page = session.page
    session.open(f"/templates/dash-fails/builds/{bid}")
    page.wait_for_selector("#build-status:text('error')", timeout=30_000)
    answer = node.request("GET", f"/templates/dash-fails/builds/{bid}/status")[2]
    reason = page.inner_text("#build-reason")
    assert answer["reason"]["message"] in reason and f"step {answer['reason'].get('step', '?')}" in reason
    log = page.inner_text("#build-log")
    assert answer["logEntries"] and all(e["message"].splitlines()[0] in log for e in answer["logEntries"])
    screenshot(session, "build-failed", tmp_path)


def test_a_teams_key_sees_only_its_team(session: Session, node: InProcessServer) -> None:
    admin = {"X-Admin-Token": ADMIN}
    status, _, team = node.request("POST", "/admin/teams", {"name": "dash-team"}, headers=admin, key=None)
    assert status == 201, team
    status, _, made = node.request("POST", f"/admin/teams/{team['teamID']}/api-keys", {"name": "dash"},
                                   headers=admin, key=None)
    assert status == 201, made
    theirs = create(node)                        # the default team's
    status, _, mine = node.request("POST", "/sandboxes", {"templateID": "base"}, key=made["key"])
    assert status == 201, mine
    session.login(made["key"])
    page = session.page
    page.wait_for_selector(f'.vrow[data-id="{mine["sandboxID"]}"]')
    assert page.locator(".vbody .vrow").count() == 1 and page.locator(f'.vrow[data-id="{theirs}"]').count() == 0
    session.open(f"/sandboxes/{theirs}")          # another team's sandbox is answered as unknown
    page.wait_for_selector("#sandbox-state:text('gone')")
    assert "not found" in page.inner_text("#toast")
    session.open("/nodes")                        # the node's own routes: the deployment key only
    page.wait_for_selector(".api-error")
    status, _, refused = node.request("GET", "/nodes", key=made["key"])
    assert status == 403 and page.inner_text(".api-error") == refused["message"]


def test_the_logs_are_followed(session: Session, node: InProcessServer) -> None:
    sid = create(node)
    logged_in(session, node)
    page = session.page
    session.open(f"/sandboxes/{sid}")
    page.wait_for_selector("#sandbox-state:text('running')")
    page.click("#tab-logs")
    page.wait_for_function("() => document.querySelector('#logs')?.textContent.includes('sandbox created')")
    assert node.request("POST", f"/sandboxes/{sid}/timeout", {"timeout": 611})[0] == 204
    page.wait_for_function("() => document.querySelector('#logs').textContent.includes('timeout set seconds=611')",
                           timeout=5000)
    text = page.inner_text("#logs")
    assert text.count("sandbox created") == 1, text      # each entry once, however often it is polled


def test_a_build_started_from_a_dockerfile_is_followed(session: Session, node: InProcessServer) -> None:
    logged_in(session, node)
    page = session.page
    session.open("/templates")
    page.fill("#build-name", "dash-df")
    page.set_input_files("#build-dockerfile", files=[{"name": "Dockerfile", "mimeType": "text/plain",
                                                      "buffer": b"FROM base\nRUN echo from-the-dashboard\n"}])
    page.click("#build-start")
    page.wait_for_url("**#/templates/dash-df/builds/*")
    bid = page.url.rsplit("/", 1)[-1]
    status, _, answer = node.request("GET", f"/templates/dash-df/builds/{bid}/status")
    assert status == 200 and answer["status"] in ("building", "error"), answer     # started (this node boots no VM)
    page.wait_for_selector("#build-status:text('error')", timeout=30_000)
    assert "build" in page.inner_text("#build-log")


def test_snapshots_and_volumes_are_deleted_from_their_pages(session: Session, node: InProcessServer) -> None:
    sid = create(node)
    status, _, snap = node.request("POST", f"/sandboxes/{sid}/snapshots", {"name": "dash-del"})
    assert status == 201, snap
    status, _, vol = node.request("POST", "/volumes", {"name": "dash-del-vol"})
    assert status == 201, vol
    logged_in(session, node)
    page = session.page
    page.on("dialog", lambda d: d.accept())
    session.open("/snapshots")
    row = page.locator("tr", has_text=snap["snapshotID"])
    row.locator("button.danger").click()
    row.wait_for(state="detached")
    assert all(s["snapshotID"] != snap["snapshotID"] for s in node.request("GET", "/snapshots")[2])
    session.open("/volumes")
    row = page.locator("tr", has_text="dash-del-vol")
    row.locator("button.danger").click()
    row.wait_for(state="detached")
    assert node.request("GET", f"/volumes/{vol['volumeID']}")[0] == 404


def test_the_list_works_from_the_keyboard(session: Session, node: InProcessServer) -> None:
    sid = create(node, metadata={"keys": "yes"})
    logged_in(session, node)
    page = session.page
    page.fill("#filter", "keys=yes")
    page.wait_for_function(f"""() => document.querySelectorAll('.vbody .vrow').length === 1 &&
                                     document.querySelector('.vrow[data-id="{sid}"]')""")
    page.focus(f'.vrow[data-id="{sid}"]')
    page.wait_for_timeout(1200)                   # two polls redraw the rows: the focus stays on it
    assert page.evaluate("document.activeElement.dataset.id") == sid
    page.keyboard.press("Enter")
    page.wait_for_selector("#sandbox-state:text('running')")
    assert page.url.endswith(f"#/sandboxes/{sid}")


def test_a_volumes_files(session: Session, node: InProcessServer) -> None:
    status, _, vol = node.request("POST", "/volumes", {"name": "dash-files"})
    assert status == 201, vol
    bearer = {"Authorization": f"Bearer {vol['token']}"}
    base = f"/volumecontent/{vol['volumeID']}"
    assert node.request("POST", f"{base}/dir?path=/data", headers=bearer, key=None)[0] == 201
    assert node.request("PUT", f"{base}/file?path=/data/seed.txt", headers=bearer, key=None,
                        raw=b"seeded by the API\n")[0] == 201
    logged_in(session, node)
    page = session.page
    session.open("/volumes")
    page.click("a.volume:text('dash-files')")
    page.wait_for_selector('tr[data-path="/data"] a.dir')
    page.click('tr[data-path="/data"] a.dir')
    page.wait_for_selector('button.download[data-path="/data/seed.txt"]')
    with page.expect_download() as dl:
        page.click('button.download[data-path="/data/seed.txt"]')
    assert Path(dl.value.path()).read_bytes() == b"seeded by the API\n"
    page.set_input_files("#volume-upload-input", files=[{"name": "up.bin", "mimeType": "application/octet-stream",
                                                         "buffer": b"\x00\x01 from the page"}])
    page.click("#volume-upload")
    page.wait_for_selector('tr[data-path="/data/up.bin"]')
    status, _, got = node.request("GET", f"{base}/file?path=/data/up.bin", headers=bearer, key=None)
    assert status == 200 and got == b"\x00\x01 from the page"


def test_the_teams_keys_are_made_and_deleted_from_the_page(session: Session, node: InProcessServer) -> None:
    logged_in(session, node)
    page = session.page
    page.on("dialog", lambda d: d.accept())
    session.open("/keys")
    page.wait_for_selector("#team:has-text('default')")
    page.fill("#key-name", "from-the-dashboard")
    page.click("#key-create")
    page.wait_for_selector("#new-key-value")
    new_key = page.inner_text("#new-key-value")
    assert node.request("GET", "/v2/sandboxes", key=new_key)[0] == 200       # the key shown works
    listed = {k["name"]: k for k in node.request("GET", "/api-keys")[2]}
    made = listed["from-the-dashboard"]
    page.click(f'button[data-key="{made["id"]}"]')
    page.wait_for_selector(f'button[data-key="{made["id"]}"]', state="detached")
    assert node.request("GET", "/v2/sandboxes", key=new_key)[0] == 401       # refused at once
    assert "from-the-dashboard" not in {k["name"] for k in node.request("GET", "/api-keys")[2]}


def test_a_paused_sandbox_asks_for_a_resume_before_files_and_terminal(session: Session, node: InProcessServer) -> None:
    sid = create(node)
    assert node.request("POST", f"/sandboxes/{sid}/pause", {})[0] == 204
    logged_in(session, node)
    page = session.page
    session.open(f"/sandboxes/{sid}")
    page.wait_for_selector("#sandbox-state:text('paused')")
    assert page.is_disabled("#pause") and page.is_enabled("#resume")
    for tab in ("files", "terminal"):
        page.click(f"#tab-{tab}")
        page.wait_for_selector(".panel :text('resume it first')")
    assert state_of(node, sid) == "paused"       # looking did not resume it
