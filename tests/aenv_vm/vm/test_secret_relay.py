"""network.rules as the egress proxy applies them (pure): parsing and its 400s, the
rewrite of a guest's request to a ruled host (headers set, markers resolved, one
request then Connection: close), and what is never rewritten."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv_vm.errors import BadRequest
from aenv_vm.net.policy import NetworkPolicy, parse_policy
from aenv_vm.net.secret_relay import MAX_HEAD, rewrite
from aenv_vm.net.transforms import MAX_DOMAINS, Transforms, check_allowed, parse_rules

SECRETS = {("team-a", "key"): b"s3cr3t-value", ("team-a", "crlf"): b"x\r\nInjected: 1"}


def resolve(team: str, name: str) -> bytes | None:
    return SECRETS.get((team, name))


def rules(raw: object) -> Transforms:
    t = parse_rules(raw, "team-a")
    assert t is not None
    return t


RULED = rules({"api.test": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.key}"}}}],
               "*.wild.test": [{"transform": {"headers": {"X-Static": "plain"}}}]})


def test_rules_round_trip_in_the_policy() -> None:
    policy = dataclasses.replace(parse_policy(["api.test", "*.wild.test"]), transforms=RULED)
    assert NetworkPolicy.from_json(policy.to_json()) == policy and policy.needs_proxy
    assert RULED.secret_names() == ["key"] and RULED.rule_for("API.test") is not None
    assert RULED.rule_for("a.wild.test") is not None and RULED.rule_for("wild.test") is None
    check_allowed(RULED, policy.allow_hosts)
    with pytest.raises(BadRequest, match="allowed by name"):
        check_allowed(RULED, ("other.test",))
    with pytest.raises(BadRequest, match="allowed by name"):      # a wildcard rule needs a wildcard allow
        check_allowed(rules({"*.api.test": [{"transform": {"headers": {"A": "${e2b.secrets.key}"}}}]}),
                      ("x.api.test",))
    assert parse_rules({}, "t") is None and parse_rules(None, "t") is None


@pytest.mark.parametrize("raw,why", [
    ([], "must be an object"),
    ({"not a host": []}, "hostname"),
    ({"a.test": {}}, "list of rules"),
    ({"a.test": [{"other": {}}]}, "transform"),
    ({"a.test": [{"transform": {"body": {}}}]}, "only \"headers\""),
    ({"a.test": [{"transform": {"headers": {"Bad Name": "v"}}}]}, "header name"),
    ({"a.test": [{"transform": {"headers": {"Host": "v"}}}]}, "frames the request"),
    ({"a.test": [{"transform": {"headers": {"Content-Length": "1"}}}]}, "frames the request"),
    ({"a.test": [{"transform": {"headers": {"A": "x\r\nB: y"}}}]}, "control characters"),
    ({f"d{i}.test": [] for i in range(MAX_DOMAINS + 1)}, "at most"),
])
def test_bad_rules_name_the_entry(raw: object, why: str) -> None:
    with pytest.raises(BadRequest, match="network.rules") as e:
        parse_rules(raw, "t")
    assert why in str(e.value)


def test_a_ruled_request_gets_its_headers_and_values() -> None:
    req = (b"GET /v1/x HTTP/1.1\r\nHost: api.test\r\nAuthorization: guest's own\r\nConnection: keep-alive\r\n"
           b"X-Mine: ${e2b.secrets.key} ${e2b.secrets.unknown}\r\nContent-Length: 4\r\n\r\nbody")
    rule = RULED.rule_for("api.test")
    assert rule is not None
    rw = rewrite(req, "api.test", rule, "team-a", resolve)
    assert not rw.refused and rw.rest == b"body" and rw.substituted == 2
    head = rw.head.decode()
    assert head.startswith("GET /v1/x HTTP/1.1\r\n") and head.endswith("\r\n\r\n")
    assert "Authorization: Bearer s3cr3t-value\r\n" in head and "guest's own" not in head
    assert "X-Mine: s3cr3t-value ${e2b.secrets.unknown}\r\n" in head      # unknown: the marker stays
    assert "Connection: close\r\n" in head and "keep-alive" not in head and "Content-Length: 4" in head
    # another team's sandbox gets nothing of team-a's
    other = rewrite(req, "api.test", rule, "team-b", resolve)
    assert b"s3cr3t" not in other.head and b"Bearer ${e2b.secrets.key}" in other.head


@pytest.mark.parametrize("req,why", [
    (b"GET / HTTP/1.1\r\nHost: evil.test\r\nX: ${e2b.secrets.key}\r\n\r\n", "Host"),
    (b"GET / HTTP/1.1\r\nHost: api.test\r\nHost: evil.test\r\n\r\n", "Host"),
    (b"GET / HTTP/1.1\r\nX: 1\r\n", "complete request head"),
    (b"NOT HTTP\r\n\r\n", "HTTP/1"),
    (b"GET / HTTP/1.1\r\nHost: api.test\r\nX: ${e2b.secrets.crlf}\r\n\r\n", "no valid header value"),
    (b"GET / HTTP/1.1\r\nHost: api.test\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n", "complete request head"),
])
def test_what_is_never_rewritten(req: bytes, why: str) -> None:
    rule = RULED.rule_for("api.test")
    assert rule is not None
    rw = rewrite(req, "api.test", rule, "team-a", resolve)
    assert why in rw.refused


@given(st.binary(max_size=400))
def test_any_bytes_are_rewritten_or_refused_never_raise(data: bytes) -> None:
    rule = RULED.rule_for("api.test")
    assert rule is not None
    rw = rewrite(b"GET / HTTP/1.1\r\nHost: api.test\r\n" + data, "api.test", rule, "team-a", resolve)
    assert rw.refused or rw.head.endswith(b"\r\n\r\n")
    assert b"Injected" not in rw.head.split(b"\r\n\r\n")[0] or b"Injected" in data
