"""Driving the dashboard in Chromium (conftest.py's ``browser``): a page per test, every
request the page makes recorded so a test can check that none leaves the server's host."""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import urllib.request
import warnings
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
    # request URL -> monotonic time it was sent, while it has no answer (a stalled page's story)
    pending: dict[str, float] = field(default_factory=dict)
    done: list[tuple[str, str, float]] = field(default_factory=list)    # (url, outcome, seconds)
    statuses: dict[str, int] = field(default_factory=dict)     # URL -> the last HTTP status it had
    console: list[str] = field(default_factory=list)           # the page's console errors and warnings

    def sent(self, url: str) -> None:
        self.requests.append(url)
        self.pending[url] = time.monotonic()

    def finished(self, url: str, outcome: str) -> None:
        t0 = self.pending.pop(url, None)
        if outcome == "ok":
            outcome = f"HTTP {self.statuses.get(url, '?')}"
        elif url in self.statuses:      # a module answered with an error status fails as "aborted"
            outcome += f" after HTTP {self.statuses[url]}"
        self.done.append((url, outcome, round(time.monotonic() - t0, 3) if t0 is not None else -1.0))

    def open(self, route: str = "") -> None:
        self.page.goto(self.base + "/dashboard" + (f"#{route}" if route else ""))

    def login(self, key: str) -> None:
        self.open()
        self.wait_for_login_form()
        self.page.fill("#api-key", key)
        self.page.click("form.login button[type=submit]")

    def wait_for_login_form(self) -> None:
        """The page's first load in a new browser context. Seen in whole CI runs only (2 of
        ~2,000 page loads, a different test each time): the page loaded, yet its modules
        never ran (no login form, no page error). When that happens and some of the page's
        requests failed in the browser (or never finished) while the server answers every
        one of them to a plain client with a 200, the failure was the browser's: the page
        is loaded again, once, with the report as a warning. An answer of the server's
        that was not a 200 fails the test, with the report."""
        try:
            self.page.wait_for_selector("#api-key", timeout=30_000)
            return
        except Exception as e:      # Playwright's TimeoutError
            suspects, report = self.stall_report()
            if not suspects or not all(suspects.values()):
                raise AssertionError(f"the login form never appeared: {report}") from e
        warnings.warn(f"Chromium did not run the page on its first load; the server answered each of its "
                      f"requests directly, so the page is loaded again: {report}")
        self.page.reload()
        self.page.wait_for_selector("#api-key")

    def stall_report(self) -> tuple[dict[str, bool], str]:
        """The page's requests that never finished or failed in the browser, each asked
        again by a plain client (True: the server answered it with a 200 within 10 s), and
        a report of them, of answers that were not a 200, and of the console's errors."""
        now = time.monotonic()
        failed = [(u, o) for u, o, _ in self.done if not o.startswith("HTTP ") and " after HTTP " not in o]
        not_ok = [(u, o) for u, o, _ in self.done if (o.startswith("HTTP ") and o != "HTTP 200")
                  or (" after HTTP " in o and not o.endswith(" after HTTP 200"))]
        suspects: dict[str, bool] = {}
        lines = []
        for url, what in [(u, f"no answer after {now - t0:.1f} s") for u, t0 in self.pending.items()] + failed:
            t1 = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=10) as r:
                    size = len(r.read())
                    suspects[url] = r.status == 200
                    direct = f"{r.status}, {size} bytes in {time.monotonic() - t1:.3f} s"
            except Exception as e:      # the server's failure is the report
                suspects[url] = False
                direct = f"{type(e).__name__}: {e}"
            lines.append(f"  {url}: {what}; asked directly now: {direct}")
        if not_ok:
            suspects.update({u: False for u, _ in not_ok})
            lines += [f"  {u}: the server answered {o}" for u, o in not_ok]
        report = ("\n" + "\n".join(lines) if lines else " every request had a 200;") + \
            f"\n  the last finished: {self.done[-12:]}\n  console: {self.console[-10:]}"
        return suspects, report

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
    page.on("request", lambda r: s.sent(r.url))
    page.on("response", lambda r: s.statuses.__setitem__(r.url, r.status))
    page.on("requestfinished", lambda r: s.finished(r.url, "ok"))
    page.on("console", lambda m: s.console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("requestfailed", lambda r: s.finished(r.url, f"failed: {r.failure}"))
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
