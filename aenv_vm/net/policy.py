"""A sandbox's egress policy: what its guest may open connections to.

E2B's network options, as the node enforces them (docs/security.md):

* ``allow_out``: CIDRs, bare IPs and hostnames (``example.com``,
  ``*.example.com``). Allowed entries always win over denied ones. A hostname
  is matched by name on the way out (TLS SNI on TCP 443, the HTTP ``Host`` on
  TCP 80, through the node's egress proxy), so an allowed domain keeps working
  when its addresses change, and another name on the same address stays out.
* ``deny_out``: CIDRs and bare IPs (no hostnames, as E2B). ``0.0.0.0/0`` denies
  the whole internet (``allow_internet_access: false`` is exactly that).
* ``dns_servers``: the resolvers the node's DNS forwarder asks for this
  sandbox (None: the node's own upstream).

Whatever the rules say, a guest never reaches the host, the node's services or
another sandbox; loopback, RFC 1918, link-local, CGNAT and other special
ranges are reachable only when ``allow_out`` names them explicitly.

Pure: parsing and validation (``parse_policy`` raises ``BadRequest`` naming
the field), and the decisions a filter needs (``decide_ip``, ``hostname_allowed``).
"""
from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass
from typing import Literal

from ..errors import BadRequest
from .hostnames import host_matches as host_matches  # re-exported: the policy's matching
from .hostnames import is_hostname
from .transforms import Transforms

MAX_RULES = 128             # entries per list (E2B documents no limit; bounds what one request costs)
MAX_DNS_SERVERS = 10        # E2B: "up to 10 entries"
ALL_TRAFFIC = "0.0.0.0/0"

IPNet = ipaddress.IPv4Network

# Destinations no rule but an explicit allow opens (the host's own and its neighbours').
SPECIAL_RANGES: tuple[IPNet, ...] = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8",          # "this network"
    "10.0.0.0/8",         # RFC 1918
    "100.64.0.0/10",      # CGNAT (RFC 6598)
    "127.0.0.0/8",        # loopback
    "169.254.0.0/16",     # link-local (cloud metadata services live here)
    "172.16.0.0/12",      # RFC 1918
    "192.0.0.0/24",       # IETF protocol assignments
    "192.168.0.0/16",     # RFC 1918
    "198.18.0.0/15",      # benchmarking
    "224.0.0.0/4",        # multicast
    "240.0.0.0/4",        # reserved, broadcast
))


Decision = Literal["allow", "deny"]


@dataclass(frozen=True)
class NetworkPolicy:
    allow_nets: tuple[IPNet, ...] = ()
    allow_hosts: tuple[str, ...] = ()           # lower-case, "*.x.y" for a suffix
    deny_nets: tuple[IPNet, ...] = ()
    dns_servers: tuple[str, ...] | None = None  # None: the node's upstream resolvers
    # E2B's ``rules``: header transforms (and secrets) per domain, applied by the egress proxy
    transforms: Transforms | None = None

    @property
    def allow_out(self) -> list[str]:
        """The allow list as E2B shows it (IPs and CIDRs, then hostnames)."""
        return [_show(n) for n in self.allow_nets] + list(self.allow_hosts)

    @property
    def deny_out(self) -> list[str]:
        return [_show(n) for n in self.deny_nets]

    @property
    def internet(self) -> bool:
        """Whether unlisted public destinations are allowed (no ``0.0.0.0/0`` denial)."""
        return not any(n.prefixlen == 0 for n in self.deny_nets)

    @property
    def needs_proxy(self) -> bool:
        """Hostname rules are decided by name on the way out, and transforms applied there
        (the egress proxy)."""
        return bool(self.allow_hosts) or self.transforms is not None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"allow_out": self.allow_out, "deny_out": self.deny_out}
        if self.dns_servers is not None:
            out["dns_servers"] = list(self.dns_servers)
        if self.transforms is not None:
            out["transforms"] = self.transforms.to_json()
        return out

    @classmethod
    def from_json(cls, raw: dict[str, object] | None) -> "NetworkPolicy":
        """From ``to_json``'s form (a record's JSON: parse_policy checks every value)."""
        raw = raw or {}
        policy = parse_policy(raw.get("allow_out") or [], raw.get("deny_out") or [], raw.get("dns_servers"))
        t = raw.get("transforms")
        return dataclasses.replace(policy, transforms=Transforms.from_json(t)) if isinstance(t, dict) else policy

    def decide_ip(self, addr: ipaddress.IPv4Address) -> Decision:
        """Where a connection to ``addr`` (no hostname known) may go: an explicit allow
        first, then the special ranges, then ``deny_out``, then the internet default."""
        if any(addr in n for n in self.allow_nets):
            return "allow"
        if any(addr in n for n in SPECIAL_RANGES):
            return "deny"
        if any(addr in n for n in self.deny_nets):
            return "deny"
        return "allow"

    def hostname_allowed(self, name: str) -> bool:
        return any(host_matches(pattern, name) for pattern in self.allow_hosts)


