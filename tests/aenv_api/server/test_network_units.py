"""E2B's network options on the API side, without a VM: the schemas of the ``network``
objects (create and ``PUT /sandboxes/{id}/network``), what they mean (network.py),
what ``get_info`` shows, the traffic access token, the per-sandbox fields kept in the
extras, and TLS to a guest port (httpsPorts) in the proxy's upstream client."""
from __future__ import annotations

import dataclasses

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, strategies as st

from aenv_api.server.access_tokens import AccessTokens
from aenv_api.server.auth import Credentials, traffic_token
from aenv_api.server.errors import ApiError
from aenv_api.server.extras import ApiExtras, Extra
from aenv_api.server.network import (ProxyRules, create_network, egress_choice, network_view,
                                     update_policy)
from aenv_api.server.schemas import NETWORK_UPDATE, new_sandbox_schema
from aenv_api.server.upstream import Upstreams
from aenv_vm.net.policy import NetworkPolicy, parse_policy
from aenv_vm.net.transforms import parse_rules

NEW = new_sandbox_schema(3600)
NETWORK_FIELDS = ["allowOut", "denyOut", "dnsServers", "allowPublicTraffic", "maskRequestHost", "httpsPorts",
                  "egressProxy", "rules"]


def created(network: Any, allow_internet_access: Any = None) -> Any:
    """What a create body's ``network`` becomes: schema first, then its meaning."""
    body: dict[str, Any] = {"templateID": "base", "network": network}
    if allow_internet_access is not None:
        body["allow_internet_access"] = allow_internet_access
    values = NEW.parse_body(body)
    return create_network(values["network"], values["allow_internet_access"])


def updated(body: Any) -> NetworkPolicy:
    return update_policy(NETWORK_UPDATE.parse_body(body))


def accepted(parse: Any, raw: Any) -> Any:
    """``parse(raw)``, or None when it was refused as it must be: a 400 naming the field."""
    try:
        return parse(raw)
    except ApiError as e:
        assert e.status == 400 and e.message.startswith("network"), e.message
        return None


# -- strategies: E2B-shaped entries, and junk around them ------------------------------

_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
hostnames = st.builds(lambda parts, wild: ("*." if wild else "") + ".".join(parts),
                      st.lists(_label, min_size=2, max_size=4), st.booleans())
ips = st.ip_addresses(v=4).map(str)
cidrs = st.builds(lambda a, p: str(ipaddress.IPv4Network(f"{a}/{p}", strict=False)), ips, st.integers(0, 32))
allow_entries = st.one_of(hostnames, ips, cidrs)
junk_strings = st.text(max_size=40)
entry_lists = st.lists(st.one_of(allow_entries, junk_strings), max_size=6)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)
network_objects = st.dictionaries(
    st.sampled_from(NETWORK_FIELDS + ["allow_out", "other"]),
    st.one_of(entry_lists, st.booleans(), st.none(), st.lists(st.integers(-5, 70000), max_size=4),
              st.sampled_from(["${PORT}-x.example.com", "bad host", "a\r\nb"]), json_values), max_size=6)


@given(network_objects | json_values)
def test_create_network_accepts_or_names_the_field(raw: Any) -> None:
    net = accepted(created, raw)
    if net is None:
        return
    if not isinstance(raw, dict) or not raw:
        assert net.policy == NetworkPolicy() and net.public_traffic
        return
    assert set(raw) <= set(NETWORK_FIELDS)               # an unknown field never gets through
    assert net.public_traffic is (raw.get("allowPublicTraffic") is not False)
    assert all(1 <= p <= 65535 and p != 49983 for p in net.https_ports)
    assert net.mask_request_host is None or not any(c in net.mask_request_host for c in " \r\n\t\x00")
    assert raw.get("egressProxy") is None   # unsupported: never accepted
    # what get_info shows parses back to the very same policy (nothing lost, nothing added)
    view = network_view(net.policy, Extra(public_traffic=net.public_traffic))
    shown = parse_policy(view["allowOut"], view["denyOut"], view.get("dnsServers"))
    assert dataclasses.replace(shown, transforms=parse_rules(view.get("rules"), "")) == net.policy


@given(st.lists(allow_entries, max_size=8), st.lists(st.one_of(ips, cidrs), max_size=8),
       st.none() | st.lists(ips, max_size=10))
