"""Serving the dashboard's static files at ``/dashboard`` (docs/dashboard.md).

The files hold no secret, so they are served without a credential; everything the page
shows it asks the API for, with the key the user typed. The node's API and the fleet's
gateway both mount ``serve_dashboard`` (neither imports the other: this module imports
nothing of the project's).

A path is looked up under ``static/`` only: ``..``, backslashes, NUL and hidden names are
refused before the file system is asked, and the resolved file must still lie under
``static/`` (a symlink out of it is a 404). Every answer carries a Content-Security-Policy
that lets the page load and connect to its own origin only, so nothing the dashboard
shows can make the browser reach another host.
"""
from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web

PREFIX = "/dashboard"
STATIC_DIR = Path(__file__).resolve().parent / "static"
INDEX = "index.html"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".json": "application/json",
    ".map": "application/json",
}

# 'unsafe-inline' for styles only: xterm.js sizes and colours its rows through a <style>
# element it writes; scripts, connections and images stay same-origin.
CSP = ("default-src 'self'; script-src 'self'; connect-src 'self'; img-src 'self' data: blob:; "
       "style-src 'self' 'unsafe-inline'; object-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # assets change with the checkout: the browser asks again (a 304 when unchanged)
    "Cache-Control": "no-cache",
}


def is_dashboard_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def _not_found(what: str) -> web.Response:
    return web.Response(status=404, content_type="application/json",
                        text=json.dumps({"code": 404, "message": f"no dashboard file {what[:200]!r}"}))


def asset_path(path: str, root: Path = STATIC_DIR) -> Path | None:
    """The file under ``root`` that the request path names, or None (unknown, hidden, or
    a name that tries to leave ``root``)."""
    if not is_dashboard_path(path):
        return None
    rel = path[len(PREFIX):].strip("/") or INDEX
    parts = rel.split("/")
    if any(p in ("", ".", "..") or p.startswith(".") or "\\" in p or "\0" in p for p in parts):
        return None
    if Path(rel).suffix not in CONTENT_TYPES:
        return None
    candidate = (root / rel).resolve()
    if not candidate.is_relative_to(root.resolve()) or not candidate.is_file():
        return None
    return candidate


async def serve_dashboard(request: web.Request) -> web.StreamResponse:
    """GET/HEAD of ``/dashboard`` (the page) or a file under it; other methods are 405."""
    if request.method not in ("GET", "HEAD"):
        return web.Response(status=405, content_type="application/json", headers={"Allow": "GET, HEAD"},
                            text=json.dumps({"code": 405, "message": "the dashboard's files are read with GET"}))
    found = asset_path(request.path)
    if found is None:
        return _not_found(request.path)
    headers = dict(SECURITY_HEADERS)
    headers["Content-Type"] = CONTENT_TYPES[found.suffix]
    # Read here, on the loop: the files are the project's own and small (the largest, xterm,
    # ~340 KiB, from the page cache), and a FileResponse waits for the loop's default
    # executor, which a node's blocking work (commits, stores) can hold for a long time.
    try:
        body = found.read_bytes()
    except OSError:
        return _not_found(request.path)
    return web.Response(body=body, headers=headers)
