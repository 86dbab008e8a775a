"""Pure parts of the API server: schemas, pagination, routing of sandbox traffic,
credentials, metrics text, the generated OpenAPI document (the wire vocabulary they
use has its own tests, tests/aenv_wire)."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, strategies as st
from multidict import MultiDict

from aenv_api.server.auth import Credentials, check_token
from aenv_api.server.errors import ApiError
from aenv_api.server.lifecycle import api_error
from aenv_api.server.metrics import Metrics
from aenv_api.server.schemas import LIST_V2, NewSandbox, new_sandbox_schema
from aenv_api.server.views import page
from aenv_vm.errors import (AlreadyHeld, BadRequest, CapacityError, Conflict, Moved, NotCommitted, NotFound,
                            NotMovable, NotPaused, ResumedElsewhere, SnapshotError, Unsupported, VmError)
from aenv_wire.cluster import ClusterCode

NEW = new_sandbox_schema(86400)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=12)


@given(st.dictionaries(st.sampled_from([f.name for f in NEW.fields] + ["other"]), json_values, max_size=8)
       | json_values)
def test_new_sandbox_parse_accepts_or_says_why(raw: Any) -> None:
    try:
        values = NEW.parse_body(raw)
    except ApiError as e:
        assert e.status == 400 and e.message
        return
    req = NewSandbox(**values)
    assert isinstance(req.template_id, str) and len(req.template_id) <= 256
    assert req.timeout is None or (isinstance(req.timeout, int) and 0 <= req.timeout <= 86400)
    assert req.metadata is None or all(isinstance(v, str) for v in req.metadata.values())
    assert req.auto_resume in (None, True, False)


def test_new_sandbox_examples() -> None:
    ok = NEW.parse_body({"templateID": "base", "timeout": 60.0, "autoResume": {"enabled": True},
                         "metadata": {"k": "v"}, "futureField": [1]})  # unknown fields are ignored
    assert ok["timeout"] == 60 and ok["auto_resume"] is True and ok["metadata"] == {"k": "v"}
    for bad, word in [({}, "templateID"), ({"templateID": 1}, "templateID"),
                      ({"templateID": "b", "timeout": True}, "timeout"),
                      ({"templateID": "b", "timeout": 86401}, "timeout"),
                      ({"templateID": "b", "envVars": {"A": "\x00"}}, "NUL")]:
        with pytest.raises(ApiError, match=word):
            NEW.parse_body(bad)


@given(st.dictionaries(st.sampled_from(["state", "limit", "nextToken", "order", "startedAfter", "x"]),
                       st.lists(st.text(max_size=20), min_size=1, max_size=3)))
def test_query_parse_never_crashes(raw: dict[str, list[str]]) -> None:
    q: MultiDict[str] = MultiDict()
    for k, vs in raw.items():
        for v in vs:
            q.add(k, v)
    try:
        LIST_V2.parse_query(q)
    except ApiError as e:
        assert e.status == 400


@given(st.text(max_size=60))
def test_bad_page_tokens_are_400(token: str) -> None:
    items = [(1.0, "s1"), (2.0, "s2")]
    try:
        page(items, lambda x: x, True, 1, token)
    except ApiError as e:
        assert e.status == 400 and e.message == "nextToken is not a token this server issued"


def test_keyset_pagination_walks_everything_once() -> None:
    items = [(float(i % 3), f"s{i}") for i in range(10)]
    seen: list[tuple[float, str]] = []
    token = None
    while True:
        out, token = page(items, lambda x: x, True, 3, token)
        seen += out
        if token is None:
            break
    assert sorted(seen) == sorted(items) and len(seen) == len(set(seen))
    assert seen == sorted(items, reverse=True)


def test_api_key_generated_once_with_mode_0600(tmp_path: Path) -> None:
    a = Credentials.load(tmp_path, environ={})
    assert a.api_key.startswith("e2b_") and len(a.api_key) == 44 and a.api_key_source == "generated"
    assert stat.S_IMODE(os.stat(tmp_path / "api-key").st_mode) == 0o600
    b = Credentials.load(tmp_path, environ={})
    assert b.api_key == a.api_key and b.api_key_source == "file"
    c = Credentials.load(tmp_path, environ={"AENV_API_KEY": "e2b_custom"})
    assert c.api_key == "e2b_custom" and c.check_api_key("e2b_custom") and not c.check_api_key("e2b_other")
    assert not c.check_api_key(None)
    assert check_token("t", "t") and not check_token("t", "u") and not check_token("t", None)


def test_envd_secret_generated_once_and_tokens_are_its_hmac(tmp_path: Path) -> None:
    import base64
    import hashlib
    import hmac

    from aenv_store.errors import ConfigError

    a = Credentials.load(tmp_path, environ={})
    secret = (tmp_path / "envd-secret").read_text().strip()
    assert len(secret) == 64 and stat.S_IMODE(os.stat(tmp_path / "envd-secret").st_mode) == 0o600

    def spec(secret: bytes, label: bytes, message: bytes) -> str:    # access_tokens.py, independently
        key = hmac.new(secret, label, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(hmac.new(key, message, hashlib.sha256).digest()).rstrip(b"=").decode()

    client, guest = b"aenv envd client token v1", b"aenv envd guest token v1"
    t = a.access_tokens
    assert t.client("sbx-0123456789abcdef") == spec(secret.encode(), client, b"sbx-0123456789abcdef/0")
    assert t.client("sbx-0123456789abcdef", 3) == spec(secret.encode(), client, b"sbx-0123456789abcdef/3")
    assert t.guest("sbx-0123456789abcdef") == spec(secret.encode(), guest, b"sbx-0123456789abcdef")
    assert Credentials.load(tmp_path, environ={}).access_tokens.client("sbx-1") == t.client("sbx-1")  # stable
    assert t.client("sbx-1") != t.client("sbx-2") and t.client("sbx-1") != t.client("sbx-1", 1)
    assert t.client("sbx-1") != t.guest("sbx-1")    # the client's token is never the guest's
    other = Credentials.load(tmp_path, environ={}, envd_secret_file=tmp_path / "sub" / "secret")
    assert other.access_tokens.client("sbx-1") != t.client("sbx-1")
    env = Credentials.load(tmp_path, environ={"AENV_ENVD_SECRET": "s" * 32})
    assert env.access_tokens.client("x") == spec(b"s" * 32, client, b"x/0")
    with pytest.raises(ConfigError, match="at least 16"):
        Credentials.load(tmp_path, environ={"AENV_ENVD_SECRET": "short"})
    assert secret not in repr(a) and a.api_key not in repr(a)


def test_metrics_text_format() -> None:
    m = Metrics()
    m.inc("aenv_x_total", (("route", 'a"b'),), help="x")
    m.observe("aenv_lat_seconds", 0.03, (("op", "create"),))
    m.observe("aenv_lat_seconds", 100.0, (("op", "create"),))
    m.gauge("aenv_g", lambda: [((("state", "running"),), 2.0)], "g")
    m.gauge("aenv_broken", lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    text = m.render()
    assert '# TYPE aenv_x_total counter\naenv_x_total{route="a\\"b"} 1' in text
    assert 'aenv_lat_seconds_bucket{op="create",le="0.05"} 1' in text
    assert 'aenv_lat_seconds_bucket{op="create",le="+Inf"} 2' in text
    assert 'aenv_lat_seconds_count{op="create"} 2' in text
    assert 'aenv_g{state="running"} 2' in text and "aenv_broken unavailable" in text


@given(st.lists(st.binary(min_size=1, max_size=300), max_size=6), st.data(),
       st.sampled_from([b"", b"X-Trailer: 1\r\n"]), st.sampled_from([b"", b";ext=1"]), st.binary(max_size=20))
def test_chunked_body_follows_framing_however_cut(chunks: list[bytes], data: Any, trailer: bytes, ext: bytes,
                                                  after: bytes) -> None:
    """The pass-through relay's framing tracker: the payload it reports is the body, the
    bytes it claims end exactly at the end of the trailer section, whatever the cuts."""
    from aenv_api.server.upstream import ChunkedBody

    body = b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c in chunks) + b"0\r\n" + trailer + b"\r\n"
    wire = body + after
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    tracker, pos, used_total, payload = ChunkedBody(), 0, 0, b""
    for cut in cuts + [len(wire)]:
        piece = wire[pos:cut]
        used, out = tracker.feed(piece)
        assert 0 <= used <= len(piece) and (used == len(piece) or tracker.done)
        used_total += used
        payload += out
        pos = cut
        if tracker.done:
            break
    assert tracker.done and used_total == len(body) and payload == b"".join(chunks)


@given(st.binary(max_size=200))
def test_chunked_body_rejects_or_waits_never_crashes(junk: bytes) -> None:
    from aenv_api.server.upstream import ChunkedBody

    try:
        used, _ = ChunkedBody().feed(junk)
        assert 0 <= used <= len(junk)
    except ValueError:
        pass


def test_response_heads() -> None:
    from aenv_api.server.upstream import parse_response_head

    h = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Type: x\r\nTransfer-Encoding: chunked", "POST")
    assert (h.status, h.framing, h.keep_alive, h.get("content-type")) == (200, "chunked", True, "x")
    h = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close", "GET")
    assert (h.framing, h.length, h.keep_alive) == ("length", 5, False)
    assert parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5", "HEAD").framing == "none"
    assert parse_response_head(b"HTTP/1.1 204 No Content", "GET").framing == "none"
    assert parse_response_head(b"HTTP/1.0 200 OK", "GET").framing == "close"
    assert not parse_response_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1", "GET").keep_alive
    for bad in (b"HTTP/2 200 OK", b"HTTP/1.1 2000 OK", b"garbage", b"HTTP/1.1 200 OK\r\nNo colon",
                b"HTTP/1.1 200 OK\r\nContent-Length: -1", b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
                b"HTTP/1.1 200 OK\r\nBad Name: 1"):
        with pytest.raises(ValueError):
            parse_response_head(bad, "GET")


@given(st.binary(max_size=300))
def test_response_head_parse_never_crashes(junk: bytes) -> None:
    from aenv_api.server.upstream import parse_response_head

    try:
        h = parse_response_head(junk, "GET")
        assert h.framing in ("length", "chunked", "close", "none") and 100 <= h.status <= 999
    except ValueError:
        pass


# -- sandbox-layer errors map to HTTP status by class, never by message ----------------

@pytest.mark.parametrize("cls,status", [(NotFound, 404), (Conflict, 409), (BadRequest, 400), (Unsupported, 501),
                                        (CapacityError, 429), (SnapshotError, 500), (VmError, 500)])
def test_vm_errors_map_to_status_by_class(cls: type, status: int) -> None:
    for text in ("unknown sandbox 'x'", "is not running", "already exists", "anything"):
        e = api_error(cls(text), "op")
        assert e.status == status and e.body()["code"] == status and text in e.message
        assert e.retry is (False if status in (429, 501) else None)   # the SDK must not retry those


@pytest.mark.parametrize("cls,status,code", [
    (CapacityError, 429, ClusterCode.FULL), (NotCommitted, 404, ClusterCode.NOT_COMMITTED),
    (AlreadyHeld, 409, ClusterCode.ALREADY_HELD), (ResumedElsewhere, 409, ClusterCode.RESUMED_ELSEWHERE),
    (NotMovable, 409, ClusterCode.NOT_MOVABLE), (NotPaused, 409, ClusterCode.NOT_PAUSED),
    (Moved, 409, ClusterCode.MOVED), (NotFound, 404, None), (Conflict, 409, None), (SnapshotError, 500, None)])
def test_errors_the_gateway_acts_on_carry_their_code(cls: type, status: int, code: ClusterCode | None) -> None:
    """The fleet's contract (aenv_wire/cluster.py): the code comes from the class, whatever the message."""
    e = api_error(cls("anything"), "op")
    assert e.status == status and e.body().get("error_code") == (code.value if code else None)


