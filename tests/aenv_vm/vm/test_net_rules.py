"""The pure parts of sandbox egress: the namespace's nftables table (and that nft
accepts every variant), what the proxy reads off a connection's first bytes
(real TLS ClientHellos from Python's ssl, fuzzed bytes), and DNS messages."""
from __future__ import annotations

import ipaddress
import os
import shutil
import ssl
import struct
import subprocess
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.net import dns, rules
from aenv_vm.net.policy import NetworkPolicy, parse_policy, with_internet
from aenv_vm.net.sniff import MAX_SNIFF, NEED_MORE, Name, sniff

PORTS = rules.Ports(dns=10053, proxy=10080)
POLICIES = {
    "open": NetworkPolicy(),
    "closed": with_internet(NetworkPolicy(), False),
    "hosts": parse_policy(["api.example.com", "*.example.org", "203.0.113.0/24"], ["0.0.0.0/0"], ["192.0.2.53"]),
    "deny some": parse_policy(["10.7.0.0/16"], ["198.51.100.0/24", "203.0.113.5"]),
}


@pytest.mark.parametrize("mode", ["user", "tap"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_ruleset_shape(mode: str, name: str) -> None:
    policy = POLICIES[name]
    text = rules.ruleset(mode, policy, PORTS, [rules.SANDBOX_NETS])   # type: ignore[arg-type]
    assert text.startswith("table inet aenv\ndelete table inet aenv\n")   # replaces in one transaction
    assert "meta nfproto ipv6 drop" in text and "ip daddr @never drop" in text
    assert text.index("ip daddr @never drop") < text.index("ip daddr @allow accept") < text.index(
        "ip daddr @special drop") < text.index("ip daddr @deny drop")     # allow wins, never is never
    assert f"udp dport 53 redirect to :{PORTS.dns}" in text
    assert ("redirect to :10080" in text) == policy.needs_proxy
    last = "accept" if policy.internet else "drop"
    lines = [line.strip() for line in text.splitlines()]
    assert lines[lines.index("ip daddr @deny drop") + 1] == last     # then the internet default
    if mode == "user":
        assert 'oifname "lo" drop' in text and "hook output" in text
    else:
        assert 'iifname "eth0" meta l4proto tcp dnat ip to 10.0.2.15' in text and "hook forward" in text


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nft")
def test_nft_accepts_every_variant() -> None:
    """Load each variant into a scratch namespace: nft's own parser is the judge."""
    ns = f"aenv-ruletest-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for mode in ("user", "tap"):
            for name, policy in POLICIES.items():
                text = rules.ruleset(mode, policy, PORTS, [])  # type: ignore[arg-type]
                for _ in range(2):   # the second load replaces the first
                    done = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, text=True,
                                          capture_output=True)
                    assert done.returncode == 0, (mode, name, done.stderr)
                listed = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "aenv"],
                                        capture_output=True, text=True).stdout
                assert "192.168.0.0/16" in listed and "10.201.0.0/16" in listed
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=True)


# -- what the proxy sniffs ------------------------------------------------------------------

