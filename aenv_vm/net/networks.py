"""How one node's sandboxes are networked: ``[vm] network = "auto" | "user" |
"tap"`` and ``[vm] isolation = "auto" | "required" | "off"`` (docs/security.md).

* ``auto`` (default): tap wherever the host allows it (root, nftables,
  iproute2, /dev/net/tun) and isolation is not "off", else user (``decide_mode``).

* ``user``: QEMU's user-mode network. Isolated (root, nftables,
  iproute2: the default wherever the host allows it), each sandbox's QEMU runs
  in a network namespace of its own (netns.py) whose nftables table (rules.py)
  filters every connection the guest's user-mode network opens; the node
  reaches envd and other guest ports through host forwards on the namespace's
  address. Not isolated: host forwards on 127.0.0.1 and QEMU's ``restrict=on``
  (no egress), or, with isolation "off", the old unfiltered user network.
* ``tap`` (needs root): the guest is on a tap device in its namespace; the node
  reaches any guest TCP port at the namespace's veth address (DNAT).

Either way the guest's DNS and (with hostname rules) its web traffic go
through the node's egress services (egress.py, dns.py) listening inside the
namespace; a policy change is one nftables transaction (``apply``).

``NodeNetworks`` is the node's view: it makes a sandbox's network before its
QEMU starts (``attach`` → an ``Attachment``: how that QEMU is networked, which
``Attachment.on`` writes into its ``VmSpec``), remembers it by sandbox id, and
removes it (``release``) when the QEMU that used it is gone.
Templates are saved from user-mode VMs: their device state has a ``slirp``
section that a VM on a tap device cannot load, so ``device_state`` gives tap
VMs a copy without it (made once per file, next to it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import threading
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence, cast

from envd import ENVD_PORT

from ..errors import Unsupported
from ..qemu.launcher import VmSpec, free_port
from . import dns, netns, rules
from .bounds import Drops, EgressLimits
from .egress import EgressService, egress_ports
from .infra import InfraHost, infrastructure_nets
from .netns import NetError, SandboxNet
from .policy import NetworkPolicy

log = logging.getLogger(__name__)

NetworkMode = Literal["user", "tap"]
MODES: tuple[str, ...] = ("auto", "user", "tap")    # as configured; "auto" is decided at start
TAP_STATE_SUFFIX = ".tap"


def tap_problems() -> list[str]:
    """Why tap mode cannot work on this host (empty: it can). Cheap: no namespace is made.
    Everything namespaces need (isolation_problems()), and the tun device."""
    return isolation_problems() + _tun_problems()


def _tun_problems() -> list[str]:
    return [] if Path("/dev/net/tun").exists() else ["/dev/net/tun missing (tun module)"]


def probe_tap(run_root: Path) -> None:
    """Make and remove one namespace of the real kind (veth, tap, nft rules). NetError if it fails."""
    problems = tap_problems()
    if problems:
        raise NetError("tap networking cannot work here: " + "; ".join(problems))
    net = netns.create(netns.node_tag(run_root), f"probe-{os.getpid():x}",
                       lambda n: rules.ruleset("tap", NetworkPolicy(), egress_ports()))
    netns.destroy(net)


def device_state(state: Path) -> Path:
    """``state`` without its ``slirp`` section (a VM on a tap device has no place for
    it), as a file next to it; ``state`` itself when it has none (e.g. saved from a
    tap VM). The copy is written once (tmp + rename) and reused."""
    from ..qemu.migration_stream import StreamError, drop_section
    tap = state.with_name(state.name + TAP_STATE_SUFFIX)
    if tap.is_file():
        return tap
    raw = state.read_bytes()
    try:
        stripped = drop_section(raw, "slirp")
    except StreamError as e:
        raise NetError(f"cannot drop the user-mode network state from {state}: {e}") from None
    if len(stripped) == len(raw):
        return state
    tmp = tap.with_name(tap.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(stripped)
    os.replace(tmp, tap)
    return tap


Isolation = Literal["auto", "required", "off"]
ISOLATIONS: tuple[str, ...] = ("auto", "required", "off")


def isolation_problems() -> list[str]:
    """Why sandbox namespaces cannot be made on this host (empty: they can)."""
    out = []
    if os.geteuid() != 0:
        out.append("needs root (network namespaces, veth pairs, nftables)")
    for tool in ("nft", "ip", "nsenter"):
        if shutil.which(tool) is None:
            out.append(f"{tool} not found (nftables, iproute2, util-linux: bash scripts/install.sh)")
    return out


def decide_mode(configured: str, isolation: str, tap_problems: list[str]) -> NetworkMode:
    """The mode a node configured ``configured`` runs in: "auto" is tap where the host
    has no ``tap_problems`` (tap_problems()) and isolation is not "off" (tap is always
    isolated), else user."""
    if configured == "auto":
        return "tap" if isolation != "off" and not tap_problems else "user"
    return "tap" if configured == "tap" else "user"


def decide_isolation(mode: str, isolation: str, problems: list[str]) -> bool:
    """Whether a node of network ``mode`` and ``[vm] isolation`` gives every sandbox a
    namespace, on a host with ``problems`` (isolation_problems()). NetError where the
    configuration cannot be met (tap, or "required", on a host that lacks something)."""
    if mode == "tap" and problems:
        raise NetError("[vm] network = \"tap\" cannot work here: " + "; ".join(problems))
    if problems and isolation == "required":
        raise NetError("[vm] isolation = \"required\" cannot be met here: " + "; ".join(problems))
    return mode == "tap" or (isolation != "off" and not problems)


def describe(mode: str, isolation: str, isolated: bool, why_not: list[str]) -> str:
    """What a node's networking isolates (the server's start line, ``aenv doctor``)."""
    if isolated:
        return (f"{mode} networking, one namespace per sandbox: guests reach no host address, node "
                f"service or other sandbox; egress by policy (DNS and hostname rules through the node)")
    if isolation == "off":
        return ("user networking WITHOUT isolation ([vm] isolation = \"off\"): guests reach every TCP port on "
                "the host's 127.0.0.1 -- development hosts only")
    return ("user networking without namespaces (" + "; ".join(why_not) +
            "): guests are restricted (restrict=on): no egress at all")


@dataclass(frozen=True)
class Attachment:
    """How one QEMU of a sandbox is networked (``NodeNetworks.attach``)."""
    host_port: int | None               # user mode: the host end of envd's forward (None: tap, no forwards)
    hostfwd_host: str = "127.0.0.1"     # where user-mode forwards listen (the namespace's address when isolated)
    netns: str | None = None            # the sandbox's network namespace (None: the node's own)
    tap: bool = False                   # a tap device in ``netns`` instead of QEMU's user-mode stack
    restrict: bool = False              # user mode without a namespace: QEMU's restrict=on (no egress)
    net: SandboxNet | None = None       # the namespace the node made (None: not isolated)

    def on(self, spec: VmSpec) -> VmSpec:
        """``spec`` networked this way (its other fields as they are)."""
        return dataclasses.replace(spec, host_port=self.host_port, hostfwd_host=self.hostfwd_host,
                                   netns=self.netns, tap=self.tap, net_restrict=self.restrict)


@dataclass(frozen=True)
class NetworkPlan:
    """How a node configured so networks its sandboxes on this host."""
    mode: NetworkMode
    isolated: bool              # a namespace per sandbox
    why_not: list[str]          # what keeps a user-mode node from isolating (empty when isolated)


def plan_network(configured: str, isolation: str) -> NetworkPlan:
    """The node's decision (``NodeNetworks.start``, ``aenv doctor``): the mode "auto"
    comes to and whether sandboxes get namespaces. NetError where ``configured`` and
    ``isolation`` cannot be met here."""
    problems = isolation_problems()
    tun = _tun_problems()
    mode = decide_mode(configured, isolation, problems + tun)
    if mode == "tap":
        problems += tun
    isolated = decide_isolation(mode, isolation, problems)
    return NetworkPlan(mode, isolated, [] if isolated else problems)


def node_addresses() -> list[ipaddress.IPv4Network]:
    """Every IPv4 address of this node's namespace (no sandbox may connect to one)."""
    from pyroute2 import IPRoute
    out = []
    with IPRoute() as ipr:
        for msg in ipr.get_addr(family=socket.AF_INET):
            addr = msg.get_attr("IFA_ADDRESS")
            if addr:
                out.append(ipaddress.IPv4Network(f"{addr}/32"))
    return out


