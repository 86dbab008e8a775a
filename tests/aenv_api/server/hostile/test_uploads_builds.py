"""Hostile uploads and build contexts (issue 28), on a real node with real QEMU build VMs:
a COPY context that inflates to over 100× its size, built through the real SDK's
``Template`` API and through the REST build API, fails its build with a message naming
``[templates] max_context_mib`` while the node's memory stays bounded (the context is
read, inflated and sent a part at a time); uploads beyond ``max_parallel_uploads`` are
answered 429; a failed build's context is deleted (``context_retention`` 0 here).
Each offence is watched (watch.py): the node's RSS, its /health, a neighbour's commands,
from the moment the build VM is ready -- the offence is the context; booting a build
VM costs the node a transient 40-64 MiB of RSS whatever the build (measured with
honest RUN-only builds: the NBD reads of its cold boot), which is not this offence's;
the repository verifies clean afterwards."""
from __future__ import annotations

import hashlib
import json
import secrets
import socket
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.aenv_vm.builds.conftest import run_aenv

from ..conftest import Server, serving
from .watch import watching

pytestmark = [pytest.mark.qemu]

CAP_MIB = 64


@pytest.fixture(scope="module")
def server(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The module's node, with small bounds so an offence reaches them in seconds."""
    env = {"AENV_TEMPLATES__MAX_CONTEXT_MIB": str(CAP_MIB), "AENV_TEMPLATES__MAX_PARALLEL_UPLOADS": "2",
           "AENV_TEMPLATES__CONTEXT_RETENTION": "0", "AENV_TEMPLATES__STEP_TIMEOUT": "300"}
    with serving(node_data_dir, tmp_path_factory.mktemp("hostile-build-logs"), env=env) as srv:
        yield srv


def _bomb(inflated: int) -> bytes:
    """A gzipped tar holding one file of ``inflated`` zero bytes (~1000× smaller)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    info = tarfile.TarInfo("zeros")
    info.size = inflated
    out = bytearray(z.compress(info.tobuf()))
    chunk = bytes(1 << 20)
    for _ in range(inflated >> 20):
        out += z.compress(chunk)
    out += z.compress(bytes(-inflated % 512 + 1024)) + z.flush()
    return bytes(out)


def _put(url: str, data: bytes) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url, data=data, method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _wait_booted(node: Server, tid: str, bid: str, timeout: float = 600) -> None:
    """Until the build's log says its VM is ready (its steps begin)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, st = node.request("GET", f"/templates/{tid}/builds/{bid}/status?logsOffset=0&limit=100")
        assert status == 200, st
        if any("build VM ready" in e["message"] for e in st.get("logEntries", [])) or \
                st["status"] in ("ready", "error"):
            return
        time.sleep(0.2)
    raise AssertionError(f"the VM of build {bid} did not boot in {timeout} s")


def _wait_build(node: Server, tid: str, bid: str, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, st = node.request("GET", f"/templates/{tid}/builds/{bid}/status")
        assert status == 200, st
        if st["status"] in ("ready", "error"):
            return st
        time.sleep(1)
    raise AssertionError(f"build {bid} did not end in {timeout} s")


def _repository_clean(node: Server) -> None:
    verify = run_aenv(node.data_dir, "repo", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_context_within_the_bound_still_builds(node: Server, tmp_path: Path) -> None:
    """The bound costs an honest context nothing: one that inflates below it builds, and
    its bytes arrive whole (several parts)."""
    from e2b import Sandbox, Template

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    payload = bytes(range(256)) * (40 << 12)        # 10 MiB: ten parts of 1 MiB
    (ctx / "data.bin").write_bytes(payload)
    template = Template(file_context_path=str(ctx)).from_template("base").copy("data.bin", "/opt/data.bin")
    Template.build(template, "hostile-honest")
    sbx = Sandbox.create("hostile-honest", timeout=120)
    try:
        r = sbx.commands.run("sha256sum /opt/data.bin", user="root")
        assert r.stdout.split()[0] == hashlib.sha256(payload).hexdigest()
    finally:
        sbx.kill()
    status, _, _ = node.request("DELETE", "/templates/hostile-honest")
    assert status in (200, 204)


def test_a_rest_build_of_a_gzip_bomb_and_the_upload_bounds(node: Server, neighbour: Any) -> None:
    bomb = _bomb(200 << 20)          # 200 MiB of zeros: over 100× the upload, 3× the cap
    assert len(bomb) * 100 < (200 << 20)
    status, _, body = node.request("POST", "/v3/templates", {"name": "hostile-bomb"})
    assert status == 202, body
    tid, bid = body["templateID"], body["buildID"]
    files_hash = secrets.token_hex(32)
    status, _, body = node.request("GET", f"/templates/{tid}/files/{files_hash}")
    assert status == 201 and body["present"] is False, body
    url = body["url"]

    # uploads beyond [templates] max_parallel_uploads (2 here) are refused, retryable
    host, port = node.url.removeprefix("http://").split(":")
    held = []
    for _ in range(2):      # an upload URL takes one upload: one each
        status, _, body = node.request("GET", f"/templates/{tid}/files/{files_hash}")
        assert status == 201 and body["present"] is False, body
        path = body["url"].removeprefix(node.url)
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(bomb)}\r\n\r\n".encode() + bomb[:1000])
        held.append(s)
    try:
        time.sleep(0.5)
        status, headers, err = _put(url, bomb)
        assert status == 429 and "max_parallel_uploads" in err["message"] and headers.get("Retry-After"), err
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)

    status, _, _ = _put(url, bomb)              # stored as it came: nothing is inflated here
    assert status == 200
    status, _, body = node.request("POST", f"/v2/templates/{tid}/builds/{bid}", {
        "fromTemplate": "base", "steps": [{"type": "COPY", "args": ["zeros", "/opt/"], "filesHash": files_hash}]})
    assert status == 202, body
    _wait_booted(node, tid, bid)
    with watching(node, neighbour) as harm:
        st = _wait_build(node, tid, bid)
    harm.check(f"a COPY context of {len(bomb) >> 10} KiB inflating to 200 MiB, built through the REST API")
    assert st["status"] == "error", st
    assert "max_context_mib" in st["reason"]["message"] and "COPY zeros" in st["reason"]["message"], st
    # no template was made, and the context went with its build ([templates] context_retention 0):
    # the next build of the template is asked to upload it again
    status, _, body = node.request("POST", "/v3/templates", {"name": "hostile-bomb"})
    assert status == 202, body
    status, _, body = node.request("GET", f"/templates/{tid}/files/{files_hash}")
    assert status == 201 and body["present"] is False, body
    status, _, _ = node.request("GET", "/health", key=None)
    assert status == 204
    _repository_clean(node)


def test_an_sdk_build_of_a_context_that_inflates_100x(node: Server, neighbour: Any, tmp_path: Path) -> None:
    from e2b import Template
    from e2b.exceptions import BuildException

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    with open(ctx / "zeros.bin", "wb") as f:      # the SDK tars and gzips it: ~130 KiB on the wire
        f.truncate((2 * CAP_MIB) << 20)
    template = Template(file_context_path=str(ctx)).from_template("base").copy("zeros.bin", "/opt/zeros.bin")
    info = Template.build_in_background(template, "hostile-sdk-bomb")    # the SDK uploads, then starts
    _wait_booted(node, info.template_id, info.build_id)
    with watching(node, neighbour) as harm:
        st = _wait_build(node, info.template_id, info.build_id)
    harm.check(f"a {2 * CAP_MIB} MiB file of zeros as a COPY context, built through the SDK")
    assert st["status"] == "error" and "max_context_mib" in st["reason"]["message"], st
    with pytest.raises(BuildException, match="max_context_mib"):      # what the SDK's own build call says
        Template.build(template, "hostile-sdk-bomb")
    assert not Template.exists("hostile-sdk-bomb")
    assert node.request("GET", "/health", key=None)[0] == 204
    _repository_clean(node)
