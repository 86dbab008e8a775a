"""E2B parity, second pass (issue 17), through the real SDK (sync and async) and a real
`aenv server`: gzip uploads through the proxy, removing a missing path, symlink info,
/proc reads, signed file URLs (no sandbox header), Idempotency-Key on create. What needs
no guest (``started_after``, the create options aenv refuses, the AgentENV sandbox
header of a create) is tested in-process (test_sdk_inprocess.py)."""
from __future__ import annotations

import asyncio
import gzip
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any

import pytest

from .conftest import Server, use_sdk_env

pytestmark = pytest.mark.qemu


def _http(method: str, url: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _form(name: str, data: bytes) -> tuple[bytes, str]:
    body = (f"--BoUnD\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n--BoUnD--\r\n"
    return body, "multipart/form-data; boundary=BoUnD"


@pytest.fixture(scope="module")
def sbx(server: Server):  # type: ignore[no-untyped-def]
    from e2b import Sandbox

    with pytest.MonkeyPatch.context() as mp:
        use_sdk_env(server, mp)
        s = Sandbox.create(metadata={"suite": "parity"}, timeout=600)
        yield s
        try:
            s.kill()
        except Exception:
            pass


def _envd(server: Server, sbx: Any) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}


# --- envd corners -------------------------------------------------------------------


def test_gzip_uploads_through_the_proxy(sdk_env: Server, sbx) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(20_000) + b"compressible " * 40_000
    sbx.files.write("/tmp/gz.bin", data, gzip=True)   # octet-stream + Content-Encoding: gzip
    assert sbx.files.read("/tmp/gz.bin", format="bytes") == data
    sbx.files.write("/tmp/gz-small.txt", "small", gzip=True)   # whole-body path of the proxy
    assert sbx.files.read("/tmp/gz-small.txt") == "small"
    # a hand-made gzip multipart POST through the proxy (the body must reach envd compressed)
    form, ctype = _form("m.txt", b"multipart through the proxy")
    status, out = _http("POST", f"{sdk_env.url}/files?path=/tmp/m.txt", gzip.compress(form),
                        {**_envd(sdk_env, sbx), "Content-Type": ctype, "Content-Encoding": "gzip"})
    assert status == 200, out
    assert sbx.files.read("/tmp/m.txt") == "multipart through the proxy"
    status, out = _http("POST", f"{sdk_env.url}/files?path=/tmp/bad.bin", b"not gzip",
                        {**_envd(sdk_env, sbx), "Content-Type": "application/octet-stream",
                         "Content-Encoding": "gzip"})
    assert status == 400 and json.loads(out)["code"] == 400


def test_remove_missing_symlink_info_and_proc_reads(sdk_env: Server, sbx) -> None:  # type: ignore[no-untyped-def]
    from e2b import FileType

    sbx.files.remove("/tmp/never-there")          # E2B: succeeds silently
    sbx.files.remove("no/such/relative/dir")
    sbx.files.make_dir("/tmp/linkdir")
    sbx.files.write("/tmp/linkdir/t.txt", "target")
    sbx.commands.run("ln -s t.txt link && ln -s /tmp/linkdir dlink", cwd="/tmp/linkdir")
    info = sbx.files.get_info("/tmp/linkdir/link")
    assert info.type == FileType.FILE and info.symlink_target == "/tmp/linkdir/t.txt"
    assert sbx.files.get_info("/tmp/linkdir/dlink").type == FileType.DIR
    sbx.files.remove("/tmp/linkdir")
    assert not sbx.files.exists("/tmp/linkdir")
    # stat says 0 bytes for everything under /proc: the content must come anyway
    boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id").strip()
    assert len(boot_id) == 36 and boot_id == sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    assert sbx.files.read("/proc/self/status").startswith("Name:")


# --- signed URLs --------------------------------------------------------------------


def test_signed_urls_without_a_sandbox_header(sdk_env: Server, sbx) -> None:  # type: ignore[no-untyped-def]
    assert sbx._envd_access_token, "v2 creates are secured"
    sbx.files.write("/tmp/signed.txt", "signed download")
    url = sbx.download_url("/tmp/signed.txt")
    parts = urllib.parse.urlsplit(url)
    assert url.startswith(sdk_env.url + "/files?") and "signature=" in url and sbx.sandbox_id not in url
    assert _http("GET", url) == (200, b"signed download")
    assert _http("GET", sbx.download_url("/tmp/signed.txt", use_signature_expiration=60)) == (200, b"signed download")
    # upload: multipart POST to the signed URL, no header at all
    form, ctype = _form("signed.txt", b"signed upload")
    status, _ = _http("POST", sbx.upload_url("/tmp/signed.txt", use_signature_expiration=60), form,
                      {"Content-Type": ctype})
    assert status == 200 and sbx.files.read("/tmp/signed.txt") == "signed upload"
    # expired: 401 with E2B's body
    status, body = _http("GET", sbx.download_url("/tmp/signed.txt", use_signature_expiration=-120))
    assert (status, json.loads(body)) == (401, {"code": 401, "message": "signature is already expired"})
    # tampered: another path, a forged signature, a later expiry, a read signature used to write
    q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(
        sbx.download_url("/tmp/signed.txt", use_signature_expiration=60)).query))
    for change in ({"path": "/etc/shadow"}, {"signature": q["signature"][:-3] + "abc"},
                   {"signature_expiration": str(int(q["signature_expiration"]) + 3600)}):
        bad = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode({**q, **change})))
        status, body = _http("GET", bad)
        assert (status, json.loads(body)) == (401, {"code": 401, "message": "invalid signature"}), change
    status, _ = _http("POST", url, form, {"Content-Type": ctype})
    assert status == 401
    # a secured sandbox's files need the token or a signature, also with the routing header
    plain = f"{sdk_env.url}/files?path=/tmp/signed.txt"
    status, body = _http("GET", plain, headers={"E2b-Sandbox-Id": sbx.sandbox_id})
    assert (status, json.loads(body)["message"]) == (401, "missing signature query parameter")
    assert _http("GET", plain, headers=_envd(sdk_env, sbx)) == (200, b"signed upload")
    assert _http("GET", url.replace("/files?", "/files?x=1&"), headers={"E2b-Sandbox-Id": sbx.sandbox_id}) == (
        200, b"signed upload")
    # the host form with [server] domain routes a signed URL to its sandbox too
    host = f"49983-{sbx.sandbox_id}.aenv.test"
    assert _http("GET", url, headers={"Host": host}) == (200, b"signed upload")
    # a signature for a sandbox that does not exist, or no signature: nothing to route to
    status, body = _http("GET", f"{plain}&signature=v1_{'A' * 43}")
    assert (status, json.loads(body)) == (401, {"code": 401, "message": "invalid signature"})
    assert _http("GET", plain)[0] == 404


