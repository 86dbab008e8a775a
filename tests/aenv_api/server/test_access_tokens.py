"""access_tokens.py: the client's and the guest's envd tokens, the proxy's translation of
one into the other, and token rotation (issue 29). Unit tests of the derivations and the
header translation (hypothesis), then the API in-process over the fake service: the stub
guest echoes what the proxy sent it, so what reaches a guest is observable. The same
story with real VMs and the real SDK: test_token_isolation.py."""
from __future__ import annotations

import asyncio
import time
from urllib.parse import urlencode
from typing import Any, Iterator

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from aenv_api.server.access_tokens import (GENERATION_ANNOTATION, AccessTokens, BadGeneration, SandboxKeys,
                                           generation_of, parse_generation, upstream_headers)
from envd import signing

from .inprocess import InProcessServer

SECRET = b"s" * 32


# -- derivations ---------------------------------------------------------------------------------

def test_client_and_guest_tokens_are_distinct_stable_derivations() -> None:
    t = AccessTokens(SECRET)
    assert t.client("sbx-1") == AccessTokens(SECRET).client("sbx-1")        # nodes sharing the secret agree
    assert t.guest("sbx-1") == AccessTokens(SECRET).guest("sbx-1")
    assert t.client("sbx-1") != t.guest("sbx-1")            # the guest never holds the client's token
    assert t.client("sbx-1", 0) != t.client("sbx-1", 1)     # a rotation gives a new one
    assert t.client("sbx-1") != t.client("sbx-2") and t.guest("sbx-1") != t.guest("sbx-2")
    assert AccessTokens(b"t" * 32).client("sbx-1") != t.client("sbx-1")
    # "a/1" + generation 0 and "a" + generation 10 do not collide ("a/1/0" vs "a/10")
    assert t.client("a/1", 0) != t.client("a", 10)
    assert AccessTokens.ephemeral().client("sbx-1") != AccessTokens.ephemeral().client("sbx-1")


@given(st.integers(min_value=0, max_value=10 ** 17))
def test_generation_round_trips(n: int) -> None:
    assert parse_generation(str(n)) == n
    assert generation_of({GENERATION_ANNOTATION: str(n)}) == n


@given(st.text(max_size=24))
def test_generation_parsing_takes_only_what_rotation_writes(raw: str) -> None:
    canonical = raw.isascii() and raw.isdigit() and str(int(raw)) == raw and len(raw) <= 18
    try:
        n = parse_generation(raw)
    except BadGeneration:
        assert not canonical
    else:
        assert canonical and str(n) == raw


def test_no_generation_is_the_first() -> None:
    assert generation_of({}) == 0 and parse_generation(None) == 0


# -- the proxy's header translation ------------------------------------------------------------

HEADER = st.tuples(st.sampled_from(["X-Access-Token", "x-access-token", "X-ACCESS-TOKEN", "Accept", "X-Other",
                                    "Content-Type"]), st.text(max_size=20))
KEYS = SandboxKeys("client-token", "guest-token")


def tokens_in(headers: list[tuple[str, str]]) -> list[str]:
    return [v for k, v in headers if k.lower() == "x-access-token"]


@given(st.lists(HEADER, max_size=8), st.one_of(st.none(), st.sampled_from(["client-token", "guest-token", "x"])),
       st.booleans())
def test_only_the_guest_token_ever_goes_in(headers: list[tuple[str, str]], given_token: str | None,
                                          checked: bool) -> None:
    out = upstream_headers(headers, KEYS, given_token, checked)
    sent = tokens_in(out)
    # whatever the client sent: at most one token goes in, and it is the guest's
    assert sent in ([], ["guest-token"])
    assert bool(sent) == (checked or given_token == "client-token")
    # every other header goes in as it came, in its order
    assert [h for h in out if h[0].lower() != "x-access-token"] == \
        [h for h in headers if h[0].lower() != "x-access-token"]


@given(st.lists(HEADER, max_size=8), st.booleans())
def test_unsecured_sandboxes_get_the_headers_unchanged(headers: list[tuple[str, str]], checked: bool) -> None:
    assert upstream_headers(headers, SandboxKeys(None), None, checked) == headers


@given(st.lists(HEADER, max_size=8), st.booleans())
def test_unknown_tokens_send_none(headers: list[tuple[str, str]], checked: bool) -> None:
    """A sandbox that paused or went while its request passed: no token at all goes in."""
    assert tokens_in(upstream_headers(headers, None, "client-token", checked)) == []


