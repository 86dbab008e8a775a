"""Driving the dashboard in Chromium (conftest.py's ``browser``): a page per test, every
request the page makes recorded so a test can check that none leaves the server's host."""
from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "docs" / "dashboard"
VIEWPORT = {"width": 1280, "height": 800}


@dataclass
class Session:
    """One page of the dashboard and what it asked for."""
    page: Any
    base: str
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def open(self, route: str = "") -> None:
        self.page.goto(self.base + "/dashboard" + (f"#{route}" if route else ""))

    def login(self, key: str) -> None:
        self.open()
        self.page.fill("#api-key", key)
        self.page.click("form.login button[type=submit]")

    def watch_rows(self) -> None:
        """Note, in the page, the wall-clock time each sandbox row first appears (what a
        reader sees, without the test's own round trips to the browser)."""
        self.page.evaluate("""() => {
            window.__rowSeen = {};
            const mark = () => { for (const r of document.querySelectorAll('.vrow[data-id]'))
                if (!(r.dataset.id in window.__rowSeen)) window.__rowSeen[r.dataset.id] = Date.now(); };
            mark();
            new MutationObserver(mark).observe(document.getElementById('sandbox-rows'), { childList: true });
        }""")

    def row_seen_after(self, sandbox_id: str, since: float) -> float:
        """Seconds from ``since`` (time.time()) until the sandbox's row appeared."""
        self.page.wait_for_selector(f'.vrow[data-id="{sandbox_id}"]', timeout=5000)
        seen_ms = self.page.evaluate("id => window.__rowSeen[id]", sandbox_id)
        return float(seen_ms) / 1000 - since

    def foreign_requests(self) -> list[str]:
        """Every request that went anywhere but the server's own scheme, host and port
        (data: and blob: URLs the page makes itself are not requests to anywhere)."""
        own = urlsplit(self.base)
        return [u for u in self.requests if not u.startswith(("data:", "blob:"))
                and (urlsplit(u).scheme, urlsplit(u).netloc) != (own.scheme, own.netloc)]


@contextlib.contextmanager
def launched() -> Iterator[Any]:
    """Debian's Chromium, headless, driven by Playwright (its own browser downloads are
    never used); a missing Chromium fails the test (scripts/install.sh installs it)."""
    import pytest
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        pytest.fail("Debian's chromium is not installed (scripts/install.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: the tests run as root, where Chromium's own sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


def new_session(browser: Any, base: str) -> Session:
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)     # a loaded 2-CPU CI machine: the first page load can take 20 s
    s = Session(page, base)
    page.on("request", lambda r: s.requests.append(r.url))
    page.on("pageerror", lambda e: s.errors.append(f"{e}\n{e.stack}"))
    return s


def screenshot(session: Session, name: str, tmp_path: Path) -> Path:
    """A screenshot of the page: into docs/dashboard/ with DASHBOARD_SCREENSHOTS=1 (what
    the developer checks in; not AENV_*: the tests clear those), else beside the test's other files."""
    out = (SHOTS if os.environ.get("DASHBOARD_SCREENSHOTS") == "1" else tmp_path) / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    session.page.screenshot(path=str(out))
    assert out.stat().st_size > 10_000, out     # a page was drawn, not a blank
    return out