# --- list, idempotent create, unsupported options -------------------------------------


def test_idempotent_create_sync(sdk_env: Server) -> None:
    from e2b import Sandbox

    key = f"parity-{uuid.uuid4()}"
    a = Sandbox.create(idempotency_key=key, metadata={"suite": "idem"}, timeout=120)
    try:
        b = Sandbox.create(idempotency_key=key, metadata={"suite": "idem"}, timeout=120)
        assert b.sandbox_id == a.sandbox_id
        assert b.commands.run("echo same").stdout == "same\n"
        with pytest.raises(Exception) as exc:    # same key, another request: 422
            Sandbox.create(idempotency_key=key, metadata={"suite": "other"}, timeout=120)
        assert "different create request" in str(exc.value)
        status, _, body = sdk_env.request("POST", "/v2/sandboxes", {"templateID": "base"},
                                          headers={"Idempotency-Key": "Not Valid!"})
        assert status == 400 and "Idempotency-Key" in body["message"]
    finally:
        a.kill()
    # the key's sandbox is gone: a retry with it says so instead of making another
    with pytest.raises(Exception) as exc:
        Sandbox.create(idempotency_key=key, metadata={"suite": "idem"}, timeout=120)
    assert "no longer exists" in str(exc.value)


# --- async ----------------------------------------------------------------------------


