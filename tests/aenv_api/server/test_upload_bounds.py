"""The template upload's bounds on a node in this process (real TemplateBuilds over a real
store, no VM): uploads beyond ``max_parallel_uploads`` are answered 429 with
Retry-After while others stream, none is taken while its filesystem is below the
node's free-disk floor (507, a JSON error naming the setting), a stopped process's
parts are removed at start, and an uploaded context unused by any build is swept only
after its grace."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

from aenv_store.diskfloor import DiskFloor, free_space
from aenv_api.server.templates_api import TemplateApi
from aenv_vm.builds import records

from .inprocess import InProcessServer


@pytest.fixture
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    s = InProcessServer.start(tmp_path_factory.mktemp("u") / "n", templates=True)   # short: socket paths
    try:
        yield s
    finally:
        s.stop()


def _api(srv: InProcessServer) -> TemplateApi:
    assert srv._server is not None and isinstance(srv._server.control.templates, TemplateApi)
    return srv._server.control.templates


def _url(srv: InProcessServer, files_hash: str) -> str:
    status, _, body = srv.request("POST", "/v3/templates", {"name": "up"})
    assert status == 202, body
    status, _, body = srv.request("GET", f"/templates/{body['templateID']}/files/{files_hash}")
    assert status == 201 and body["present"] is False
    return str(body["url"])


def _put(url: str, data: bytes) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url, data=data, method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_parallel_uploads_are_capped(srv: InProcessServer) -> None:
    api = _api(srv)
    api.max_parallel_uploads = 2
    url = _url(srv, "h" * 64)
    host, port = srv.url.removeprefix("http://").split(":")
    held = []
    for _ in range(2):      # an upload URL takes one upload at a time: one each
        other = _url(srv, "h" * 64)
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(f"PUT {other.removeprefix(srv.url)} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
                  .encode() + b"x" * 100)
        held.append(s)
    deadline = time.monotonic() + 10
    while api._uploads < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    status, headers, err = _put(url, b"y" * 1000)
    assert status == 429 and err["code"] == 429 and "max_parallel_uploads" in err["message"]
    assert headers.get("Retry-After") == "5"
    for s in held:
        s.close()
    deadline = time.monotonic() + 10
    while api._uploads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert api._uploads == 0 and not list(api.upload_dir.glob("*.part"))   # the dropped ones left nothing
    import io
    import tarfile
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w") as t:
        t.addfile(tarfile.TarInfo("empty"))
    status, _, _ = _put(url, b.getvalue())
    assert status == 200


def test_no_upload_below_the_floor(srv: InProcessServer) -> None:
    api = _api(srv)
    url = _url(srv, "f" * 64)
    api.upload_dir.mkdir(parents=True, exist_ok=True)
    free = free_space(api.upload_dir)
    api.floor = DiskFloor(free.bytes + (1 << 30), 0)
    status, _, err = _put(url, b"z" * 5000)
    assert status == 507 and "min_free_disk" in err["message"], err
    if free.inodes is not None:
        api.floor = DiskFloor(0, free.inodes + 10)
        status, _, err = _put(url, b"z" * 5000)
        assert status == 507 and "min_free_inodes" in err["message"], err
    assert not list(api.upload_dir.glob("*.part"))
    assert not records.has_files(srv._store, "f" * 64)


def test_left_parts_are_removed_and_unused_contexts_kept_their_grace(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    node = tmp_path_factory.mktemp("u") / "n"
    uploads = node / "templates-node" / "uploads"
    uploads.mkdir(parents=True)
    (uploads / "abc.1234.part").write_bytes(b"left by a killed node")
    s = InProcessServer.start(node, templates=True)
    try:
        assert not list(uploads.glob("*.part"))
        url = _url(s, "g" * 64)
        import io
        import tarfile
        b = io.BytesIO()
        with tarfile.open(fileobj=b, mode="w") as t:
            t.addfile(tarfile.TarInfo("empty"))
        assert _put(url, b.getvalue())[0] == 200
        builds = s._builds
        builds.context_retention = 0.0
        assert s.call(builds.sweep_contexts()) == 0          # never used by a build: its grace holds
        assert records.has_files(s._store, "g" * 64)
        builds._context_used["g" * 64] = time.time() - 1     # a build that used it ended a second ago
        assert s.call(builds.sweep_contexts()) == 1
        assert not records.has_files(s._store, "g" * 64)
    finally:
        s.stop()