def test_keys_accept_only_the_client_token() -> None:
    assert KEYS.accepts("client-token")
    assert not KEYS.accepts("guest-token") and not KEYS.accepts(None) and not KEYS.accepts("")
    assert not SandboxKeys(None).accepts("anything")
    assert "guest-token" not in repr(KEYS)


# -- in-process: what a guest receives, rotation ------------------------------------------------

async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"headers": dict(request.headers), "query": dict(request.query)})


async def _ws(request: web.Request) -> web.WebSocketResponse:
    """A WebSocket that says which token its handshake carried."""
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    await ws.send_str(request.headers.get("X-Access-Token", "<none>"))
    await ws.close()
    return ws


def _routes(app: web.Application) -> None:
    app.router.add_route("*", "/files", _echo)
    app.router.add_get("/execute", _echo)
    app.router.add_get("/ws", _ws)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("tokens"), guest_routes=_routes)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def api(node: InProcessServer) -> Iterator[InProcessServer]:
    try:
        yield node
    finally:
        node.kill_all()


def create(api: InProcessServer, **body: Any) -> dict[str, Any]:
    status, _, got = api.request("POST", "/v2/sandboxes", {"templateID": "base", **body})
    assert status == 201, got
    return got


def envd(api: InProcessServer, sid: str, path: str, token: str | None = None, port: int | None = None,
         method: str = "GET") -> tuple[int, Any]:
    headers = {"E2b-Sandbox-Id": sid, **({"X-Access-Token": token} if token is not None else {}),
               **({"E2b-Sandbox-Port": str(port)} if port is not None else {})}
    status, _, body = api.request(method, path, headers=headers, key=None)
    return status, body


def signed_url(path: str, token: str, expiration: int | None = None, user: str = "user") -> str:
    query = {"path": path, "username": user, "signature": signing.sign(path, signing.READ, user, token, expiration)}
    if expiration is not None:
        query["signature_expiration"] = str(expiration)
    return "/files?" + urlencode(query)


def test_the_guest_gets_its_own_token_never_the_clients(api: InProcessServer) -> None:
    sbx = create(api)
    sid, client = sbx["sandboxID"], sbx["envdAccessToken"]
    guest = api.guest_token(sid)
    assert client == api.envd_token(sid) != guest
    status, got = envd(api, sid, "/echo", client)
    assert status == 200 and got["X-Access-Token"] == guest         # translated
    # a signed URL: checked against the client's token, the guest's goes in as the header
    status, got = envd(api, sid, signed_url("/home/user/a", client, int(time.time()) + 60))
    assert status == 200 and got["headers"]["X-Access-Token"] == guest
    # the guest's token, as a clone of this sandbox would find it, opens nothing
    assert envd(api, sid, "/echo", guest)[0] == 401
    assert envd(api, sid, signed_url("/home/user/a", guest))[0] == 401
    assert envd(api, sid, signed_url("/home/user/a", guest), guest)[0] == 401
    # another port (the code interpreter asks envd with the token it is given): the client's
    # token goes in as the guest's, anything else goes in as nothing
    assert envd(api, sid, "/execute", client, port=49999)[1]["headers"]["X-Access-Token"] == guest
    status, got = envd(api, sid, "/execute", guest, port=49999)
    assert status == 200 and "X-Access-Token" not in got["headers"]
    # an envd call that names no sandbox finds it by the client's token only
    status, _, got = api.request("GET", "/files?path=/a", headers={"X-Access-Token": client}, key=None)
    assert status == 200 and got["headers"]["X-Access-Token"] == guest, got
    assert api.request("GET", "/files?path=/a", headers={"X-Access-Token": guest}, key=None)[0] == 401
    # and a signed URL naming no sandbox, by the client token's signature only
    status, _, got = api.request("GET", signed_url("/a", client), key=None)
    assert status == 200 and got["headers"]["X-Access-Token"] == guest, got
    assert api.request("GET", signed_url("/a", guest), key=None)[0] == 401


def test_websocket_handshakes_are_translated_too(api: InProcessServer) -> None:
    sbx = create(api)
    sid, client = sbx["sandboxID"], sbx["envdAccessToken"]

    async def seen(token: str, port: int) -> str | int:
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port), "X-Access-Token": token}
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(f"{api.url}/ws", headers=headers) as ws:
                    return (await ws.receive()).data
            except aiohttp.WSServerHandshakeError as e:
                return e.status
    assert asyncio.run(seen(client, 49983)) == api.guest_token(sid)
    assert asyncio.run(seen(api.guest_token(sid), 49983)) == 401
    assert asyncio.run(seen(client, 8080)) == api.guest_token(sid)
    assert asyncio.run(seen(api.guest_token(sid), 8080)) == "<none>"


