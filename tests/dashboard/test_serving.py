"""Serving the dashboard's files (aenv_dashboard/serve.py) from a node's API: no credential
for the files, the rest of the API still keyed, nothing outside static/ reachable, and a
Content-Security-Policy that keeps the page on its own origin."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from aenv_dashboard.serve import CSP, STATIC_DIR, asset_path
from tests.aenv_api.server.inprocess import InProcessServer


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("dash-node"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/", "/dashboard/index.html"])
def test_the_page_is_served_without_a_key(node: InProcessServer, path: str) -> None:
    status, headers, body = node.request("GET", path, key=None)
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/html")
    assert b'<script type="module" src="/dashboard/js/app.js">' in body
    assert headers["Content-Security-Policy"] == CSP and "connect-src 'self'" in CSP
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_scripts_and_styles_have_their_types(node: InProcessServer) -> None:
    for path, ctype in (("/dashboard/js/app.js", "text/javascript"), ("/dashboard/style.css", "text/css")):
        status, headers, body = node.request("GET", path, key=None)
        assert status == 200 and headers["Content-Type"].startswith(ctype), (path, status)
        assert body == (STATIC_DIR / path.removeprefix("/dashboard/")).read_bytes()


def test_the_api_still_wants_its_key(node: InProcessServer) -> None:
    status, _, body = node.request("GET", "/v2/sandboxes", key=None)
    assert status == 401 and body["code"] == 401


@pytest.mark.parametrize("path", ["/dashboard/nope.js", "/dashboard/js/../../serve.py", "/dashboard/%2e%2e/serve.py",
                                  "/dashboard/.hidden.js", "/dashboard/js", "/dashboard/__init__.py",
                                  "/dashboard/js//app.js"])
def test_what_is_not_a_dashboard_file_is_a_json_404(node: InProcessServer, path: str) -> None:
    status, headers, body = node.request("GET", path, key=None)
    assert status == 404 and body["code"] == 404 and "dashboard" in body["message"], (path, status, body)


def test_only_reads(node: InProcessServer) -> None:
    status, headers, body = node.request("POST", "/dashboard/index.html", key=None, raw=b"x")
    assert status == 405 and body["code"] == 405 and headers["Allow"] == "GET, HEAD"


def test_asset_path_stays_under_its_root(tmp_path: Path) -> None:
    root = tmp_path / "static"
    (root / "js").mkdir(parents=True)
    (root / "index.html").write_text("<p>")
    (root / "js" / "a.js").write_text("1")
    (tmp_path / "secret.js").write_text("no")
    (root / "js" / "link.js").symlink_to(tmp_path / "secret.js")
    assert asset_path("/dashboard", root) == (root / "index.html").resolve()
    assert asset_path("/dashboard/js/a.js", root) == (root / "js" / "a.js").resolve()
    for bad in ("/dashboard/js/link.js", "/dashboard/../secret.js", "/dashboard/js/..", "/dashboardx/a.js",
                "/other/index.html", "/dashboard/js/a.js\0", "/dashboard/js\\a.js"):
        assert asset_path(bad, root) is None, bad
