"""The nftables ruleset of one sandbox's network namespace (pure: text out).

Two shapes, one policy (net/policy.py, docs/security.md):

* **user** mode: QEMU's user-mode network runs inside the namespace, so every
  connection the guest makes is a socket of QEMU there: the ``output`` hook
  filters them. The guest's gateway 10.0.2.2 means the namespace's own
  loopback, where only the node's egress proxy and DNS forwarder listen.
* **tap** mode: the guest is a host on ``tap0``; its packets are forwarded to
  ``eth0`` (the ``forward`` hook), and what it sends to the namespace itself
  (10.0.2.2, 10.0.2.3) meets the ``input`` hook.

In both, DNS (UDP and TCP port 53, to any address) is redirected to the node's
forwarder for this sandbox, and -- when the policy has hostname rules -- TCP 80
and 443 to destinations no CIDR allows explicitly are redirected to the node's
egress proxy, which decides by the TLS SNI or HTTP Host. Only redirected
connections reach those listeners (``ct status dnat``): dialled directly they
are as closed as everything else in the namespace. What remains is
decided by address, in this order: replies of allowed connections; never the
node's own addresses or the sandbox networks; explicit ``allow_out`` CIDRs; no
special range (loopback, RFC 1918, link-local, CGNAT, multicast...); no
``deny_out`` CIDR; then the internet default (``0.0.0.0/0`` denied or not).
IPv6 is dropped (the node offers guests none).

One ``nft -f`` of this text replaces the table atomically (``update``), so a
policy change never leaves a gap.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Iterable, Literal

from ..qemu.launcher import GUEST_IP
from .policy import SPECIAL_RANGES, NetworkPolicy

TABLE = "aenv"
SANDBOX_NETS = ipaddress.IPv4Network("10.201.0.0/16")     # every sandbox's /30 (netns.py)

Mode = Literal["user", "tap"]


@dataclass(frozen=True)
class Ports:
    """Where the node's services listen inside the namespace."""
    dns: int
    proxy: int


def _set(nets: Iterable[ipaddress.IPv4Network]) -> str:
    items = sorted({str(n) for n in nets}, key=lambda s: (ipaddress.IPv4Network(s).network_address, s))
    return "{ " + ", ".join(items) + " }" if items else ""


def _set_decl(name: str, nets: Iterable[ipaddress.IPv4Network]) -> str:
    elements = _set(nets)
    body = f" elements = {elements};" if elements else ""
    return f"    set {name} {{ type ipv4_addr; flags interval; auto-merge;{body} }}\n"


def ruleset(mode: Mode, policy: NetworkPolicy, ports: Ports, never: Iterable[ipaddress.IPv4Network] = ()) -> str:
    """The table for a sandbox namespace, as one ``nft -f`` script that replaces any
    previous one (``never``: the node's own addresses, beside the sandbox networks)."""
    never_nets = [SANDBOX_NETS, *never]
    decide = (
        "        meta nfproto ipv6 drop\n"
        "        ip daddr @never drop\n"
        "        ip daddr @allow accept\n"
        "        ip daddr @special drop\n"
        "        ip daddr @deny drop\n"
        f"        {'accept' if policy.internet else 'drop'}\n")
    web = (f"        ip daddr != @allow tcp dport {{ 80, 443 }} redirect to :{ports.proxy}\n"
           if policy.needs_proxy else "")
    dns = (f"        udp dport 53 redirect to :{ports.dns}\n"
           f"        tcp dport 53 redirect to :{ports.dns}\n")
    if mode == "user":
        chains = (
            "    chain nat_out {\n"
            "        type nat hook output priority -100; policy accept;\n"
            f"{dns}{web}"
            "    }\n"
            "    chain guest_out {\n"
            "        type filter hook output priority 0; policy accept;\n"
            "        ct state established,related accept\n"
            # only what the nat chain redirected reaches the node's listeners: a guest
            # dialling 10.0.2.2 (this namespace's loopback) directly reaches nothing.
            # (Not "oifname lo": the output hook still sees the route chosen before the
            # redirect, eth0.)
            f"        ip daddr 127.0.0.1 th dport {{ {ports.dns}, {ports.proxy} }} ct status dnat accept\n"
            '        oifname "lo" drop\n'
            f"{decide}"
            "    }\n")
    else:
        chains = (
            "    chain nat_pre {\n"
            "        type nat hook prerouting priority -100; policy accept;\n"
            f'        iifname "eth0" meta l4proto tcp dnat ip to {GUEST_IP}\n'
            + "".join(f'        iifname "tap0" {line.strip()}\n' for line in (dns + web).splitlines()) +
            "    }\n"
            "    chain nat_post {\n"
            "        type nat hook postrouting priority 100; policy accept;\n"
            '        oifname "eth0" masquerade\n'
            "    }\n"
            "    chain guest_forward {\n"
            "        type filter hook forward priority 0; policy accept;\n"
            '        iifname "eth0" accept\n'
            "        ct state established,related accept\n"
            f"{decide}"
            "    }\n"
            "    chain guest_input {\n"
            "        type filter hook input priority 0; policy accept;\n"
            '        iifname != "tap0" accept\n'
            "        ct state established,related accept\n"
            # what nat_pre redirected to the node's listeners; nothing else here
            f"        th dport {{ {ports.dns}, {ports.proxy} }} ct status dnat accept\n"
            "        drop\n"
            "    }\n")
    return (f"table inet {TABLE}\n"
            f"delete table inet {TABLE}\n"
            f"table inet {TABLE} {{\n"
            + _set_decl("never", never_nets)
            + _set_decl("allow", policy.allow_nets)
            + _set_decl("special", SPECIAL_RANGES)
            + _set_decl("deny", policy.deny_nets)
            + chains + "}\n")