def test_console_is_read_in_complete_lines_across_calls(tmp_path: Path) -> None:
    from aenv_api.server.sandbox_logs import MAX_CONSOLE_BYTES, SandboxLogs
    from aenv_vm.sandboxes.node_service import read_console

    console = tmp_path / "serial.log"
    logs = SandboxLogs(tmp_path / "logs")

    def capture() -> None:
        source, offset = logs.console_position("sbx-1")
        read = read_console(console, "qemu-1", offset if source == "qemu-1" else 0, MAX_CONSOLE_BYTES)
        logs.add_console("sbx-1", read.source, read.start, read.data, read.skipped)

    def lines() -> list[str]:
        return [e.message for e in logs.query("sbx-1") if e.fields.get("source") == "console"]

    console.write_bytes(b"one\ntwo\npart")
    capture()
    assert lines() == ["one", "two"]                     # the partial line waits for its newline
    with open(console, "ab") as f:
        f.write(b"ial\nthree\n")
    capture()
    capture()                                            # nothing new: nothing added
    assert lines() == ["one", "two", "partial", "three"]
    console.write_bytes(b"x" * (MAX_CONSOLE_BYTES + 100) + b"\nlast\n")   # a flood (and a new file)
    capture()
    warned = [e.message for e in logs.query("sbx-1") if e.level == "warn"]
    assert lines()[-1] == "last" and warned and "skipped" in warned[0]


