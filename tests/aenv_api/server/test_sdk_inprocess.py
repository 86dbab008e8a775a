"""The real e2b SDK (sync and async) against the API in-process over a
``FakeSandboxService`` (inprocess.py), configured only by E2B_* env vars: the API's
semantics that need no guest -- listing, filters and pages, get_info, timeouts and
their expiry, the proxy's answer for an unknown sandbox, API keys, refused creates, the
network rules as the API keeps and shows them. They ran against a
real server before; what a node itself keeps (rules across pause, resume and fork,
TTL expiry) is pinned to the fake by tests/aenv_vm/test_service_contract.py."""
from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any, Iterator

import pytest

from .inprocess import InProcessServer


# -- from test_sdk_sync.py ------------------------------------------------------------------

@pytest.fixture
def pair(api_env: InProcessServer) -> Iterator[tuple[Any, Any]]:
    """The two sandboxes test_sdk_sync.py's module shares, made the same way."""
    from e2b import Sandbox

    a = Sandbox.create(metadata={"suite": "api", "who": "a b&c=d/é"}, envs={"AENV_GREETING": "hi there"},
                       timeout=600)
    b = Sandbox.create(metadata={"suite": "api", "who": "b"}, timeout=600)
    yield a, b


def test_list_filters_and_pagination(api_env: InProcessServer, pair) -> None:  # type: ignore[no-untyped-def]
    from e2b import Sandbox, SandboxQuery, SandboxState

    a, b = pair
    found = Sandbox.list(query=SandboxQuery(metadata={"who": "a b&c=d/é"})).next_items()
    assert [s.sandbox_id for s in found] == [a.sandbox_id]
    both = Sandbox.list(query=SandboxQuery(metadata={"suite": "api"})).next_items()
    assert {s.sandbox_id for s in both} == {a.sandbox_id, b.sandbox_id}
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})).next_items() == []
    assert Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED], metadata={"suite": "api"})).next_items() == []
    running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING], metadata={"suite": "api"}))
    assert {s.sandbox_id for s in running.next_items()} == {a.sandbox_id, b.sandbox_id}
    pages = Sandbox.list(query=SandboxQuery(metadata={"suite": "api"}), limit=1)
    ids = []
    while pages.has_next:
        items = pages.next_items()
        assert len(items) == 1
        ids.extend(s.sandbox_id for s in items)
    assert sorted(ids) == sorted([a.sandbox_id, b.sandbox_id])  # two pages, then x-next-token stops
    info = [s for s in both if s.sandbox_id == a.sandbox_id][0]
    assert info.metadata == {"suite": "api", "who": "a b&c=d/é"}
    assert info.state == SandboxState.RUNNING and info.cpu_count >= 1 and info.memory_mb >= 64


def test_get_info_and_set_timeout(api_env: InProcessServer, pair) -> None:  # type: ignore[no-untyped-def]
    a, _ = pair
    info = a.get_info()
    assert info.sandbox_id == a.sandbox_id and info.name == "base" and info.template_id.startswith("tpl-")
    assert info.envd_version and info.metadata["suite"] == "api"
    now = datetime.datetime.now(datetime.timezone.utc)
    assert abs((info.started_at - now).total_seconds()) < 900
    a.set_timeout(1234)
    end = a.get_info().end_at
    assert abs((end - datetime.datetime.now(datetime.timezone.utc)).total_seconds() - 1234) < 30


