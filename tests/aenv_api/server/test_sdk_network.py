"""E2B's network controls through the real e2b SDK (sync and async) and a real server,
where a guest answers: ``allow_public_traffic=False`` makes every guest port but envd's
demand the ``e2b-traffic-access-token`` header; ``mask_request_host`` is the Host the
guest sees; ``https_ports`` are reached over TLS. The rules as the API keeps and shows
them (create, ``update_network``, across pause -> connect and in a fork child, malformed
rules 400 naming the field) are tested in-process (test_sdk_inprocess.py). Whether the
guest's packets obey the rules is the enforcement tests' business (the VM layer)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any, Iterator

import pytest

from .conftest import Server, use_sdk_env
from tests.support import require

pytestmark = pytest.mark.qemu

MASK = "${PORT}-masked.example.test"
TOKEN = "e2b-traffic-access-token"

# One guest program serving 8080 (HTTP) and 8443 (HTTPS, a self-signed certificate made on
# the host): every GET answers the request's headers as JSON.
GUEST_SERVER = r"""
import http.server, json, socketserver, ssl, threading
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        b = json.dumps(dict(self.headers)).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
tls = S(("0.0.0.0", 8443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/tmp/guest-cert.pem", "/tmp/guest-key.pem")
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=tls.serve_forever, daemon=True).start()
S(("0.0.0.0", 8080), H).serve_forever()
"""


def _shown(info: Any) -> dict[str, Any]:
    return dict(info.network or {})


@pytest.fixture(scope="module")
def secured(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A sandbox with allow_public_traffic=False, a Host mask and an HTTPS port, its guest
    server answering on 8080 and 8443."""
    from e2b import Sandbox

    require(shutil.which("openssl") is not None, "openssl is not installed")
    keys = tmp_path_factory.mktemp("guest-tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(keys / "key.pem"),
                    "-out", str(keys / "cert.pem"), "-days", "2", "-subj", "/CN=guest"], check=True,
                   capture_output=True)
    with pytest.MonkeyPatch.context() as mp:
        use_sdk_env(server, mp)
        s = Sandbox.create(network={"allow_public_traffic": False, "mask_request_host": MASK, "https_ports": [8443]},
                           timeout=600)
        try:
            s.files.write("/tmp/guest-cert.pem", (keys / "cert.pem").read_text())
            s.files.write("/tmp/guest-key.pem", (keys / "key.pem").read_text())
            s.files.write("/tmp/guest_server.py", GUEST_SERVER)
            s.commands.run("python3 /tmp/guest_server.py", background=True)
            for port in (8080, 8443):
                _wait_for(server, s.sandbox_id, port, s.traffic_access_token)
            yield s
        finally:
            try:
                s.kill()
            except Exception:
                pass


def _guest(server: Server, sid: str, port: int, token: str | None = None, **headers: str) -> tuple[int, Any]:
    hdr = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port), **headers}
    if token is not None:
        hdr[TOKEN] = token
    status, _, body = server.request("GET", "/echo", headers=hdr, key=None)
    return status, (json.loads(body) if status == 200 and isinstance(body, bytes) else body)


def _wait_for(server: Server, sid: str, port: int, token: str | None) -> None:
    deadline = time.monotonic() + 120
    while True:
        status, body = _guest(server, sid, port, token)
        if status == 200:
            return
        assert time.monotonic() < deadline, (port, status, body)
        time.sleep(0.5)


# -- egress rules: create, get_info, update, pause/connect, fork ----------------------

# -- allow_public_traffic, mask_request_host, https_ports -----------------------------