def _show(net: IPNet) -> str:
    return str(net.network_address) if net.prefixlen == 32 else str(net)


def _entries(value: object, field_name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{field_name} must be a list of strings")
    if len(value) > MAX_RULES:
        raise BadRequest(f"{field_name} has {len(value)} entries (at most {MAX_RULES})")
    return [v.strip() for v in value]


def _net(entry: str) -> IPNet | None:
    try:
        return ipaddress.IPv4Network(entry, strict=False)
    except ValueError:
        return None


def parse_policy(allow_out: object = None, deny_out: object = None,
                 dns_servers: object = None) -> NetworkPolicy:
    """A policy from E2B's lists; BadRequest naming the field and the entry otherwise."""
    nets: list[IPNet] = []
    hosts: list[str] = []
    for entry in _entries(allow_out, "network.allowOut"):
        net = _net(entry)
        if net is not None:
            nets.append(net)
        elif ":" in entry:
            raise BadRequest(f"network.allowOut: {entry!r}: IPv6 destinations are not supported (IPv4 CIDRs, IPs "
                             f"or hostnames)")
        elif is_hostname(entry.lower()):
            hosts.append(entry.lower())
        else:
            raise BadRequest(f"network.allowOut: {entry!r} is neither an IPv4 CIDR, an IP nor a hostname")
    deny: list[IPNet] = []
    for entry in _entries(deny_out, "network.denyOut"):
        net = _net(entry)
        if net is None:
            raise BadRequest(f"network.denyOut: {entry!r} is not an IPv4 CIDR or IP (hostnames cannot be denied)")
        deny.append(net)
    dns: tuple[str, ...] | None = None
    if dns_servers is not None:
        servers = _entries(dns_servers, "network.dnsServers")
        if len(servers) > MAX_DNS_SERVERS:
            raise BadRequest(f"network.dnsServers has {len(servers)} entries (at most {MAX_DNS_SERVERS})")
        for s in servers:
            try:
                ipaddress.IPv4Address(s)
            except ValueError:
                raise BadRequest(f"network.dnsServers: {s!r} is not an IPv4 address") from None
        dns = tuple(servers)
    return NetworkPolicy(tuple(dict.fromkeys(nets)), tuple(dict.fromkeys(hosts)), tuple(dict.fromkeys(deny)), dns)


def with_internet(policy: NetworkPolicy, allowed: bool) -> NetworkPolicy:
    """``allow_internet_access``: False adds ``0.0.0.0/0`` to the denials; True removes it."""
    deny = tuple(n for n in policy.deny_nets if n.prefixlen != 0)
    if not allowed:
        deny = deny + (ipaddress.IPv4Network(ALL_TRAFFIC),)
    return dataclasses.replace(policy, deny_nets=deny)