def test_async_parity(sdk_env: Server) -> None:
    asyncio.run(_async_parity(sdk_env))


async def _async_parity(server: Server) -> None:
    from e2b import AsyncSandbox, FileType, SandboxQuery

    key = f"parity-async-{uuid.uuid4()}"
    sbx = await AsyncSandbox.create(idempotency_key=key, metadata={"suite": "parity-async"}, timeout=300)
    try:
        again = await AsyncSandbox.create(idempotency_key=key, metadata={"suite": "parity-async"}, timeout=300)
        assert again.sandbox_id == sbx.sandbox_id
        # gzip upload, missing remove, symlink, /proc
        data = b"async gzip " * 30_000
        await sbx.files.write("/tmp/agz.bin", data, gzip=True)
        assert await sbx.files.read("/tmp/agz.bin", format="bytes") == data
        await sbx.files.remove("/tmp/not-here-either")
        await sbx.commands.run("ln -sf /tmp/agz.bin /tmp/alink")
        assert (await sbx.files.get_info("/tmp/alink")).type == FileType.FILE
        boot_id = (await sbx.files.read("/proc/sys/kernel/random/boot_id")).strip()
        assert boot_id == (await sbx.commands.run("cat /proc/sys/kernel/random/boot_id")).stdout.strip()
        # signed URLs
        url = sbx.download_url("/tmp/agz.bin", use_signature_expiration=60)
        status, body = await asyncio.to_thread(_http, "GET", url)
        assert status == 200 and body == data
        status, body = await asyncio.to_thread(_http, "GET", sbx.download_url("/tmp/agz.bin",
                                                                                use_signature_expiration=-5))
        assert (status, json.loads(body)) == (401, {"code": 401, "message": "signature is already expired"})
        form, ctype = _form("x", b"async signed upload")
        status, _ = await asyncio.to_thread(_http, "POST", sbx.upload_url("/tmp/aup.txt"), form,
                                            {"Content-Type": ctype})
        assert status == 200 and await sbx.files.read("/tmp/aup.txt") == "async signed upload"
        # started_after its own start time
        started = (await sbx.get_info()).started_at
        found = await AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "parity-async"},
                                                           started_after=started)).next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
        # an unknown volume (tests/aenv_vm/volumes/test_volume_mounts.py mounts real ones)
        with pytest.raises(Exception) as exc:
            await AsyncSandbox.create(volume_mounts={"/data": "v"})
        assert "'v' not found" in str(exc.value)
    finally:
        await sbx.kill()


# --- AgentENV's routing -----------------------------------------------------------------