def test_valid_rules_always_pass_and_show_normalised(allow: list[str], deny: list[str],
                                                     dns: list[str] | None) -> None:
    body: dict[str, Any] = {"allowOut": allow, "denyOut": deny}
    if dns is not None:
        body["dnsServers"] = dns
    net = created(body)
    view = network_view(net.policy, Extra())
    assert set(view["allowOut"]) == {_shown(e) for e in allow}
    assert set(view["denyOut"]) == {_shown(e) for e in deny}
    assert view.get("dnsServers") == (None if dns is None else list(dns))
    assert updated(body) == net.policy                    # the same rules mean the same thing in an update


def _shown(entry: str) -> str:
    try:
        net = ipaddress.IPv4Network(entry, strict=False)
    except ValueError:
        return entry.lower()
    return str(net.network_address) if net.prefixlen == 32 else str(net)


@given(st.dictionaries(st.sampled_from(["allowOut", "denyOut", "dnsServers", "egressProxy", "rules",
                                        "allow_internet_access", "allowPublicTraffic", "x"]),
                       st.one_of(entry_lists, st.booleans(), st.none(), json_values), max_size=5) | json_values)
def test_update_body_accepts_or_names_the_field(raw: Any) -> None:
    policy = accepted(updated, raw)
    if policy is None:
        return
    assert isinstance(raw, dict) and set(raw) <= {"allowOut", "denyOut", "dnsServers", "egressProxy", "rules",
                                                  "allow_internet_access"}
    # no internet exactly when the body turns it off or denies 0.0.0.0/0 itself
    denies_all = isinstance(raw.get("denyOut"), list) and "0.0.0.0/0" in raw["denyOut"]
    assert policy.internet is not (raw.get("allow_internet_access") is False or denies_all)


@pytest.mark.parametrize("network, words", [
    ({"allowOut": ["not a host!"]}, "network.allowOut"),
    ({"allowOut": ["2001:db8::/32"]}, "IPv6"),
    ({"denyOut": ["example.com"]}, "network.denyOut"),
    ({"denyOut": "0.0.0.0/0"}, "network.denyOut must be an array"),
    ({"allowOut": [1]}, "network.allowOut[0] must be a string"),
    ({"dnsServers": ["dns.google"]}, "network.dnsServers"),
    ({"dnsServers": ["1.1.1.1"] * 11}, "network.dnsServers"),
    ({"allowOut": ["10.0.0.1"] * 129}, "network.allowOut"),
    ({"allowPublicTraffic": "no"}, "network.allowPublicTraffic must be a boolean"),
    ({"httpsPorts": [0]}, "network.httpsPorts[0]"),
    ({"httpsPorts": ["443"]}, "network.httpsPorts[0] must be an integer"),
    ({"httpsPorts": [49983]}, "envd port"),
    ({"maskRequestHost": "a b"}, "network.maskRequestHost"),
    ({"maskRequestHost": "x\r\nX-Evil: 1"}, "network.maskRequestHost"),
    ({"maskRequestHost": ""}, "network.maskRequestHost"),
    ({"egressProxy": {"address": "proxy.example.com:1080"}}, "network.egressProxy: a SOCKS5 egress proxy is not "
                                                             "supported by this server"),
    ({"egressProxy": {}}, "not supported by this server"),
    ({"rules": {"api.example.com": [{"transform": {"headers": {"A": "${e2b.secrets.k}"}}}]}},
     "network.rules.api.example.com: a domain whose headers use secrets must be allowed by name"),
    ({"rules": {"api.example.com": [{"transform": {"headers": {"Host": "b"}}}]}}, "frames the request"),
    ({"rules": []}, "network.rules must be an object"),
    ({"allow_out": ["1.1.1.1"]}, "network.allow_out is not a known field"),
    ({"allowInternetAccess": False}, "network.allowInternetAccess is not a known field"),
    ([], "network must be a JSON object"),
])
def test_bad_create_networks_are_400_naming_the_field(network: Any, words: str) -> None:
    with pytest.raises(ApiError) as exc:
        created(network)
    assert exc.value.status == 400 and words in exc.value.message and exc.value.message.startswith("network")


