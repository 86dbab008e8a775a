"""The fleet's own credentials (aenv_wire/fleet_auth.py): a node record's signature
verifies for exactly the record it was made for (any field changed, added, dropped or
moved to another node is refused), request credentials name their request and time,
the two keys never stand in for each other, and a rotation file signs with its first
secret and accepts every one."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv_wire.fleet_auth import MAX_SKEW, FleetKeys, FleetSecretError

from .strategies import text

secret = st.from_regex(r"[A-Za-z0-9_-]{16,48}", fullmatch=True)
node_id = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
fields = st.dictionaries(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), text, min_size=1, max_size=8)
target = st.from_regex(r"/[A-Za-z0-9/_%.-]{0,40}(\?[a-z=&]{0,20})?", fullmatch=True)
NOW = 1_800_000_000.0


@given(secret, node_id, fields)
def test_a_record_signature_round_trips(s: str, nid: str, f: dict[str, str]) -> None:
    keys = FleetKeys.parse(s)
    assert keys.record_ok(nid, dict(f), keys.record_mac(nid, f))


@given(secret, node_id, fields, st.data())
def test_a_tampered_record_is_refused(s: str, nid: str, f: dict[str, str], data: st.DataObject) -> None:
    keys = FleetKeys.parse(s)
    mac = keys.record_mac(nid, f)
    name = data.draw(st.sampled_from(sorted(f)))
    changed = data.draw(text.filter(lambda v: v != f[name]))
    assert not keys.record_ok(nid, {**f, name: changed}, mac)               # a field's value (the url, ...)
    assert not keys.record_ok(nid + "x", f, mac)                             # another node's record
    assert not keys.record_ok(nid, {k: v for k, v in f.items() if k != name}, mac)   # a field dropped
    extra = data.draw(st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(lambda k: k not in f))
    assert not keys.record_ok(nid, {**f, extra: ""}, mac)                   # a field added
    other = data.draw(secret.filter(lambda o: o != s))
    assert not FleetKeys.parse(other).record_ok(nid, f, mac)                # another fleet's secret
    assert not keys.record_ok(nid, f, mac[:-1] + ("0" if mac[-1] != "0" else "1"))


def test_the_encoding_has_no_ambiguity() -> None:
    """Field boundaries are length-prefixed: moving characters between names and values,
    or between the node id and the first field, changes the signature."""
    keys = FleetKeys.parse("0123456789abcdef0123")
    assert keys.record_mac("n1", {"url": "http://a"}) != keys.record_mac("n1u", {"rl": "http://a"})
    assert keys.record_mac("n", {"a": "bc"}) != keys.record_mac("n", {"ab": "c"})


@given(secret, st.sampled_from(["GET", "POST", "DELETE"]), target, st.integers(-MAX_SKEW, MAX_SKEW))
def test_a_request_credential_round_trips_within_the_skew(s: str, method: str, t: str, skew: int) -> None:
    keys = FleetKeys.parse(s)
    header = keys.request_credential(method, t, NOW)
    assert keys.request_ok(header, method, t, NOW + skew)


@given(secret, target, target.filter(lambda t: t != "/"))
def test_a_request_credential_names_its_request(s: str, t: str, other: str) -> None:
    keys = FleetKeys.parse(s)
    header = keys.request_credential("POST", t, NOW)
    assert not keys.request_ok(header, "GET", t, NOW)
    if other != t:
        assert not keys.request_ok(header, "POST", other, NOW)
    assert not keys.request_ok(header, "POST", t, NOW + MAX_SKEW + 1)
    assert not keys.request_ok(header, "POST", t, NOW - MAX_SKEW - 1)
    ts = header.split(" ")[1]
    assert not keys.request_ok(header.replace(ts, str(int(ts) + 1), 1), "POST", t, NOW)   # time moved


def test_the_two_keys_never_stand_in_for_each_other() -> None:
    keys = FleetKeys.parse("0123456789abcdef0123")
    mac = keys.record_mac("POST", {"": "/x"})
    assert not keys.request_ok(f"v1 {int(NOW)} {mac}", "POST", "/x", NOW)
    assert keys.request_credential("POST", "/x", NOW).split(" ")[2] != mac


def test_rotation_signs_with_the_first_and_accepts_every_secret() -> None:
    old, new = "the-old-fleet-secret-0123", "the-new-fleet-secret-4567"
    both = FleetKeys.parse(f"# rotation in progress\n{new}\n\n{old}\n")
    assert both.record_mac("n", {"url": "u"}) == FleetKeys.parse(new).record_mac("n", {"url": "u"})
    for one in (old, new):
        k = FleetKeys.parse(one)
        assert both.record_ok("n", {"url": "u"}, k.record_mac("n", {"url": "u"}))
        assert both.request_ok(k.request_credential("POST", "/a", NOW), "POST", "/a", NOW)
    assert not FleetKeys.parse(old).record_ok("n", {"url": "u"}, both.record_mac("n", {"url": "u"}))


@pytest.mark.parametrize("bad", ["", "\n# only a comment\n", "short", "has a space in it 0123456789"])
def test_an_unusable_secret_file_is_refused(bad: str) -> None:
    with pytest.raises(FleetSecretError):
        FleetKeys.parse(bad)


def test_malformed_credentials_are_refused_not_raised() -> None:
    keys = FleetKeys.parse("0123456789abcdef0123")
    for header in (None, "", "v1", "v2 1 ab", "v1 x ab", "v1 1 2 3", "v1 " + "9" * 40 + " ab", "v1  ab"):
        assert not keys.request_ok(header, "POST", "/x", NOW)
