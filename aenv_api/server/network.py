"""E2B's network options as the API handles them: the ``network`` object of a
create, the body of ``PUT /sandboxes/{id}/network``, the ``network`` that
``get_info`` shows, and the rules the proxy applies to traffic into a sandbox.

Two halves, kept in two places:

* **Egress** (``allowOut``, ``denyOut``, ``dnsServers``, ``allow_internet_access``)
  becomes a ``NetworkPolicy`` (aenv_vm/net/policy.py, which validates the
  entries) handed to the sandbox layer. The layer enforces it, keeps it in the
  sandbox's record across pause, resume, fork and restarts, and an update
  replaces it whole (E2B: "omitting a field clears it").
* **Ingress through the proxy** (``allowPublicTraffic``, ``maskRequestHost``,
  ``httpsPorts``) is fixed at create (E2B's update body has none of them) and
  kept by the API in its extras (extras.py); fork children inherit it.

* **Transforms** (``rules``: headers per domain, their values may carry secret
  markers) become the policy's ``Transforms`` (aenv_vm/net/transforms.py), with the
  team whose secrets they name; the egress proxy applies them. A domain whose
  headers use secrets must be allowed by name in ``allowOut``.

Not supported, and said so with a 400 naming the field (never accepted and
ignored): ``egressProxy`` (a SOCKS5 "bring your own proxy": the node's egress
path has no SOCKS5 client).

Pure: bodies already type-checked by schemas.py in, records out; ``ApiError``
400 whose message starts with the field.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from aenv_vm.errors import BadRequest
from aenv_vm.net.policy import NetworkPolicy, parse_policy, with_internet
from aenv_vm.net.transforms import check_allowed, parse_rules
from envd import ENVD_PORT

from .errors import bad_request
from .extras import Extra

PORT_PLACEHOLDER = "${PORT}"
# A Host header value: a name or address, an optional port, ${PORT} anywhere (no spaces,
# no control characters: the value goes into the request head as it is).
_HOST_MASK = re.compile(r"^(?:[A-Za-z0-9._~-]|\$\{PORT\}|[:\[\]])+$")


@dataclass(frozen=True)
class NetworkRequest:
    """A create's ``network``: the egress policy for the sandbox layer, the rest for the API."""

    policy: NetworkPolicy = NetworkPolicy()
    public_traffic: bool = True
    mask_request_host: str | None = None
    https_ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class ProxyRules:
    """What the proxy applies to the traffic into one sandbox."""

    traffic_token: str | None = None        # demanded on every port but envd's (None: public)
    mask_request_host: str | None = None    # the Host header sent to the guest
    https_ports: frozenset[int] = frozenset()   # guest ports reached over TLS

    def host_header(self, port: int) -> str | None:
        return None if self.mask_request_host is None else self.mask_request_host.replace(PORT_PLACEHOLDER,
                                                                                          str(port))


PUBLIC = ProxyRules()


def _unsupported(body: dict[str, Any]) -> None:
    if body.get("egress_proxy") is not None:
        raise bad_request("network.egressProxy: a SOCKS5 egress proxy is not supported by this server "
                          "(the sandbox's egress goes out through the node itself)")


def _policy(body: dict[str, Any], allow_internet_access: bool | None, team: str) -> NetworkPolicy:
    """``allow_internet_access`` wins over a ``0.0.0.0/0`` in ``denyOut`` both ways: false adds
    it, true takes it out (finer denials stay). ``team``: whose secrets the rules' markers name."""
    _unsupported(body)
    try:
        policy = parse_policy(body.get("allow_out"), body.get("deny_out"), body.get("dns_servers"))
        transforms = parse_rules(body.get("rules"), team)
        if transforms is not None:
            check_allowed(transforms, policy.allow_hosts)
            policy = dataclasses.replace(policy, transforms=transforms)
    except BadRequest as e:
        raise bad_request(str(e)) from None
    return policy if allow_internet_access is None else with_internet(policy, allow_internet_access)


def create_network(body: dict[str, Any] | None, allow_internet_access: bool | None = None,
                   team: str = "") -> NetworkRequest:
    """The meaning of a create's ``network`` (as schemas.NETWORK_CONFIG parsed it) together
    with its top-level ``allow_internet_access``."""
    if not body:
        return NetworkRequest(_policy({}, allow_internet_access, team))
    mask = body.get("mask_request_host")
    if mask is not None and not _HOST_MASK.match(mask):
        raise bad_request(f"network.maskRequestHost: {mask[:80]!r} is not a host (letters, digits, '.', '-', "
                          f"':' and {PORT_PLACEHOLDER})")
    ports = tuple(sorted(set(body.get("https_ports") or ())))
    if ENVD_PORT in ports:
        raise bad_request(f"network.httpsPorts: the envd port ({ENVD_PORT}) cannot be listed")
    public = body.get("allow_public_traffic")
    return NetworkRequest(_policy(body, allow_internet_access, team), public is not False, mask, ports)


def update_policy(body: dict[str, Any], team: str = "") -> NetworkPolicy:
    """The egress policy a ``PUT /sandboxes/{id}/network`` body (schemas.NETWORK_UPDATE) puts
    in force: what it names, nothing kept from before (E2B: the rules too)."""
    return _policy(body, body.get("allow_internet_access"), team)


def egress_choice(allow_internet_access: bool | None, policy: NetworkPolicy) -> bool | None:
    """``allow_internet_access`` of a create: the field itself, else False when the policy
    denies ``0.0.0.0/0`` (E2B: the two are the same), else None (not set)."""
    if allow_internet_access is not None:
        return allow_internet_access
    return None if policy.internet else False


def network_view(policy: NetworkPolicy, extra: Extra) -> dict[str, Any]:
    """E2B's ``SandboxNetworkConfig`` of a sandbox as ``get_info`` shows it: the egress rules
    in force (CIDRs normalised, ``/32`` shown as the bare IP, hostnames lower-case) and the
    proxy's settings. Never a token."""
    out: dict[str, Any] = {"allowOut": policy.allow_out, "denyOut": policy.deny_out,
                           "allowPublicTraffic": extra.public_traffic}
    if policy.dns_servers is not None:
        out["dnsServers"] = list(policy.dns_servers)
    if extra.mask_request_host is not None:
        out["maskRequestHost"] = extra.mask_request_host
    if extra.https_ports:
        out["httpsPorts"] = list(extra.https_ports)
    if policy.transforms is not None:
        out["rules"] = policy.transforms.wire()     # markers, never a value
    return out