@pytest.mark.parametrize("body, words", [
    ({"allowOut": ["bad_host"]}, "network.allowOut"),
    ({"egressProxy": {"address": "p:1080"}}, "network.egressProxy"),
    ({"rules": {"a.com": [{"x": 1}]}}, "network.rules"),
    ({"allowPublicTraffic": False}, "network.allowPublicTraffic is not a known field"),   # create-only
    ({"maskRequestHost": "x"}, "network.maskRequestHost is not a known field"),
    ({"allow_internet_access": "yes"}, "network.allow_internet_access must be a boolean"),
    ("x", "network must be a JSON object"),
])
def test_bad_update_bodies_are_400_naming_the_field(body: Any, words: str) -> None:
    with pytest.raises(ApiError) as exc:
        updated(body)
    assert exc.value.status == 400 and words in exc.value.message


def test_create_network_examples() -> None:
    net = created({"allowOut": ["Example.COM", "8.8.8.8/32", "10.1.2.3/16", "*.pypi.org"],
                   "denyOut": ["0.0.0.0/0"], "dnsServers": ["1.1.1.1"], "allowPublicTraffic": False,
                   "maskRequestHost": "${PORT}-app.example.com", "httpsPorts": [8443, 443, 8443],
                   "egressProxy": None, "rules": {}})   # null proxy and empty rules ask for nothing
    assert net.policy.allow_out == ["8.8.8.8", "10.1.0.0/16", "example.com", "*.pypi.org"]
    assert net.policy.deny_out == ["0.0.0.0/0"] and net.policy.dns_servers == ("1.1.1.1",)
    assert not net.public_traffic and net.https_ports == (443, 8443)
    assert net.mask_request_host == "${PORT}-app.example.com"
    view = network_view(net.policy, Extra(public_traffic=False, mask_request_host=net.mask_request_host,
                                          https_ports=net.https_ports))
    assert view == {"allowOut": ["8.8.8.8", "10.1.0.0/16", "example.com", "*.pypi.org"], "denyOut": ["0.0.0.0/0"],
                    "dnsServers": ["1.1.1.1"], "allowPublicTraffic": False,
                    "maskRequestHost": "${PORT}-app.example.com", "httpsPorts": [443, 8443]}
    assert network_view(NetworkPolicy(), Extra()) == {"allowOut": [], "denyOut": [], "allowPublicTraffic": True}
    assert created(None).policy == created({}).policy == NetworkPolicy()
    assert created({"allowPublicTraffic": None}).public_traffic               # null: the default (public)
    assert created({"dnsServers": []}).policy.dns_servers == ()               # [] means none, not the default


def test_rules_become_the_policys_transforms_and_show_as_given() -> None:
    rules = {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.key}"}}}]}
    body = {"allowOut": ["api.example.com"], "rules": rules}
    net = created(body)
    assert net.policy.transforms is not None and net.policy.transforms.rules[0].domain == "api.example.com"
    assert network_view(net.policy, Extra())["rules"] == rules      # markers, never a value
    assert update_policy(NETWORK_UPDATE.parse_body(body), "t").transforms is not None
    assert update_policy(NETWORK_UPDATE.parse_body({"allowOut": ["api.example.com"]})
                         ).transforms is None                       # E2B: an update without rules clears them