class NodeNetworks:
    """The networks of one SandboxManager's sandboxes. Use within one event loop.

    ``isolated``: every sandbox has a namespace of its own (always in tap mode; in
    user mode when the host allows it and ``[vm] isolation`` is not "off"). Without
    one, a user-mode guest's gateway is the host's loopback, so it gets QEMU's
    ``restrict=on`` (no egress at all) unless isolation is "off" (the guest then
    reaches every TCP port on the host's 127.0.0.1: development hosts only)."""

    def __init__(self, mode: str, run_root: Path, isolation: str = "auto",
                 limits: EgressLimits = EgressLimits(), infrastructure: Sequence[InfraHost] = ()) -> None:
        """``infrastructure``: the fleet's services (infra.py), in every sandbox's never-reachable
        set beside the node's own addresses."""
        if mode not in MODES:
            raise NetError(f"network mode must be one of {', '.join(MODES)}, got {mode!r}")
        if isolation not in ISOLATIONS:
            raise NetError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        self.configured = mode
        self.mode: NetworkMode = "tap" if mode == "tap" else "user"   # "auto": decided in start()
        self.isolation = cast(Isolation, isolation)     # one of ISOLATIONS: checked above
        self.tag = netns.node_tag(run_root)
        self._nets: dict[str, SandboxNet] = {}
        self._policies: dict[str, NetworkPolicy] = {}
        self.isolated = False
        self.why_not: list[str] = []        # what keeps a user-mode node from isolating its sandboxes
        self.egress: EgressService | None = None
        self.limits = limits                # per sandbox, of the egress services (bounds.py)
        self.drops = Drops()                # what they turned away (the node's metrics)
        self._never: list[ipaddress.IPv4Network] = []
        self.infrastructure = tuple(infrastructure)
        self.infra_nets: list[ipaddress.IPv4Network] = []     # what it resolved to at start
        self.infra_warnings: list[str] = []

    @property
    def tap(self) -> bool:
        return self.mode == "tap"

    def describe(self) -> str:
        return describe(self.mode, self.isolation, self.isolated, self.why_not)

    async def start(self) -> None:
        """Decide the isolation (fail early and clearly where the configured one cannot be
        had), turn on the node's forwarding and masquerade for sandbox egress and start
        the egress services."""
        plan = plan_network(self.configured, self.isolation)
        self.mode, self.isolated, self.why_not = plan.mode, plan.isolated, plan.why_not
        if not self.isolated:
            return
        # before anything is enabled: a required entry that does not resolve stops the start
        self.infra_nets, self.infra_warnings = await asyncio.to_thread(infrastructure_nets, self.infrastructure)
        for w in self.infra_warnings:
            log.warning("%s", w)
        await asyncio.to_thread(netns.enable_host_egress)
        # no QEMU outlives its node: every namespace of this node's tag is a dead one's (a
        # node that was killed made them); a restarted node makes its sandboxes new ones
        try:
            gone = await asyncio.to_thread(netns.remove_orphans, self.tag, set())
        except NetError as e:       # never a reason not to start: new sandboxes get new names' /30s
            log.warning("network namespaces left by this node's last run: not all removed: %s", e)
        else:
            if gone:
                log.info("removed %d network namespaces left by this node's last run", len(gone))
        self._never = await asyncio.to_thread(node_addresses) + self.infra_nets
        upstream = dns.nameservers()
        if not upstream:
            log.warning("no IPv4 nameserver in /etc/resolv.conf: sandboxes will have no DNS")
        self.egress = EgressService(upstream, self._never, self.limits, self.drops)

    def can_apply(self, policy: NetworkPolicy) -> bool:
        """Whether a running sandbox of this node can be switched to ``policy`` (a pooled
        clone, made with the default one, handed out under it)."""
        return self.isolated or policy == NetworkPolicy()

    def _ruleset(self, net: SandboxNet, policy: NetworkPolicy) -> str:
        return rules.ruleset("tap" if net.tap else "user", policy, egress_ports(), self._never)

    async def attach(self, sid: str, policy: NetworkPolicy = NetworkPolicy(),
                     owner: int | None = None, *, user_mode: bool = False) -> Attachment:
        """Network sandbox ``sid`` under ``policy``: a namespace of its own (isolated), else
        a host port on 127.0.0.1 (user mode). ``owner``: the uid of the sandbox's confined
        QEMU, which may then open its tap device. ``user_mode``: QEMU's user-mode stack in
        the namespace even on a tap node (a template build VM: templates are frozen with
        user-mode devices, aenv_vm/machine)."""
        if not self.isolated:
            return Attachment(host_port=free_port(), restrict=self.isolation != "off" or not policy.internet)
        await self.release(sid)   # a namespace left by an earlier QEMU of this sandbox
        tap = self.tap and not user_mode
        net = await asyncio.to_thread(netns.create, self.tag, sid,  # blocking: subprocesses
                                      lambda n: self._ruleset(n, policy), None, tap, owner)
        try:
            assert self.egress is not None
            await self.egress.attach(sid, net.name, "0.0.0.0" if tap else "127.0.0.1", policy)
        except BaseException:
            await asyncio.to_thread(netns.destroy, net)
            raise
        self._nets[sid] = net
        self._policies[sid] = policy
        return self._attachment(net)

    @staticmethod
    def _attachment(net: SandboxNet) -> Attachment:
        if net.tap:
            return Attachment(host_port=None, netns=net.name, tap=True, net=net)
        return Attachment(host_port=ENVD_PORT, hostfwd_host=net.ns_ip, netns=net.name, net=net)

    async def attach_again(self, spec: VmSpec) -> Attachment:
        """The network of another QEMU for the same sandbox (a paused sandbox's standby):
        the namespace it already has, or a new host port (not isolated)."""
        if not self.isolated:
            return Attachment(host_port=free_port(), hostfwd_host=spec.hostfwd_host, tap=spec.tap,
                              restrict=spec.net_restrict)
        net = self._nets.get(spec.name)
        if net is None or spec.netns != net.name:
            raise NetError(f"sandbox {spec.name} has no network namespace any more")
        return self._attachment(net)

    async def abort_connections(self, sid: str) -> None:
        """The QEMU of ``sid`` was killed but its namespace stays (a pause keeps it for
        the standby): abort the host's TCP connections to the guest now. A killed QEMU
        sends no FIN on a tap, so a keep-alive connection the API proxy pooled, or a
        request in flight when the VM stopped, would otherwise stay open and, after the
        resume, carry a request into TCP state the restored guest no longer shares: the
        request hangs until the client's timeout. User mode needs nothing: QEMU's own
        sockets close with it."""
        net = self._nets.get(sid)
        if net is not None and net.tap:
            await asyncio.to_thread(netns.abort_host_sockets, net.ns_ip)

    def get(self, sid: str) -> SandboxNet | None:
        return self._nets.get(sid)

    async def apply(self, sid: str, policy: NetworkPolicy) -> None:
        """Put ``policy`` in force for the running sandbox ``sid`` at once (one nft
        transaction, then the egress proxy's view)."""
        net = self._nets.get(sid)
        if net is None:
            if policy != NetworkPolicy() and not self.isolated:
                raise Unsupported(f"egress rules need sandbox namespaces, which this node lacks: "
                                  f"{'; '.join(self.why_not) or 'isolation is off'}")
            return
        if self._policies.get(sid) == policy:
            return
        await asyncio.to_thread(netns.apply, net, self._ruleset(net, policy))
        self._policies[sid] = policy
        if self.egress is not None:
            self.egress.update(sid, policy)

    async def release(self, sid: str) -> None:
        """Remove ``sid``'s namespace (its veth and tap go with it) and its egress listeners.
        Idempotent; never raises (a leftover is removed at the next start)."""
        net = self._nets.pop(sid, None)
        self._policies.pop(sid, None)
        if self.egress is not None:
            await self.egress.detach(sid)
        if net is None:
            return
        try:
            await asyncio.to_thread(netns.destroy, net)
        except NetError as e:
            log.error("%s", e)

    async def device_state(self, state: Path) -> Path:
        return await asyncio.to_thread(device_state, state) if self.tap else state

    async def close(self) -> None:
        for sid in list(self._nets):
            await self.release(sid)
        if self.egress is not None:
            await self.egress.close()
