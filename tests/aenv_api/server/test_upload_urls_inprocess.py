"""Template upload URLs are bound to their build and hash and take one upload, and the
API key never reaches a guest nor the request log, whichever way a client sent it.
In-process (inprocess.py): a real TemplateBuilds over a real store (no VM; a build
started there fails at once, which is all these tests need: it is no longer waiting),
the real proxy in front of a stub guest that echoes what reached it."""
from __future__ import annotations

import http.client
import io
import json
import tarfile
import urllib.error
import urllib.request
from typing import Any, Iterator
from urllib.parse import parse_qs, quote, urlsplit

import pytest
from aiohttp import web

from aenv_vm.builds import records

from .inprocess import InProcessServer


@pytest.fixture
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    async def seen(request: web.Request) -> web.Response:
        return web.json_response({"target": request.rel_url.raw_path_qs, "headers": list(request.headers.items())})

    s = InProcessServer.start(tmp_path_factory.mktemp("u") / "n", templates=True,   # short: socket paths
                              guest_routes=lambda app: app.router.add_get("/seen", seen))
    try:
        yield s
    finally:
        s.stop()


def tar() -> bytes:
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w") as t:
        info = tarfile.TarInfo("a.txt")
        info.size = 2
        t.addfile(info, io.BytesIO(b"hi"))
    return b.getvalue()


def request_build(srv: InProcessServer, name: str) -> tuple[str, str]:
    status, _, body = srv.request("POST", "/v3/templates", {"name": name})
    assert status == 202, body
    return body["templateID"], body["buildID"]


def upload_url(srv: InProcessServer, tid: str, files_hash: str) -> str:
    status, _, body = srv.request("GET", f"/templates/{tid}/files/{files_hash}")
    assert status == 201 and body["present"] is False, body
    return str(body["url"])


def put(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=data, method="PUT", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_upload_url_takes_one_upload_for_its_build_and_hash(srv: InProcessServer) -> None:
    tid, bid = request_build(srv, "bound")
    url = upload_url(srv, tid, "a" * 64)
    q = parse_qs(urlsplit(url).query)
    assert q["template"] == [tid] and q["build"] == [bid]
    assert upload_url(srv, tid, "a" * 64) != url          # every URL handed out is one of its own
    # the URL is for this template's build and this hash: changing either breaks the signature
    other_tid, other_bid = request_build(srv, "other")
    assert put(url.replace(f"build={bid}", f"build={other_bid}"), tar())[0] == 401
    assert put(url.replace(f"template={quote(tid, safe='')}", f"template={other_tid}"), tar())[0] == 401
    assert put(url.replace("a" * 64, "b" * 64), tar())[0] == 401
    assert put(url, tar())[0] == 200
    assert records.has_files(srv._store, "a" * 64)
    # one upload spends it: the URL cannot add or replace anything afterwards
    status, err = put(url, b"something else")
    assert status == 409 and "used already" in err["message"] and err["code"] == 409
    # and the next build of the same files finds them present: no URL at all
    status, _, body = srv.request("GET", f"/templates/{tid}/files/{'a' * 64}")
    assert status == 201 and body == {"present": True}


def test_an_upload_url_dies_with_its_builds_start(srv: InProcessServer) -> None:
    tid, bid = request_build(srv, "started")
    url = upload_url(srv, tid, "c" * 64)
    status, _, body = srv.request("POST", f"/v2/templates/{tid}/builds/{bid}", {"fromTemplate": "base", "steps": []})
    assert status == 202, body
    status, err = put(url, tar())           # leaked, replayed within its hour: refused
    assert status == 409 and f"build {bid}" in err["message"] and "has started" in err["message"]
    assert not records.has_files(srv._store, "c" * 64)
    # no build waits for files: no URL is handed out
    status, _, err = srv.request("GET", f"/templates/{tid}/files/{'c' * 64}")
    assert status == 409 and "no requested build waiting" in err["message"]


def test_a_failed_upload_leaves_its_url_usable(srv: InProcessServer) -> None:
    tid, _ = request_build(srv, "retry")
    url = upload_url(srv, tid, "d" * 64)
    api = srv._server.control.templates     # type: ignore[union-attr]
    api.max_upload_bytes = 100
    status, err = put(url, b"x" * 200)
    assert status == 413
    api.max_upload_bytes = 1 << 20
    assert put(url, tar())[0] == 200


def test_the_api_key_never_reaches_a_guest_nor_the_log(srv: InProcessServer) -> None:
    status, _, sbx = srv.request("POST", "/v2/sandboxes", {"templateID": "base"})
    assert status == 201, sbx
    key = srv.api_key
    route = {"E2b-Sandbox-Id": sbx["sandboxID"], "E2b-Sandbox-Port": "8080"}
    status, _, got = srv.request("GET", f"/seen?api_key={quote(key)}&keep=1&token=Bearer%20{quote(key)}",
                                 headers={**route, "Authorization": f"Bearer {key}", "X-Forwarded-Key": key},
                                 key=key)
    assert status == 200, got
    assert got["target"] == "/seen?keep=1"
    names = {k.lower() for k, _ in got["headers"]}
    assert "authorization" not in names and "x-api-key" not in names and "x-forwarded-key" not in names
    assert key not in json.dumps(got)
    # a guest's own credentials pass untouched
    status, _, got = srv.request("GET", "/seen?token=abc", key=None,
                                 headers={**route, "Authorization": "Bearer the-guests-own"})
    assert got["target"] == "/seen?token=abc" and ["Authorization", "Bearer the-guests-own"] in got["headers"]
    # a header that is not UTF-8 is compared as the bytes it is, and forwarded
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("GET", "/seen")
    for k, v in route.items():
        conn.putheader(k, v)
    conn.putheader("X-Odd", b"caf\xe9 \xff")
    conn.endheaders()
    answer = conn.getresponse()
    assert answer.status == 200 and any(k == "X-Odd" for k, _ in json.loads(answer.read())["headers"])
    conn.close()
    # nothing of the key in what the node logged, nor of an upload URL's signature
    tid, _ = request_build(srv, "logged")
    url = upload_url(srv, tid, "e" * 64)
    assert put(url, tar())[0] == 200
    log = srv.log()
    assert "/seen" in log and key not in log
    assert parse_qs(urlsplit(url).query)["signature"][0] not in log