def test_timeout_expiry_kills(api_env: InProcessServer) -> None:
    from e2b import Sandbox

    s = Sandbox.create(timeout=600)
    s.set_timeout(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and s.sandbox_id in [x.sandbox_id for x in Sandbox.list().next_items()]:
        time.sleep(0.5)
    assert s.sandbox_id not in [x.sandbox_id for x in Sandbox.list().next_items()]
    assert not s.is_running()


def test_unknown_sandbox_is_502_was_not_found(api_env: InProcessServer) -> None:
    from e2b import Sandbox

    status, _, body = api_env.request("GET", "/health", headers={"E2b-Sandbox-Id": "sbx-nope"}, key=None)
    assert status == 502 and body["code"] == 502
    assert body["message"] == "The sandbox was not found" and body["sandboxId"] == "sbx-nope"   # E2B's, word for word
    with pytest.raises(Exception, match="not found"):
        Sandbox.connect("sbx-nope")


def test_wrong_api_key(api_env: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import AuthenticationException, Sandbox

    status, _, body = api_env.request("GET", "/v2/sandboxes", key="e2b_" + "0" * 40)
    assert status == 401 and body["code"] == 401 and body["message"]
    status, _, body = api_env.request("GET", "/v2/sandboxes", key=None)
    assert status == 401
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + "1" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.create()


# -- from test_sdk_parity.py ----------------------------------------------------------------

def test_list_started_after_finds_the_sandbox_itself(api_env: InProcessServer) -> None:
    from e2b import Sandbox, SandboxQuery

    sbx = Sandbox.create(metadata={"suite": "parity"}, timeout=600)
    started = sbx.get_info().started_at
    found = Sandbox.list(query=SandboxQuery(metadata={"suite": "parity"}, started_after=started)).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in found]
    later = Sandbox.list(query=SandboxQuery(metadata={"suite": "parity"},
                                            started_after=started + datetime.timedelta(microseconds=1))).next_items()
    assert sbx.sandbox_id not in [s.sandbox_id for s in later]


UNSUPPORTED = [
    ({"mcp": {"github": {"githubPersonalAccessToken": "x"}}}, "mcp is not supported by aenv"),
    ({"iam": {"tokens": {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}}},
     "iam is not supported by aenv"),
    # a secret marker on a node without the secrets key (secret_refs.py)
    ({"envVars": {"KEY": "${e2b.secrets.openai}"}}, "this node keeps no secrets"),
]


@pytest.mark.parametrize("extra,message", UNSUPPORTED)
def test_unsupported_create_options_are_400(api_env: InProcessServer, extra: dict, message: str) -> None:
    before = {s["sandboxID"] for s in api_env.request("GET", "/v2/sandboxes")[2]}
    for path in ("/sandboxes", "/v2/sandboxes"):
        status, _, body = api_env.request("POST", path, {"templateID": "base", **extra})
        assert status == 400 and message in body["message"], body
    assert {s["sandboxID"] for s in api_env.request("GET", "/v2/sandboxes")[2]} == before


def test_none_of_the_unsupported_options_is_accepted(api_env: InProcessServer) -> None:
    """"None" as the SDKs send it (null mcp, empty iam, no mounts, plain env values) passes
    validation: the create gets as far as the template lookup."""
    status, _, body = api_env.request("POST", "/v2/sandboxes", {
        "templateID": "no-such-template", "mcp": None, "iam": {"tokens": {}}, "volumeMounts": [],
        "envVars": {"A": "${HOME}"}})
    assert status == 404 and "no-such-template" in body["message"], body


def test_unsupported_options_through_the_sdk(api_env: InProcessServer) -> None:
    from e2b import Sandbox

    with pytest.raises(Exception) as exc:
        Sandbox.create(mcp={"github": {"githubPersonalAccessToken": "x"}})
    assert "not supported by aenv" in str(exc.value)
    with pytest.raises(Exception) as exc:      # volumes are supported: an unknown one is a 404
        Sandbox.create(volume_mounts={"/data": "my-volume"})
    assert "'my-volume' not found" in str(exc.value)


def test_create_answers_the_agentenv_sandbox_header(api_env: InProcessServer) -> None:
    status, headers, body = api_env.request("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 60})
    try:
        lower = {k.lower(): v for k, v in headers.items()}
        assert status == 201 and lower["x-agentenv-sandbox-id"] == body["sandboxID"]
    finally:
        api_env.request("DELETE", f"/sandboxes/{body['sandboxID']}")


# -- from test_sdk_network.py: the rules as the API keeps and shows them ------------------------

RULES = {"allow_out": ["Example.COM", "198.51.100.7/32", "*.pypi.org"], "deny_out": ["203.0.113.0/24"],
         "dns_servers": ["192.0.2.53"]}
RULES_SHOWN = {"allow_out": ["198.51.100.7", "example.com", "*.pypi.org"], "deny_out": ["203.0.113.0/24"],
               "dns_servers": ["192.0.2.53"], "allow_public_traffic": True}


def _shown(info: Any) -> dict[str, Any]:
    return dict(info.network or {})


@pytest.fixture
def ruled(api_env: InProcessServer) -> Iterator[Any]:
    from e2b import Sandbox

    yield Sandbox.create(network=RULES, metadata={"suite": "network"}, timeout=600)


def test_create_rules_show_in_get_info(api_env: InProcessServer, ruled: Any) -> None:
    from e2b import Sandbox

    info = ruled.get_info()
    assert _shown(info) == RULES_SHOWN            # CIDRs normalised (/32 shown bare), hostnames lower-case
    assert info.allow_internet_access is None      # the internet is not denied as a whole
    status, _, detail = api_env.request("GET", f"/sandboxes/{ruled.sandbox_id}")
    assert status == 200 and detail["network"] == {
        "allowOut": ["198.51.100.7", "example.com", "*.pypi.org"], "denyOut": ["203.0.113.0/24"],
        "dnsServers": ["192.0.2.53"], "allowPublicTraffic": True}
    assert "trafficAccessToken" not in detail     # a token is given at create and connect only
    status, _, listed = api_env.request("GET", "/v2/sandboxes?metadata=suite%3Dnetwork")
    assert status == 200 and [x["sandboxID"] for x in listed] == [ruled.sandbox_id]
    assert "network" not in listed[0]             # E2B's ListedSandbox has no network
    assert Sandbox.get_info(ruled.sandbox_id).network == info.network


def test_update_network_replaces_the_rules(api_env: InProcessServer, ruled: Any) -> None:
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

    status, _, body = api_env.request("PUT", f"/sandboxes/{ruled.sandbox_id}/network",
                                      body={"allowOut": ["8.8.8.8"], "dnsServers": []})
    assert status == 204 and body == b""
    assert _shown(ruled.get_info()) == {"allow_out": ["8.8.8.8"], "deny_out": [], "dns_servers": [],
                                        "allow_public_traffic": True}
    status, _, body = api_env.request("PUT", "/sandboxes/sbx-nope/network", body={})
    assert status == 404 and body["code"] == 404
    with pytest.raises(SandboxNotFoundException):
        Sandbox.update_network("sbx-nope", {"allow_out": ["1.1.1.1"]})


def test_rules_survive_pause_connect_and_fork(api_env: InProcessServer, ruled: Any) -> None:
    from e2b import Sandbox, SandboxException, SandboxState

    rules = {"allow_out": ["example.org", "198.51.100.0/24"], "deny_out": ["0.0.0.0/0"], "dns_servers": ["9.9.9.9"]}
    ruled.update_network(rules)
    shown = _shown(ruled.get_info())
    ruled.pause()
    paused = Sandbox.get_info(ruled.sandbox_id)
    assert paused.state == SandboxState.PAUSED and _shown(paused) == shown
    status, _, body = api_env.request("PUT", f"/sandboxes/{ruled.sandbox_id}/network", body={})
    assert status == 409 and body["code"] == 409 and "paused" in body["message"]   # running sandboxes only
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


def test_malformed_rules_are_400_naming_the_field(api_env: InProcessServer, ruled: Any) -> None:
    from e2b import Sandbox, SandboxException

    for network, words in [({"allow_out": ["not a host!"]}, "network.allowOut"),
                           ({"deny_out": ["example.com"]}, "network.denyOut"),
                           ({"dns_servers": ["dns.google"]}, "network.dnsServers"),
                           ({"https_ports": [49983]}, "network.httpsPorts"),
                           ({"mask_request_host": "bad host"}, "network.maskRequestHost"),
                           ({"egress_proxy": {"address": "proxy.example.com:1080"}},
                            "network.egressProxy: a SOCKS5 egress proxy is not supported by this server"),
                           ({"rules": {"api.example.com": [{"transform": {"headers": {"X-K": "v"}}}]}},
                            "network.rules: this node applies per-domain transforms only with its secrets")]:
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
        status, headers, got = api_env.request(method, path, body=body)
        assert status == 400 and got["code"] == 400 and words in got["message"], (path, body, got)
        assert headers["Content-Type"].startswith("application/json")
    assert _shown(ruled.get_info())["allow_out"] != ["not a host!"]   # nothing of a refused update was kept


def test_a_public_sandbox_has_no_traffic_token(api_env: InProcessServer, ruled: Any) -> None:
    assert ruled.traffic_access_token is None
    status, _, body = api_env.request("POST", f"/v2/sandboxes/{ruled.sandbox_id}/connect", body={"timeout": 600})
    assert status in (200, 201) and "trafficAccessToken" not in body


def test_openapi_has_the_network_route(api_env: InProcessServer) -> None:
    status, _, doc = api_env.request("GET", "/openapi.json", key=None)
    assert status == 200 and "put" in doc["paths"]["/sandboxes/{sandboxID}/network"]


# -- from test_sdk_pause_modes.py ----------------------------------------------------------

def test_lifecycle_option_refusals(api_env: InProcessServer) -> None:
    """E2B's refusals of the filesystem-only on_timeout lifecycle option."""
    status, _, body = api_env.request("POST", "/v2/sandboxes", {"templateID": "base", "autoPause": False,
                                                                "autoPauseMemory": False})
    assert status == 400 and "autoPauseMemory" in body["message"]
    status, _, body = api_env.request("POST", "/v2/sandboxes", {"templateID": "base", "autoPause": True,
                                                                "autoPauseMemory": False,
                                                                "autoResume": {"enabled": True}})
    assert status == 400 and "autoResume" in body["message"]


# -- the async SDK and a plain aiohttp client ------------------------------------------------

def test_async_flow_api_side(api_env: InProcessServer) -> None:
    """test_sdk_async.py's flow as far as the API answers it (that module keeps the guest's
    side: commands, files, concurrent streams), plus concurrent creates over one aiohttp
    session."""
    import aiohttp
    from e2b import AsyncSandbox, SandboxQuery, SandboxState

    async def flow() -> None:
        a, b = await asyncio.gather(AsyncSandbox.create(metadata={"suite": "async", "n": "1"}),
                                    AsyncSandbox.create(metadata={"suite": "async", "n": "2"}))
        paginator = AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "async"}), limit=1)
        ids = []
        while paginator.has_next:
            ids += [s.sandbox_id for s in await paginator.next_items()]
        assert sorted(ids) == sorted([a.sandbox_id, b.sandbox_id])
        only = await AsyncSandbox.list(query=SandboxQuery(metadata={"n": "2"})).next_items()
        assert [s.sandbox_id for s in only] == [b.sandbox_id]
        info = await a.get_info()
        assert info.state == SandboxState.RUNNING and info.metadata == {"suite": "async", "n": "1"}
        await a.set_timeout(77)
        assert abs((await a.get_info()).end_at.timestamp() - time.time() - 77) < 30
        assert await a.pause() is True and await a.pause() is False
        assert (await AsyncSandbox.get_info(a.sandbox_id)).state == SandboxState.PAUSED
        resumed = await AsyncSandbox.connect(a.sandbox_id)
        assert (await resumed.get_info()).state == SandboxState.RUNNING and await resumed.is_running()
        await a.kill()
        await b.kill()
        assert await AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "async"})).next_items() == []
        assert not await a.is_running()

        async with aiohttp.ClientSession(headers={"X-API-Key": api_env.api_key}) as http:
            async def make() -> tuple[int, dict[str, Any]]:
                async with http.post(api_env.url + "/v2/sandboxes", json={"templateID": "base"}) as r:
                    return r.status, await r.json()
            made = await asyncio.gather(*(make() for _ in range(8)))
            assert [status for status, _ in made] == [201] * 8
            assert len({body["sandboxID"] for _, body in made}) == 8
            async with http.get(api_env.url + "/v2/sandboxes?state=running") as r:
                assert r.status == 200 and r.headers["X-Total-Running"] == "8"
    asyncio.run(flow())