def client_hello(server_name: str | None) -> bytes:
    """The first flight of a real TLS client (Python's ssl), without any network."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,12}[a-z0-9])?", fullmatch=True)
# a name of digits only ("0.0.0.0") reads as an address: a client sends no SNI for it
names = st.builds(".".join, st.lists(labels, min_size=2, max_size=4)).filter(
    lambda n: not all(label.isdigit() for label in n.split(".")))


@settings(deadline=None, max_examples=50)
@given(names)
def test_sni_of_real_client_hellos(name: str) -> None:
    hello = client_hello(name)
    assert sniff(hello) == Name(name)
    for cut in (0, 3, 5, len(hello) // 2, len(hello) - 1):
        assert sniff(hello[:cut]) is NEED_MORE      # a prefix waits for more


def test_client_hello_without_sni_decides_by_address() -> None:
    assert sniff(client_hello(None)) is None


@settings(deadline=None)
@given(st.sampled_from(["GET", "POST", "HEAD"]), names, st.none() | st.integers(1, 65535),
       st.lists(st.tuples(st.from_regex(r"X-[A-Za-z]{1,8}", fullmatch=True), st.text("abc", max_size=5)),
                max_size=3))
def test_http_host(method: str, host: str, port: int | None, headers: list[tuple[str, str]]) -> None:
    hdrs = "".join(f"{k}: {v}\r\n" for k, v in headers)
    req = f"{method} / HTTP/1.1\r\n{hdrs}Host: {host.upper()}{'' if port is None else f':{port}'}\r\n\r\n".encode()
    assert sniff(req) == Name(host)
    assert sniff(req[:-2]) is NEED_MORE


@settings(deadline=None)
@given(st.binary(max_size=4096))
def test_garbage_never_raises(data: bytes) -> None:
    got = sniff(data)
    assert got is None or got is NEED_MORE or isinstance(got, Name)


def test_limits() -> None:
    assert sniff(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_SNIFF) is None       # no end of headers in the limit
    huge = b"\x16\x03\x01" + struct.pack(">H", 65535)                       # a record longer than the limit
    assert sniff(huge) is None
    assert sniff(b"SSH-2.0-OpenSSH\r\n") is None and sniff(b"\x00\x01") is None
    assert sniff(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n") is None        # IPv6 literal: no name
    assert sniff(b"GET / HTTP/1.1\r\nHost: bad..name\r\n\r\n") is None


# -- DNS -------------------------------------------------------------------------------------

def query(name: str, qid: int = 0x1234) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + struct.pack(">HH", 1, 1)


def test_refused_answers_the_same_question() -> None:
    q = query("example.com")
    r = dns.refused(q)
    qid, flags, qd, an, ns, ar = struct.unpack_from(">HHHHHH", r)
    assert (qid, flags & 0x8000, flags & 0xF, qd, an, ns, ar) == (0x1234, 0x8000, 5, 1, 0, 0, 0)
    assert r[12:] == q[12:] and dns.well_formed(q) and not dns.well_formed(r) and not dns.well_formed(b"\x00")


def test_nameservers(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# comment\nnameserver 127.0.0.53\nnameserver ::1\nnameserver bogus\nsearch example\n"
                    "nameserver 192.0.2.53\n")
    assert dns.nameservers(conf) == ["127.0.0.53", "192.0.2.53"]    # the node may use its loopback resolver
    assert dns.nameservers(tmp_path / "missing") == []


def test_dns_servers_follow_the_policy() -> None:
    from aenv_vm.net.egress import dns_servers_for

    up = ["192.0.2.53"]
    assert list(dns_servers_for(NetworkPolicy(), up)) == up
    closed = with_internet(NetworkPolicy(), False)
    assert list(dns_servers_for(closed, up)) == []                                  # refused
    assert list(dns_servers_for(parse_policy(["api.example.com"], ["0.0.0.0/0"]), up)) == up   # a name is allowed
    assert list(dns_servers_for(parse_policy([], ["0.0.0.0/0"], ["198.51.100.53"]), up)) == ["198.51.100.53"]
    # a sandbox's own resolvers are asked from the node: no private one unless allowed explicitly
    private = ["10.0.0.2", "169.254.169.253", "198.51.100.53"]
    assert list(dns_servers_for(parse_policy(None, None, private), up)) == ["198.51.100.53"]
    assert list(dns_servers_for(parse_policy(["10.0.0.0/24"], None, private), up)) == ["10.0.0.2", "198.51.100.53"]
    never = [ipaddress.IPv4Network("198.51.100.53/32")]                              # the node's own address
    assert list(dns_servers_for(parse_policy(None, None, private), up, never)) == []
    assert list(dns_servers_for(parse_policy([], [], []), up)) == []                # dns_servers: [] = none