@given(st.floats(min_value=1.5e9, max_value=4.0e9, allow_nan=False))
def test_started_after_its_own_start_time_finds_the_sandbox(started: float) -> None:
    """The SDK's round trip of ``Sandbox.list(query={"started_after": info.started_at})``:
    ``startedAt`` as the API writes it, parsed by the SDK (dateutil), sent back with
    ``isoformat()``, parsed by the list query. The sandbox must be found, and must not
    be once one microsecond later is asked. Comparing the unrounded float missed it
    whenever ``iso`` rounded the microseconds up (about every other sandbox)."""
    import datetime

    from dateutil.parser import isoparse

    from aenv_wire.listing import iso, started_at_or_after

    shown = isoparse(iso(started))
    for sent, found in ((shown, True), (shown + datetime.timedelta(microseconds=1), False)):
        after = LIST_V2.parse_query(MultiDict([("startedAfter", sent.isoformat())]))["started_after"]
        assert started_at_or_after(started, after) is found, (started, iso(started), sent.isoformat())


def test_idempotent_creates_once_per_key_and_window() -> None:
    import asyncio

    from aenv_api.server.idempotency import IdempotentCreates, parse_key

    now = [0.0]
    made: list[str] = []

    async def scenario() -> None:
        creates = IdempotentCreates(window=60, max_keys=2, clock=lambda: now[0])

        async def create() -> str:
            await asyncio.sleep(0.01)
            made.append(f"sbx-{len(made)}")
            return made[-1]

        # a retry while the first create runs waits for it: one sandbox, both answers
        first, second = await asyncio.gather(creates.run("k", "fp", create), creates.run("k", "fp", create))
        assert first == ("sbx-0", False) and second == ("sbx-0", True)
        with pytest.raises(ApiError) as e:
            await creates.run("k", "other body", create)
        assert e.value.status == 422

        async def failing() -> str:
            raise ApiError(500, "boom")
        with pytest.raises(ApiError):
            await creates.run("f", "fp", failing)
        assert await creates.run("f", "fp", create) == ("sbx-1", False)   # a failure is forgotten
        now[0] = 61.0                                                     # the window is over
        assert await creates.run("k", "fp", create) == ("sbx-2", False)

    asyncio.run(scenario())
    assert parse_key(None) is None and parse_key("a-1") == "a-1"
    for bad in ("", "UPPER", "x" * 256, "a b"):
        with pytest.raises(ApiError):
            parse_key(bad)