def test_agentenv_routing_headers_and_proxy_prefix(sdk_env: Server, sbx) -> None:  # type: ignore[no-untyped-def]
    sbx.files.write("/tmp/www/index.html", "<p>agentenv</p>")
    sbx.commands.run("cd /tmp/www && python3 -m http.server 8080 --bind 0.0.0.0 >/dev/null 2>&1", background=True)
    agentenv = {"x-agentenv-sandbox-id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    envd = {**agentenv, "x-agentenv-target-port": "49983"}
    # /proxy/<path> reaches /<path> of the guest port the headers name
    assert _http("GET", f"{sdk_env.url}/proxy/health", headers=envd)[0] == 204
    assert _http("GET", f"{sdk_env.url}/proxy/files?path=/tmp/www/index.html", headers=envd) == (
        200, b"<p>agentenv</p>")
    status, body = _http("POST", f"{sdk_env.url}/proxy/filesystem.Filesystem/Stat",
                         json.dumps({"path": "/tmp/www/index.html"}).encode(),
                         {**envd, "Content-Type": "application/json"})
    assert status == 200 and json.loads(body)["entry"]["name"] == "index.html"
    # the headers without the prefix, and a port default of envd's
    assert _http("GET", f"{sdk_env.url}/files?path=/tmp/www/index.html", headers=agentenv)[1] == b"<p>agentenv</p>"
    # a signed URL through the prefix
    signed = urllib.parse.urlsplit(sbx.download_url("/tmp/www/index.html"))
    status, body = _http("GET", f"{sdk_env.url}/proxy/files?{signed.query}",
                         headers={"x-agentenv-sandbox-id": sbx.sandbox_id, "x-agentenv-target-port": "49983"})
    assert (status, body) == (200, b"<p>agentenv</p>")
    # another guest port; /proxy alone is the guest's /
    app = {"x-agentenv-sandbox-id": sbx.sandbox_id, "x-agentenv-target-port": "8080"}
    deadline = time.monotonic() + 60    # the server starts in the background
    while True:
        status, body = _http("GET", f"{sdk_env.url}/proxy/index.html", headers=app)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (status, body) == (200, b"<p>agentenv</p>")
    status, body = _http("GET", f"{sdk_env.url}/proxy", headers=app)
    assert (status, body) == (200, b"<p>agentenv</p>")   # the guest's / (its index.html)
    # what cannot be routed
    status, body = _http("GET", f"{sdk_env.url}/proxy/files?path=/etc/hostname")
    assert status == 400 and "missing sandbox routing header" in json.loads(body)["message"]
    status, body = _http("GET", f"{sdk_env.url}/proxy/health", headers={**envd, "x-agentenv-target-port": "nope"})
    assert status == 400 and "X-Agentenv-Target-Port" in json.loads(body)["message"]
    assert _http("GET", f"{sdk_env.url}/proxy/health", headers={"x-agentenv-sandbox-id": "sbx-nope"})[0] == 502


def test_connect_after_a_timeout_pause_keeps_running(sdk_env: Server) -> None:
    """The intermittent "closed the connection to port 49983 without an answer" after a
    timeout auto-pause and ``connect()``: the resume took the sandbox's own timeout,
    which ``set_timeout(0)`` had made 0, so the TTL paused it again at once and the
    next call met a stopping VM. A connect without a timeout now gives such a sandbox
    the default; and the first call after it is answered, several times over."""
    from e2b import Sandbox
    for _ in range(4):
        sbx = Sandbox.create("base", timeout=60, lifecycle={"on_timeout": {"action": "pause", "keep_memory": None}})
        try:
            boot = sbx.files.read("/proc/sys/kernel/random/boot_id").strip()
            sbx.set_timeout(0)
            deadline = time.monotonic() + 60
            while sbx.is_running(request_timeout=20) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not sbx.is_running()
            resumed = sbx.connect()
            assert resumed.files.read("/proc/sys/kernel/random/boot_id", request_timeout=20).strip() == boot
            time.sleep(1.5)   # the TTL would have paused it again by now
            info = resumed.get_info()
            assert info.state.value == "running", info
            assert info.end_at.timestamp() - time.time() > 200   # the default timeout, not 0
        finally:
            sbx.kill()


def test_command_of_a_killed_sandbox_says_it_was_killed(sdk_env: Server) -> None:
    """The SDK checks /health the moment a command's stream breaks, which is while the
    kill is still stopping the VM: the proxy must already answer E2B's "not found"."""
    from e2b import AsyncSandbox, TimeoutException

    async def flow() -> None:
        for _ in range(3):
            sbx = await AsyncSandbox.create("base")
            cmd = await sbx.commands.run("sleep 60", background=True)
            await sbx.kill()
            with pytest.raises(TimeoutException) as err:
                await cmd.wait()
            assert "sandbox was killed or reached its end of life" in str(err.value)
    asyncio.run(flow())
