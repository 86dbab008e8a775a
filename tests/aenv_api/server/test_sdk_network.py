"""E2B's network controls through the real e2b SDK (sync and async), API side: the
rules a create and ``update_network`` set are what ``get_info`` shows, across pause →
connect and in a fork child; malformed rules and unsupported options are 400 naming
the field; ``allow_public_traffic=False`` makes every guest port but envd's demand
the ``e2b-traffic-access-token`` header; ``mask_request_host`` is the Host the guest
sees; ``https_ports`` are reached over TLS. Whether the guest's packets obey the rules
is the enforcement tests' business (the VM layer), not this module's."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from typing import Any, Iterator

import pytest

from .conftest import Server, use_sdk_env
from tests.support import require

pytestmark = pytest.mark.qemu

RULES = {"allow_out": ["Example.COM", "198.51.100.7/32", "*.pypi.org"], "deny_out": ["203.0.113.0/24"],
         "dns_servers": ["192.0.2.53"]}
RULES_SHOWN = {"allow_out": ["198.51.100.7", "example.com", "*.pypi.org"], "deny_out": ["203.0.113.0/24"],
               "dns_servers": ["192.0.2.53"], "allow_public_traffic": True}
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
def ruled(server: Server) -> Iterator[Any]:
    from e2b import Sandbox

    with pytest.MonkeyPatch.context() as mp:
        use_sdk_env(server, mp)
        s = Sandbox.create(network=RULES, metadata={"suite": "network"}, timeout=600)
        yield s
        try:
            s.kill()
        except Exception:
            pass


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

def test_create_rules_show_in_get_info(sdk_env: Server, ruled: Any) -> None:
    from e2b import Sandbox

    info = ruled.get_info()
    assert _shown(info) == RULES_SHOWN            # CIDRs normalised (/32 shown bare), hostnames lower-case
    assert info.allow_internet_access is None      # the internet is not denied as a whole
    status, _, detail = sdk_env.request("GET", f"/sandboxes/{ruled.sandbox_id}")
    assert status == 200 and detail["network"] == {
        "allowOut": ["198.51.100.7", "example.com", "*.pypi.org"], "denyOut": ["203.0.113.0/24"],
        "dnsServers": ["192.0.2.53"], "allowPublicTraffic": True}
    assert "trafficAccessToken" not in detail     # a token is given at create and connect only
    status, _, listed = sdk_env.request("GET", "/v2/sandboxes?metadata=suite%3Dnetwork")
    assert status == 200 and [x["sandboxID"] for x in listed] == [ruled.sandbox_id]
    assert "network" not in listed[0]             # E2B's ListedSandbox has no network
    assert Sandbox.get_info(ruled.sandbox_id).network == info.network


def test_update_network_replaces_the_rules(sdk_env: Server, ruled: Any) -> None:
    from e2b import AsyncSandbox, Sandbox, SandboxNotFoundException

    ruled.update_network({"allow_out": ["pypi.org", "*.pythonhosted.org"], "deny_out": ["198.18.0.0/15"],
                          "dns_servers": ["1.1.1.1"]})
    assert _shown(ruled.get_info()) == {"allow_out": ["pypi.org", "*.pythonhosted.org"],
                                        "deny_out": ["198.18.0.0/15"], "dns_servers": ["1.1.1.1"],
                                        "allow_public_traffic": True}
    Sandbox.update_network(ruled.sandbox_id, {"deny_out": ["192.0.2.0/24"]})   # omitted fields are cleared
    assert _shown(ruled.get_info()) == {"allow_out": [], "deny_out": ["192.0.2.0/24"], "allow_public_traffic": True}
    ruled.update_network({"allow_out": ["1.1.1.1"], "allow_internet_access": False})
    info = ruled.get_info()
    assert _shown(info)["deny_out"] == ["0.0.0.0/0"] and info.allow_internet_access is False

    async def via_async() -> dict[str, Any]:
        a = await AsyncSandbox.connect(ruled.sandbox_id)
        await a.update_network({"allow_out": ["10.20.0.0/16"], "deny_out": ["0.0.0.0/0"]})
        return dict((await a.get_info()).network or {})
    assert asyncio.run(via_async())["allow_out"] == ["10.20.0.0/16"]

    status, _, body = sdk_env.request("PUT", f"/sandboxes/{ruled.sandbox_id}/network",
                                      body={"allowOut": ["8.8.8.8"], "dnsServers": []})
    assert status == 204 and body == b""
    assert _shown(ruled.get_info()) == {"allow_out": ["8.8.8.8"], "deny_out": [], "dns_servers": [],
                                        "allow_public_traffic": True}
    status, _, body = sdk_env.request("PUT", "/sandboxes/sbx-nope/network", body={})
    assert status == 404 and body["code"] == 404
    with pytest.raises(SandboxNotFoundException):
        Sandbox.update_network("sbx-nope", {"allow_out": ["1.1.1.1"]})


def test_rules_survive_pause_connect_and_fork(sdk_env: Server, ruled: Any) -> None:
    from e2b import Sandbox, SandboxException, SandboxState

    rules = {"allow_out": ["example.org", "198.51.100.0/24"], "deny_out": ["0.0.0.0/0"], "dns_servers": ["9.9.9.9"]}
    ruled.update_network(rules)
    shown = _shown(ruled.get_info())
    ruled.pause()
    paused = Sandbox.get_info(ruled.sandbox_id)
    assert paused.state == SandboxState.PAUSED and _shown(paused) == shown
    status, _, body = sdk_env.request("PUT", f"/sandboxes/{ruled.sandbox_id}/network", body={})
    assert status == 409 and body["code"] == 409 and "paused" in body["message"]   # E2B: running sandboxes only
    with pytest.raises(SandboxException, match="409"):
        Sandbox.update_network(ruled.sandbox_id, {})
    back = Sandbox.connect(ruled.sandbox_id)
    assert back.get_info().state == SandboxState.RUNNING and _shown(back.get_info()) == shown
    children = back.fork(count=1)
    assert len(children) == 1 and not isinstance(children[0], Exception), children
    try:
        assert _shown(children[0].get_info()) == shown                 # a fork child inherits the rules
        children[0].update_network({})                                  # and has its own from then on
        assert _shown(children[0].get_info())["allow_out"] == []
        assert _shown(back.get_info()) == shown
    finally:
        children[0].kill()


def test_malformed_rules_are_400_naming_the_field(sdk_env: Server, ruled: Any) -> None:
    from e2b import Sandbox, SandboxException

    for network, words in [({"allow_out": ["not a host!"]}, "network.allowOut"),
                           ({"deny_out": ["example.com"]}, "network.denyOut"),
                           ({"dns_servers": ["dns.google"]}, "network.dnsServers"),
                           ({"https_ports": [49983]}, "network.httpsPorts"),
                           ({"mask_request_host": "bad host"}, "network.maskRequestHost"),
                           ({"egress_proxy": {"address": "proxy.example.com:1080"}},
                            "network.egressProxy: a SOCKS5 egress proxy is not supported by this server"),
                           ({"rules": {"api.example.com": [{"transform": {"headers": {"X-K": "v"}}}]}},
                            "network.rules: per-domain header transforms are not supported by this server")]:
        with pytest.raises(SandboxException, match="400") as exc:
            Sandbox.create(network=network)                # type: ignore[arg-type]
        assert words in str(exc.value), (network, exc.value)
        update = {k: v for k, v in network.items() if k in ("allow_out", "deny_out", "dns_servers", "egress_proxy",
                                                             "rules")}
        if update:
            with pytest.raises(SandboxException, match="400") as exc:
                ruled.update_network(update)               # type: ignore[arg-type]
            assert words in str(exc.value), (update, exc.value)
    raw = [("POST", "/v2/sandboxes", {"templateID": "base", "network": {"allowOut": "1.1.1.1"}}, "network.allowOut"),
           ("POST", "/v2/sandboxes", {"templateID": "base", "network": {"futureControl": True}}, "network.futureControl"),
           ("POST", "/v2/sandboxes", {"templateID": "base", "network": {"httpsPorts": [0]}}, "network.httpsPorts[0]"),
           ("PUT", f"/sandboxes/{ruled.sandbox_id}/network", {"allowPublicTraffic": False},
            "network.allowPublicTraffic is not a known field"),
           ("PUT", f"/sandboxes/{ruled.sandbox_id}/network", {"denyOut": [7]}, "network.denyOut[0]"),
           ("PUT", "/sandboxes/sbx-nope/network", {"allowOut": ["a b"]}, "network.allowOut")]  # validated first
    for method, path, body, words in raw:
        status, headers, got = sdk_env.request(method, path, body=body)
        assert status == 400 and got["code"] == 400 and words in got["message"], (path, body, got)
        assert headers["Content-Type"].startswith("application/json")
    assert _shown(ruled.get_info())["allow_out"] != ["not a host!"]   # nothing of a refused update was kept


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


def test_a_public_sandbox_has_no_traffic_token(sdk_env: Server, ruled: Any) -> None:
    assert ruled.traffic_access_token is None
    status, _, body = sdk_env.request("POST", f"/v2/sandboxes/{ruled.sandbox_id}/connect", body={"timeout": 600})
    assert status in (200, 201) and "trafficAccessToken" not in body


def test_openapi_has_the_network_route(sdk_env: Server) -> None:
    status, _, doc = sdk_env.request("GET", "/openapi.json", key=None)
    assert status == 200 and "put" in doc["paths"]["/sandboxes/{sandboxID}/network"]