def test_unsupported_options_named() -> None:
    from aenv_api.server.unsupported import reject_unsupported

    reject_unsupported(NewSandbox("base", mcp=None, iam={"tokens": {}}, volume_mounts=[], env_vars={"A": "$B"}))
    # secret markers are the secrets API's (secret_refs.py), no longer refused as unsupported
    reject_unsupported(NewSandbox("base", env_vars={"K": "${e2b.secrets.k}"}))
    for req in (NewSandbox("base", mcp={"x": {}}), NewSandbox("base", iam={"tokens": {"t": {}}})):
        with pytest.raises(ApiError) as e:
            reject_unsupported(req)
        assert e.value.status == 400 and "not supported by aenv" in e.value.message


@pytest.mark.parametrize("path,headers,expected", [
    ("/proxy/files?path=/a%20b", {"x-agentenv-sandbox-id": "s"}, "/files?path=/a%20b"),
    ("/proxy", {"x-agentenv-sandbox-id": "s"}, "/"),
    ("/proxy?x=1", {"E2b-Sandbox-Id": "s"}, "/?x=1"),
    ("/proxyless", {"x-agentenv-sandbox-id": "s"}, "/proxyless"),
    ("/proxy/app", {"Host": "8080-s.aenv.test"}, "/proxy/app"),      # host-routed: the guest's own path
    ("/files?path=x", {"E2b-Sandbox-Id": "s"}, "/files?path=x"),
])
def test_forward_target_strips_agentenv_prefix_of_header_routes(path: str, headers: dict[str, str],
                                                                expected: str) -> None:
    from aiohttp.test_utils import make_mocked_request

    from aenv_api.server.proxy import forward_target

    assert forward_target(make_mocked_request("GET", path, headers=headers)) == expected


def test_route_of_agentenv_headers() -> None:
    from aiohttp.test_utils import make_mocked_request

    from aenv_api.server.proxy import route_of

    def route(path: str, **headers: str) -> object:
        return route_of(make_mocked_request("GET", path, headers=headers), "aenv.test")

    assert route("/x", **{"x-agentenv-sandbox-id": "sbx-1", "x-agentenv-target-port": "8080"}) == ("sbx-1", 8080)
    assert route("/x", **{"x-agentenv-sandbox-id": "sbx-1"}) == ("sbx-1", 49983)
    assert route("/x", **{"E2b-Sandbox-Id": "e", "x-agentenv-sandbox-id": "a"}) == ("e", 49983)  # E2B's first
    assert route("/x") is None
    for bad in ({"x-agentenv-sandbox-id": "s", "x-agentenv-target-port": "0"}, {}):
        with pytest.raises(ApiError) as e:
            route("/proxy/x", **bad)
        assert e.value.status == 400
