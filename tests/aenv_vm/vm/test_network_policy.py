"""Egress policies: parsing E2B's lists (clear 400s naming the field), round trips,
and the decisions a filter takes from them."""
from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.errors import BadRequest
from aenv_vm.net.policy import ALL_TRAFFIC, MAX_RULES, NetworkPolicy, host_matches, parse_policy, with_internet

labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
hostnames = st.builds(lambda parts, wild: ("*." if wild else "") + ".".join(parts),
                      st.lists(labels, min_size=2, max_size=4), st.booleans())
nets = st.builds(lambda a, p: str(ipaddress.IPv4Network((a, p), strict=False)),
                 st.integers(0, 2**32 - 1), st.integers(0, 32))
ips = st.builds(lambda a: str(ipaddress.IPv4Address(a)), st.integers(0, 2**32 - 1))


@settings(deadline=None)
@given(st.lists(st.one_of(nets, ips, hostnames), max_size=20), st.lists(st.one_of(nets, ips), max_size=20),
       st.none() | st.lists(ips, max_size=10))
def test_policies_round_trip(allow: list[str], deny: list[str], dns: list[str] | None) -> None:
    policy = parse_policy(allow, deny, dns)
    assert NetworkPolicy.from_json(policy.to_json()) == policy
    assert parse_policy(policy.allow_out, policy.deny_out, policy.dns_servers) == policy   # what get_info shows parses back
    assert policy.internet == (ALL_TRAFFIC not in [str(n) for n in policy.deny_nets])


@pytest.mark.parametrize("allow,deny,dns,field", [
    (["not a host!"], [], None, "network.allowOut"),
    (["example"], [], None, "network.allowOut"),            # a single label is no hostname
    (["-bad.example.com"], [], None, "network.allowOut"),
    (["2001:db8::/32"], [], None, "network.allowOut"),       # IPv6: not supported, said so
    ([], ["example.com"], None, "network.denyOut"),          # hostnames cannot be denied (as E2B)
    ([], ["10.0.0.0/33"], None, "network.denyOut"),
    ([], [], ["dns.example.com"], "network.dnsServers"),
    ([], [], ["1.1.1.1"] * 11, "network.dnsServers"),
    (["1.1.1.1"] * (MAX_RULES + 1), [], None, "network.allowOut"),
    ("1.1.1.1", [], None, "network.allowOut"),               # not a list
    ([1], [], None, "network.allowOut"),
])
def test_bad_rules_name_the_field(allow: object, deny: object, dns: object, field: str) -> None:
    with pytest.raises(BadRequest, match=field.replace(".", r"\.")):
        parse_policy(allow, deny, dns)


def test_decisions() -> None:
    ip = ipaddress.IPv4Address
    open_ = NetworkPolicy()
    assert open_.internet and open_.decide_ip(ip("203.0.113.7")) == "allow"
    for private in ("10.1.2.3", "172.20.0.1", "192.168.1.1", "127.0.0.1", "169.254.169.254", "100.64.0.1",
                    "224.0.0.1", "0.0.0.0", "255.255.255.255"):
        assert open_.decide_ip(ip(private)) == "deny", private       # never by default
    closed = with_internet(open_, False)
    assert not closed.internet and closed.decide_ip(ip("203.0.113.7")) == "deny"
    assert with_internet(closed, True) == open_
    # allow wins over deny, and an explicit allow opens even a special range
    p = parse_policy(["203.0.113.0/24", "10.5.0.0/16", "api.example.com"], [ALL_TRAFFIC, "203.0.113.9"])
    assert p.decide_ip(ip("203.0.113.9")) == "allow" and p.decide_ip(ip("10.5.1.1")) == "allow"
    assert p.decide_ip(ip("10.6.1.1")) == "deny" and p.decide_ip(ip("198.51.100.1")) == "deny"
    assert p.needs_proxy and p.hostname_allowed("API.example.com.") and not p.hostname_allowed("example.com")


def test_wildcards_match_below_not_at() -> None:
    assert host_matches("*.example.com", "a.example.com") and host_matches("*.example.com", "a.b.example.com")
    assert not host_matches("*.example.com", "example.com") and not host_matches("*.example.com", "badexample.com")
    assert host_matches("example.com", "Example.COM") and not host_matches("example.com", "a.example.com")