def test_allow_internet_access_and_deny_all_are_one_thing() -> None:
    """E2B: ``allow_internet_access: false`` is ``denyOut: ["0.0.0.0/0"]``; the explicit field wins."""
    assert not created(None, allow_internet_access=False).policy.internet
    assert created(None, allow_internet_access=False).policy.deny_out == ["0.0.0.0/0"]
    assert created({"denyOut": ["0.0.0.0/0", "8.8.8.8"]}, allow_internet_access=True).policy.deny_out == ["8.8.8.8"]
    for network, field, want in [(None, None, None), (None, True, True), (None, False, False),
                                 ({"denyOut": ["0.0.0.0/0"]}, None, False),
                                 ({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"]}, None, False),
                                 ({"denyOut": ["8.8.8.8"]}, None, None),
                                 ({"denyOut": ["0.0.0.0/0"]}, True, True)]:
        net = created(network, allow_internet_access=field)
        assert egress_choice(field, net.policy) is want, (network, field)
        assert net.policy.internet is (want is not False)


def test_update_replaces_everything() -> None:
    """"Omitting a field clears it": an update is the whole new egress configuration."""
    assert updated({}) == NetworkPolicy()
    p = updated({"allowOut": ["1.1.1.1"], "allow_internet_access": False})
    assert p.allow_out == ["1.1.1.1"] and p.deny_out == ["0.0.0.0/0"] and p.dns_servers is None
    assert updated({"denyOut": ["0.0.0.0/0"], "allow_internet_access": True}).deny_out == []
    assert updated({"dnsServers": ["9.9.9.9"]}).dns_servers == ("9.9.9.9",)


def test_proxy_rules_mask_the_host() -> None:
    rules = ProxyRules(mask_request_host="${PORT}-app.example.com:${PORT}")
    assert rules.host_header(8080) == "8080-app.example.com:8080"
    assert ProxyRules().host_header(8080) is None


def test_traffic_token_is_its_own_hmac(tmp_path: Path) -> None:
    secret = b"s" * 32
    key = hmac.new(secret, b"aenv traffic access token v1", hashlib.sha256).digest()
    want = base64.urlsafe_b64encode(hmac.new(key, b"sbx-1", hashlib.sha256).digest()).rstrip(b"=").decode()
    assert traffic_token(secret, "sbx-1") == want
    envd = AccessTokens(secret)
    assert traffic_token(secret, "sbx-1") not in (envd.client("sbx-1"), envd.guest("sbx-1"))  # none gives another away
    assert traffic_token(secret, "sbx-1") != traffic_token(secret, "sbx-2")
    creds = Credentials.load(tmp_path, environ={})
    again = Credentials.load(tmp_path, environ={})                            # a restart: the same token
    assert creds.traffic_token("sbx-9") == again.traffic_token("sbx-9") != creds.access_tokens.client("sbx-9")


def test_extras_keep_the_proxy_fields(tmp_path: Path) -> None:
    path = tmp_path / "api-sandboxes.json"
    path.write_text(json.dumps({"sbx-old": {"alias": "base", "auto_resume": False, "disk_mb": 10}}))
    extras = ApiExtras(path)
    assert extras.get("sbx-old") == Extra("base", False, 10)          # a file from before: public, no mask
    assert extras.find("sbx-none") is None and extras.get("sbx-none") == Extra()
    extras.put("sbx-new", Extra("base", True, 20, False, "${PORT}-x.example.com", (443, 8443)))
    again = ApiExtras(path)                                            # a restart reads them back
    assert again.get("sbx-new") == Extra("base", True, 20, False, "${PORT}-x.example.com", (443, 8443))


def test_upstream_reaches_a_tls_port_without_verifying(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=guest"], check=True, capture_output=True)

    async def run() -> tuple[bytes, bytes]:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
        port = server.sockets[0].getsockname()[1]
        ups = Upstreams()
        try:
            conn, reused = await ups.acquire("127.0.0.1", port, tls=True)   # self-signed: accepted
            assert not reused
            conn.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while b"ok" not in got:
                piece = await conn.read()
                assert piece, got
                got += piece
            conn.close()
            plain, _ = await ups.acquire("127.0.0.1", port)                 # the same port in plain text
            plain.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await asyncio.wait_for(plain.read(), 10)
            plain.close()
            return got, answer
        finally:
            ups.close()
            server.close()
            await server.wait_closed()

    got, plain = asyncio.run(run())
    assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"ok")
    assert not plain.startswith(b"HTTP/1.1 200")       # a TLS server does not answer plain HTTP


def test_openapi_describes_the_network_objects() -> None:
    from aenv_api.server.routes import openapi
    from aenv_api.server.settings import ServerConfig
    from aenv_api.server.api import ControlPlane
    from aenv_api.server.metrics import Metrics

    routes = ControlPlane(None, Metrics(), ServerConfig()).routes()  # type: ignore[arg-type]
    doc = openapi(routes, "test")
    put = doc["paths"]["/sandboxes/{sandboxID}/network"]["put"]
    assert put["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/SandboxNetworkUpdateConfig")
    assert {"204", "404", "409"} <= set(put["responses"])
    comps = doc["components"]["schemas"]
    assert comps["SandboxNetworkConfig"]["additionalProperties"] is False
    assert comps["SandboxNetworkUpdateConfig"]["additionalProperties"] is False
    assert comps["SandboxNetworkConfig"]["properties"]["httpsPorts"]["items"]["maximum"] == 65535
    assert "network" in comps["SandboxDetail"]["properties"]
    assert "trafficAccessToken" in comps["Sandbox"]["properties"]
