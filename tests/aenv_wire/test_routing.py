"""Which requests are sandbox traffic (aenv_wire/routing.py): host parsing round-trips
and refuses anything else with None; routing headers give an address or BadRoute;
signed file URLs naming no sandbox are recognised by their shape. Pure."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from aenv_wire.errors import BadRoute
from aenv_wire.routing import (SandboxAddress, has_proxy_prefix, has_routing_header, is_sdk_connect,
                               is_unrouted_envd_call, is_unrouted_signed_url, parse_host, sandbox_route)

ids = st.from_regex(r"[a-z0-9][a-z0-9-]{0,30}", fullmatch=True)
domains = st.from_regex(r"[a-z0-9-]{1,10}(\.[a-z0-9-]{1,10}){0,2}", fullmatch=True)


@pytest.mark.parametrize("host, expected", [
    ("49983-sbx-1.aenv.local", ("sbx-1", 49983)), ("8080-sbx-2.AENV.local:8000", ("sbx-2", 8080)),
    ("sbx-1.aenv.local", None), ("49983-.aenv.local", None), ("x-sbx.aenv.local", None),
    ("49983-sbx-1.other.local", None), ("49983-a.b.aenv.local", None), ("", None)])
def test_parse_host(host: str, expected: tuple[str, int] | None) -> None:
    assert parse_host(host, "aenv.local") == expected
    assert parse_host(host, "") is None


@given(ids, st.integers(0, 65535), domains, st.sampled_from(["", ":443", ":8000"]), st.booleans())
def test_host_round_trip(sid: str, port: int, domain: str, host_port: str, upper: bool) -> None:
    """What E2B's SDK builds (``get_host``: ``<port>-<id>.<domain>``) parses back."""
    host = f"{port}-{sid}.{domain.upper() if upper else domain}{host_port}"
    assert parse_host(host, domain) == SandboxAddress(sid, port)
    assert parse_host(host, "x" + domain) is None or domain.endswith("x" + domain)


@given(st.text(max_size=60), domains)
def test_any_host_parses_or_is_none(host: str, domain: str) -> None:
    got = parse_host(host, domain)
    assert got is None or (got.sandbox_id and "." not in got.sandbox_id and got.port >= 0)


def route(path: str = "/x", host: str = "", **headers: str) -> SandboxAddress | None:
    return sandbox_route(CIMultiDict(headers), host, path, "aenv.test", 49983)


def test_routing_headers() -> None:
    assert route(**{"x-agentenv-sandbox-id": "sbx-1", "x-agentenv-target-port": "8080"}) == ("sbx-1", 8080)
    assert route(**{"x-agentenv-sandbox-id": "sbx-1"}) == ("sbx-1", 49983)
    assert route(**{"E2b-Sandbox-Id": "e", "x-agentenv-sandbox-id": "a"}) == ("e", 49983)   # E2B's first
    assert route(**{"e2b-sandbox-id": " s ", "e2b-sandbox-port": "3000"}) == ("s", 3000)
    assert route(host="8000-sbx-9.aenv.test") == ("sbx-9", 8000)
    assert route() is None and route("/files") is None
    for path, headers, words in (("/x", {"e2b-sandbox-id": "s", "e2b-sandbox-port": "0"}, "must be a port"),
                                 ("/x", {"e2b-sandbox-id": "s", "e2b-sandbox-port": "x1"}, "must be a port"),
                                 ("/x", {"e2b-sandbox-id": " "}, "routing header is empty"),
                                 ("/proxy/x", {}, "missing sandbox routing header")):
        with pytest.raises(BadRoute, match=words):
            route(path, **headers)
    assert has_routing_header(CIMultiDict({"x-agentenv-sandbox-id": "a"}))
    assert not has_routing_header(CIMultiDict({"x-api-key": "k"}))


@given(st.dictionaries(st.sampled_from(["e2b-sandbox-id", "e2b-sandbox-port", "x-agentenv-sandbox-id",
                                        "x-agentenv-target-port", "other"]), st.text(max_size=12)),
       st.text(max_size=30), st.text(max_size=30))
def test_any_request_routes_or_is_a_bad_route(headers: dict[str, str], host: str, path: str) -> None:
    try:
        got = route(path, host, **headers)
    except BadRoute as e:
        assert str(e)
        return
    assert got is None or (got.sandbox_id and 0 <= got.port < 65536)


def test_signed_urls_and_the_proxy_prefix() -> None:
    assert is_unrouted_signed_url("/files", {"signature": "v1_x", "path": "/a"})
    assert not is_unrouted_signed_url("/files", {"path": "/a"})
    assert not is_unrouted_signed_url("/filesx", {"signature": "v1_x"})
    assert has_proxy_prefix("/proxy") and has_proxy_prefix("/proxy/a") and not has_proxy_prefix("/proxyx")


@pytest.mark.parametrize("method, path, headers, expected", [
    ("POST", "/sandboxes/sbx-1/connect", {"X-API-Key": "k", "E2b-Sandbox-Id": "sbx-1"}, True),
    ("POST", "/sandboxes/sbx-1/connect", {"E2b-Sandbox-Id": "sbx-1"}, False),            # no API key: traffic
    ("POST", "/sandboxes/sbx-2/connect", {"X-API-Key": "k", "E2b-Sandbox-Id": "sbx-1"}, False),  # another sandbox
    ("GET", "/sandboxes/sbx-1/connect", {"X-API-Key": "k", "E2b-Sandbox-Id": "sbx-1"}, False),
    ("POST", "/process.Process/Start", {"X-API-Key": "k", "E2b-Sandbox-Id": "sbx-1"}, False),
    ("POST", "/sandboxes/sbx-1/connect", {"X-API-Key": "k"}, False)])
def test_an_old_sdks_connect_with_routing_headers_is_the_control_planes(method: str, path: str,
                                                                       headers: dict[str, str], expected: bool) -> None:
    """E2B SDKs 2.7 to 2.2x send their connect with the sandbox's routing headers."""
    assert is_sdk_connect(method, path, CIMultiDict(headers)) is expected


@pytest.mark.parametrize("path, headers, expected", [
    ("/process.Process/Start", {"X-Access-Token": "t"}, True),
    ("/filesystem.Filesystem/ListDir", {"x-access-token": "t"}, True),
    ("/files", {"X-Access-Token": "t"}, True),
    ("/process.Process/Start", {}, False),
    ("/process.Process/Start", {"X-Access-Token": ""}, False),
    ("/sandboxes", {"X-Access-Token": "t"}, False),
    ("/health", {"X-Access-Token": "t"}, False)])
def test_an_envd_call_naming_no_sandbox_is_recognised_by_its_token(path: str, headers: dict[str, str],
                                                                   expected: bool) -> None:
    assert is_unrouted_envd_call(path, CIMultiDict(headers)) is expected
