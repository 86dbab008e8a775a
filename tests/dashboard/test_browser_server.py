"""The dashboard in Chromium against a real ``aenv server`` with real sandboxes, made and
checked with the real e2b SDK: a sandbox the SDK creates is listed within a second, its
page charts at least three metric samples and follows its logs, the terminal (xterm.js
over envd's PTY API through the node's proxy) runs ``echo hi``, a file is uploaded and
downloaded, and pause, resume, fork x2 and kill from the page are what the SDK then sees.
Every request the page makes goes to the server's own host. The screenshots of the main
pages are taken here (docs/dashboard.md)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.aenv_api.server.conftest import Server, serving, use_sdk_env

from .browser import Session, new_session, screenshot

pytestmark = pytest.mark.qemu


@pytest.fixture(scope="module")
def server(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(node_data_dir, tmp_path_factory.mktemp("dash-logs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def sdk(server: Server) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as mp:
        use_sdk_env(server, mp)
        yield server


@pytest.fixture(scope="module")
def elder(sdk: Server) -> Iterator[Any]:
    """A sandbox made first, so that it has lived through a few metric samples (one each
    5 s) by the time its chart is looked at."""
    from e2b import Sandbox

    sbx = Sandbox.create(metadata={"suite": "dashboard"}, timeout=600)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def session(browser: Any, sdk: Server) -> Iterator[Session]:
    s = new_session(browser, sdk.url)
    try:
        yield s
    finally:
        s.page.context.close()
    assert not s.errors, s.errors
    assert s.requests and not s.foreign_requests(), s.foreign_requests()


def logged_in(session: Session, server: Server) -> None:
    session.login(server.api_key)
    session.page.wait_for_selector("#list-info:not(:empty)")


def open_tab(session: Session, sandbox_id: str, tab: str) -> None:
    session.open(f"/sandboxes/{sandbox_id}")
    session.page.wait_for_selector("#sandbox-state:text('running')")
    session.page.click(f"#tab-{tab}")


def test_the_list_shows_what_the_sdk_created_within_a_second(session: Session, sdk: Server, elder: Any,
                                                             tmp_path: Path) -> None:
    from e2b import Sandbox

    logged_in(session, sdk)
    session.page.wait_for_selector(f'.vrow[data-id="{elder.sandbox_id}"]')
    session.watch_rows()
    sbx = Sandbox.create(metadata={"suite": "dashboard", "made": "now"}, timeout=120)
    try:
        seen = session.row_seen_after(sbx.sandbox_id, time.time())
        print(f"\nthe list showed the SDK's new sandbox {seen * 1000:.0f} ms after its create returned")
        assert seen < 1.0, seen
        assert "made=now" in session.page.inner_text(f'.vrow[data-id="{sbx.sandbox_id}"]')
        screenshot(session, "sandboxes", tmp_path)
    finally:
        sbx.kill()
    session.page.wait_for_selector(f'.vrow[data-id="{sbx.sandbox_id}"]', state="detached")


def test_the_page_charts_three_samples_and_follows_the_logs(session: Session, sdk: Server, elder: Any,
                                                            tmp_path: Path) -> None:
    logged_in(session, sdk)
    open_tab(session, elder.sandbox_id, "metrics")
    # samples every 5 s from the sandbox's start: three within ~15 s of its life
    session.page.wait_for_function("() => Number(document.querySelector('#chart-cpu')?.dataset.samples) >= 3",
                                   timeout=40_000)
    for chart in ("#chart-cpu", "#chart-memory", "#chart-disk"):
        assert session.page.locator(f"{chart} circle.sample").count() >= 3, chart
    screenshot(session, "sandbox", tmp_path)
    session.page.click("#tab-logs")
    session.page.wait_for_function("() => document.querySelector('#logs')?.textContent.includes('sandbox created')",
                                   timeout=10_000)
    elder.set_timeout(517)          # a lifecycle event, recorded in the sandbox's log: followed
    session.page.wait_for_function("() => document.querySelector('#logs').textContent.includes('timeout set seconds=517')",
                                   timeout=10_000)
    screenshot(session, "logs", tmp_path)


def test_the_terminal_runs_echo_hi(session: Session, sdk: Server, elder: Any, tmp_path: Path) -> None:
    logged_in(session, sdk)
    open_tab(session, elder.sandbox_id, "terminal")
    page = session.page
    page.wait_for_selector("section.term[data-ready=true]", timeout=20_000)
    page.click("#terminal")
    page.keyboard.type("echo hi\n")
    # a row that is just "hi": the command's output, not the line the command was typed on
    page.wait_for_function("""() => [...document.querySelectorAll('#terminal .xterm-rows > div')]
                                     .some(r => r.textContent.trim() === 'hi')""", timeout=15_000)
    screenshot(session, "terminal", tmp_path)
    pid = int(page.inner_text("#terminal-status").split()[2])       # "shell pid N (cols×rows)"
    assert pid in [p.pid for p in elder.commands.list()]
    page.click("#tab-metrics")                    # leaving the terminal ends its shell
    deadline = time.monotonic() + 10
    while pid in [p.pid for p in elder.commands.list()]:
        assert time.monotonic() < deadline, "the terminal's shell outlived its tab"
        time.sleep(0.2)


def test_upload_then_download(session: Session, sdk: Server, elder: Any, tmp_path: Path) -> None:
    logged_in(session, sdk)
    open_tab(session, elder.sandbox_id, "files")
    page = session.page
    page.wait_for_selector("#files-list table")
    content = b"from the dashboard \x00\xff " + bytes(range(256)) * 40
    page.set_input_files("#upload-input", files=[{"name": "dash.bin", "mimeType": "application/octet-stream",
                                                  "buffer": content}])
    page.click("#upload-button")
    target = "/home/user/dash.bin"
    page.wait_for_selector(f'tr[data-path="{target}"]')
    assert elder.files.read(target, format="bytes") == content      # the SDK reads what the page wrote
    screenshot(session, "files", tmp_path)
    elder.files.write("/home/user/from-sdk.txt", "written by the SDK\n")
    page.fill("#files-path", "/home/user")
    page.keyboard.press("Enter")
    page.wait_for_selector('button.download[data-path="/home/user/from-sdk.txt"]')
    for path, expected in ((target, content), ("/home/user/from-sdk.txt", b"written by the SDK\n")):
        with page.expect_download() as dl:
            page.click(f'button.download[data-path="{path}"]')
        assert Path(dl.value.path()).read_bytes() == expected, path


def test_pause_resume_fork_and_kill_agree_with_the_sdk(session: Session, sdk: Server) -> None:
    from e2b import Sandbox, SandboxState
    from e2b.exceptions import NotFoundException

    sbx = Sandbox.create(metadata={"suite": "dashboard-actions"}, timeout=300)
    sbx.files.write("/home/user/mark", "before the pause")
    children: list[str] = []
    try:
        logged_in(session, sdk)
        page = session.page
        page.on("dialog", lambda d: d.accept())
        session.open(f"/sandboxes/{sbx.sandbox_id}")
        page.wait_for_selector("#sandbox-state:text('running')")
        page.click("#pause")
        page.wait_for_selector("#sandbox-state:text('paused')", timeout=60_000)
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        page.click("#resume")
        page.wait_for_selector("#sandbox-state:text('running')", timeout=60_000)
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
        assert Sandbox.connect(sbx.sandbox_id).files.read("/home/user/mark") == "before the pause"
        page.fill("#fork-count", "2")
        page.click("#fork")
        page.wait_for_selector("#action-result a.child >> nth=1", timeout=120_000)
        children = page.eval_on_selector_all("#action-result a.child", "els => els.map(e => e.dataset.id)")
        assert len(set(children)) == 2 and sbx.sandbox_id not in children
        for child in children:
            assert Sandbox.get_info(child).state == SandboxState.RUNNING
            assert Sandbox.connect(child).files.read("/home/user/mark") == "before the pause"
        page.click("#kill")
        page.wait_for_selector("#filter")
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sbx.sandbox_id)
    finally:
        for sid in [sbx.sandbox_id, *children]:
            try:
                Sandbox.kill(sid)
            except Exception:
                pass
