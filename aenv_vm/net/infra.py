"""The infrastructure no sandbox reaches, whatever its ``allow_out`` says.

A node's sandbox table drops the ``never`` set before it looks at ``allow_out``
(rules.py): the node's own addresses and the sandbox networks, and -- from here --
the addresses of the services the fleet trusts: Redis, the repository's endpoint, the
node's advertised API address, the gateways, the node network. An ``allow_out`` that
names one (``10.0.0.0/8`` covering the cluster range, or the Redis address itself) is
accepted as before and still reaches none of them.

Each entry is an IPv4 address, a CIDR or a host name; names are resolved once, when
the node starts (an address that changes later is not followed: restart the node, or
list the range as a CIDR). ``InfraHost.required`` entries (what ``[vm] never_reach``
lists) that do not resolve stop the start; the ones the node derives from its other
settings only warn (a name that does not resolve here is no address a guest can reach
through this node's resolver either, but it may be reached by address: list it).
"""
from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence
from urllib.parse import urlsplit

from .netns import NetError

_HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?\Z")

Resolver = Callable[[str], list[str]]       # host name -> its IPv4 addresses (OSError when none)


@dataclass(frozen=True)
class InfraHost:
    """One infrastructure address and the setting it comes from (for messages)."""
    value: str          # IPv4 address, CIDR or host name
    origin: str         # e.g. "vm.never_reach", "cluster.redis_url"
    required: bool = False


def check_entry(value: str, where: str) -> str:
    """``value`` if it is an IPv4 address, an IPv4 CIDR or a host name; ValueError naming
    ``where`` otherwise (an IPv6 address: guests have no IPv6 at all)."""
    v = value.strip()
    try:
        ipaddress.IPv4Network(v, strict=False)
        return v
    except ValueError:
        pass
    if ":" in v:
        raise ValueError(f"{where}: {value!r} is not an IPv4 address, CIDR or host name (guests have no IPv6: "
                         f"nothing to list)")
    if not _HOSTNAME.match(v) or v.replace(".", "").isdigit():
        raise ValueError(f"{where}: {value!r} is not an IPv4 address, CIDR or host name")
    return v


def url_host(url: str) -> str | None:
    """The host of ``url`` (redis://, http(s)://), None for an empty or hostless one."""
    if not url:
        return None
    host = urlsplit(url).hostname
    return host or None


def _resolve(name: str) -> list[str]:
    return sorted({str(a[4][0]) for a in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)})


def infrastructure_nets(hosts: Iterable[InfraHost], resolve: Resolver = _resolve
                        ) -> tuple[list[ipaddress.IPv4Network], list[str]]:
    """The networks of ``hosts`` and a warning per derived name that did not resolve.
    NetError for a required one that did not (or is not an address, CIDR or name)."""
    nets: list[ipaddress.IPv4Network] = []
    warnings: list[str] = []
    for h in hosts:
        try:
            value = check_entry(h.value, h.origin)
        except ValueError as e:
            if h.required:
                raise NetError(str(e)) from None
            warnings.append(str(e))
            continue
        try:
            nets.append(ipaddress.IPv4Network(value, strict=False))
            continue
        except ValueError:
            pass
        try:
            addrs = resolve(value)
        except OSError as e:
            addrs, why = [], str(e)
        else:
            why = "no IPv4 address"
        if not addrs:
            msg = (f"{h.origin}: {value!r} does not resolve ({why}): sandboxes cannot be kept from it by address")
            if h.required:
                raise NetError(msg)
            warnings.append(msg)
        nets += [ipaddress.IPv4Network(f"{a}/32") for a in addrs]
    return nets, warnings


def describe(nets: Sequence[ipaddress.IPv4Network]) -> str:
    return ", ".join(sorted({str(n) for n in nets}, key=lambda s: ipaddress.IPv4Network(s).network_address)) or "none"