def test_traffic_token_guards_every_port_but_envd(sdk_env: Server, secured: Any) -> None:
    from e2b import Sandbox

    sid, token = secured.sandbox_id, secured.traffic_access_token
    assert token == sdk_env.traffic_token(sid) != secured._envd_access_token
    for given in (None, "", token[:-1] + ("A" if token[-1] != "A" else "B"), secured._envd_access_token,
                  sdk_env.api_key):
        status, body = _guest(sdk_env, sid, 8080, given)
        assert status == 403 and body["code"] == 403 and body["sandboxId"] == sid, (given, body)
        assert "traffic access token" in body["message"] and TOKEN in body["message"]
    status, seen = _guest(sdk_env, sid, 8080, token, **{"X-API-Key": sdk_env.api_key})
    assert status == 200
    assert TOKEN not in {k.lower() for k in seen} and "x-api-key" not in {k.lower() for k in seen}
    # host routing (<port>-<id>.<domain>) is the same proxy
    for given, want in ((None, 403), (token, 200)):
        hdr = {"Host": f"8080-{sid}.aenv.test", **({TOKEN: given} if given else {})}
        status, _, _ = sdk_env.request("GET", "/echo", headers=hdr, key=None)
        assert status == want
    # envd keeps its own check: the SDK's envd calls carry no traffic token and work
    assert secured.commands.run("echo envd-ok").stdout.strip() == "envd-ok"
    hdr = {"E2b-Sandbox-Id": sid}
    assert sdk_env.request("GET", "/health", headers=hdr, key=None)[0] == 401                  # no envd token
    assert sdk_env.request("GET", "/health", headers={**hdr, TOKEN: token}, key=None)[0] == 401
    assert sdk_env.request("GET", "/health", headers={**hdr, "X-Access-Token": secured._envd_access_token},
                           key=None)[0] == 204
    # the traffic token never opens the control plane
    for headers in ({TOKEN: token}, {"X-API-Key": token}, {"Authorization": f"Bearer {token}"}):
        status, _, body = sdk_env.request("GET", f"/sandboxes/{sid}", headers=headers, key=None)
        assert status == 401 and body["code"] == 401, headers
    info = secured.get_info()
    assert _shown(info) == {"allow_out": [], "deny_out": [], "allow_public_traffic": False,
                            "mask_request_host": MASK, "https_ports": [8443]}
    assert Sandbox.connect(sid).traffic_access_token == token       # connect hands the same token out


def test_mask_request_host_is_the_host_the_guest_sees(sdk_env: Server, secured: Any) -> None:
    status, seen = _guest(sdk_env, secured.sandbox_id, 8080, secured.traffic_access_token)
    assert status == 200 and seen["Host"] == "8080-masked.example.test"


def test_https_port_is_reached_over_tls(sdk_env: Server, secured: Any) -> None:
    status, seen = _guest(sdk_env, secured.sandbox_id, 8443, secured.traffic_access_token)
    assert status == 200 and seen["Host"] == "8443-masked.example.test"   # the TLS server answered through it
    status, body = _guest(sdk_env, secured.sandbox_id, 8443)
    assert status == 403


def test_traffic_token_survives_pause_and_forks_get_their_own(sdk_env: Server, secured: Any) -> None:
    from e2b import Sandbox

    sid, token = secured.sandbox_id, secured.traffic_access_token
    secured.pause()
    status, body = _guest(sdk_env, sid, 8080)     # refused before the sandbox is even looked up
    assert status == 403 and body["sandboxId"] == sid
    back = Sandbox.connect(sid)
    assert back.traffic_access_token == token
    assert _guest(sdk_env, sid, 8080)[0] == 403
    _wait_for(sdk_env, sid, 8080, token)           # the guest server survived the pause
    children = back.fork(count=1)
    assert len(children) == 1 and not isinstance(children[0], Exception), children
    child = children[0]
    try:
        assert child.traffic_access_token == sdk_env.traffic_token(child.sandbox_id) != token
        assert _guest(sdk_env, child.sandbox_id, 8080, token)[0] == 403    # the parent's token does not open it
        _wait_for(sdk_env, child.sandbox_id, 8080, child.traffic_access_token)
        status, seen = _guest(sdk_env, child.sandbox_id, 8080, child.traffic_access_token)
        assert seen["Host"] == "8080-masked.example.test"                 # the mask is inherited too
        assert _shown(child.get_info())["allow_public_traffic"] is False
        assert _guest(sdk_env, sid, 8080, child.traffic_access_token)[0] == 403
    finally:
        child.kill()