def test_fork_children_have_tokens_of_their_own(api: InProcessServer) -> None:
    parent = create(api)
    status, _, kids = api.request("POST", f"/sandboxes/{parent['sandboxID']}/fork", {"count": 2})
    assert status == 201, kids
    for kid in (k["sandbox"] for k in kids):
        cid = kid["sandboxID"]
        assert kid["envdAccessToken"] == api.envd_token(cid) not in (parent["envdAccessToken"],
                                                                    api.guest_token(parent["sandboxID"]))
        assert envd(api, cid, "/echo", kid["envdAccessToken"])[1]["X-Access-Token"] == api.guest_token(cid)
        # neither the parent's client token nor its guest token reaches the child, nor the reverse
        for token in (parent["envdAccessToken"], api.guest_token(parent["sandboxID"])):
            assert envd(api, cid, "/echo", token)[0] == 401
        assert envd(api, parent["sandboxID"], "/echo", api.guest_token(cid))[0] == 401


def test_rotation_makes_the_old_token_fail_at_once(api: InProcessServer) -> None:
    sbx = create(api, autoPause=True)
    sid, old = sbx["sandboxID"], sbx["envdAccessToken"]
    assert envd(api, sid, "/echo", old)[0] == 200          # known to the proxy's hot path
    status, _, got = api.request("POST", f"/sandboxes/{sid}/rotate-token")
    assert status == 200, got
    new = got["envdAccessToken"]
    assert got["sandboxID"] == sid and new == api.envd_token(sid, 1) != old
    for path in ("/echo", signed_url("/a", old), signed_url("/a", old, int(time.time()) + 60)):
        assert envd(api, sid, path, old if path == "/echo" else None)[0] == 401, path
    assert envd(api, sid, "/execute", old, port=49999)[1]["headers"].get("X-Access-Token") is None
    assert envd(api, sid, "/echo", new)[1]["X-Access-Token"] == api.guest_token(sid)     # G is not re-keyed
    assert envd(api, sid, signed_url("/a", new))[0] == 200
    status, _, info = api.request("GET", f"/sandboxes/{sid}")
    assert info["envdAccessToken"] == new
    # a pause keeps the generation; a paused sandbox is not rotated (its record is its pause's)
    assert api.request("POST", f"/sandboxes/{sid}/pause")[0] == 204
    status, _, err = api.request("POST", f"/sandboxes/{sid}/rotate-token")
    assert status == 409 and "paused" in err["message"], err
    status, _, back = api.request("POST", f"/sandboxes/{sid}/connect", {"timeout": 60})
    assert status == 201 and back["envdAccessToken"] == new
    assert envd(api, sid, "/echo", old)[0] == 401 and envd(api, sid, "/echo", new)[0] == 200
    # again: generation 2
    status, _, got = api.request("POST", f"/sandboxes/{sid}/rotate-token")
    assert status == 200 and got["envdAccessToken"] == api.envd_token(sid, 2)
    assert envd(api, sid, "/echo", new)[0] == 401


def test_rotation_refusals(api: InProcessServer) -> None:
    status, _, err = api.request("POST", "/sandboxes/sbx-nope/rotate-token")
    assert status == 404, err
    status, _, plain = api.request("POST", "/sandboxes", {"templateID": "base"})    # v1, not secured
    assert status == 201 and "envdAccessToken" not in plain
    status, _, err = api.request("POST", f"/sandboxes/{plain['sandboxID']}/rotate-token")
    assert status == 409 and "not secured" in err["message"], err
    assert api.request("POST", f"/sandboxes/{plain['sandboxID']}/rotate-token", key=None)[0] == 401


def test_an_unreadable_generation_fails_closed(api: InProcessServer) -> None:
    sbx = create(api)
    sid = sbx["sandboxID"]

    async def spoil() -> None:
        await api.fake.annotate(sid, {GENERATION_ANNOTATION: "not-a-number"})
        api.lifecycle.forget_tokens(sid)
    api.call(spoil())
    assert envd(api, sid, "/echo", sbx["envdAccessToken"])[0] == 401
    assert envd(api, sid, "/echo", api.guest_token(sid))[0] == 401
    assert envd(api, sid, "/echo")[0] == 401
