"""How one node's sandboxes are networked: ``[vm] network = "user" | "tap"``.

* ``user`` (default, works anywhere, no root): QEMU's user-mode network with a
  host port forwarded to envd (``hostfwd``); other guest ports are forwarded on
  demand with QMP ``hostfwd_add`` (``Sandbox.endpoint``). Egress off is QEMU's
  ``restrict=on``, fixed when QEMU starts (so such a create skips the pool).
* ``tap`` (needs root, nftables, iproute2): every sandbox's QEMU runs in its own
  network namespace (netns.py) with the same guest IP/MAC; the host reaches any
  guest TCP port at the namespace's veth address; egress is on or off per
  sandbox (``allow_internet_access``).

``NodeNetworks`` is the manager's view: it makes a sandbox's network before its
QEMU starts (``attach`` → the ``VmSpec`` fields to use), remembers it by
sandbox id, and removes it (``release``) when the QEMU that used it is gone.
Templates are saved from user-mode VMs: their device state has a ``slirp``
section that a VM on a tap device cannot load, so ``device_state`` gives tap
VMs a copy without it (made once per file, next to it).
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..qemu.launcher import free_port
from . import netns
from .netns import NetError, SandboxNet

if TYPE_CHECKING:
    from ..qemu.launcher import VmSpec

log = logging.getLogger(__name__)

NetworkMode = Literal["user", "tap"]
MODES: tuple[str, ...] = ("user", "tap")
TAP_STATE_SUFFIX = ".tap"


def tap_problems() -> list[str]:
    """Why tap mode cannot work on this host (empty: it can). Cheap: no namespace is made."""
    out = []
    if os.geteuid() != 0:
        out.append("needs root (network namespaces, veth and tap devices)")
    for tool in ("nft", "ip", "nsenter"):
        if shutil.which(tool) is None:
            out.append(f"{tool} not found (nftables, iproute2, util-linux: bash scripts/install.sh)")
    if not Path("/dev/net/tun").exists():
        out.append("/dev/net/tun missing (tun module)")
    return out


def probe_tap(run_root: Path) -> None:
    """Make and remove one namespace of the real kind (veth, tap, nft rules). NetError if it fails."""
    problems = tap_problems()
    if problems:
        raise NetError("tap networking cannot work here: " + "; ".join(problems))
    net = netns.create(netns.node_tag(run_root), f"probe-{os.getpid():x}")
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
    tmp = tap.with_name(tap.name + f".tmp-{os.getpid()}")
    tmp.write_bytes(stripped)
    os.replace(tmp, tap)
    return tap


class NodeNetworks:
    """The networks of one SandboxManager's sandboxes. Use within one event loop."""

    def __init__(self, mode: str, run_root: Path) -> None:
        if mode not in MODES:
            raise NetError(f"network mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode: NetworkMode = mode  # type: ignore[assignment]
        self.tag = netns.node_tag(run_root)
        self._nets: dict[str, SandboxNet] = {}
        self.dns: str | None = None     # tap: the host nameserver guests' 10.0.2.3 is sent to

    @property
    def tap(self) -> bool:
        return self.mode == "tap"

    async def start(self) -> None:
        """Tap mode: fail early and clearly if the host cannot do it; turn on the host's
        forwarding and masquerade for sandbox egress (internet beyond the host)."""
        if not self.tap:
            return
        problems = tap_problems()
        if problems:
            raise NetError("[vm] network = \"tap\" cannot work here: " + "; ".join(problems))
        await asyncio.to_thread(netns.enable_host_egress)
        self.dns = netns.host_nameserver()
        if self.dns is None:
            log.warning("tap networking: no IPv4 nameserver a namespace can reach in /etc/resolv.conf; "
                        "guests will have no DNS")

    async def attach(self, sid: str, egress: bool = True, owner: int | None = None) -> dict[str, object]:
        """The ``VmSpec`` fields that network sandbox ``sid``: a free host port (user), or
        a new namespace (tap) with ``egress`` on or off whose tap device uid ``owner``
        (the sandbox's confined QEMU) may open."""
        if not self.tap:
            return {"host_port": free_port(), "netns": None, "net_restrict": not egress}
        await self.release(sid)   # a namespace left by an earlier QEMU of this sandbox
        net = await asyncio.to_thread(netns.create, self.tag, sid, None, egress, self.dns, owner)  # pyroute2: own loop
        self._nets[sid] = net
        return {"host_port": None, "netns": net.name}

    async def attach_again(self, spec: "VmSpec") -> dict[str, object]:
        """The network fields of another QEMU for the same sandbox (a paused sandbox's
        standby): a new host port (user), or the namespace it already has (tap)."""
        if not self.tap:
            return {"host_port": free_port(), "netns": None}
        net = self._nets.get(spec.name)
        if net is None or spec.netns != net.name:
            raise NetError(f"sandbox {spec.name} has no network namespace any more")
        return {"host_port": None, "netns": net.name}

    def get(self, sid: str) -> SandboxNet | None:
        return self._nets.get(sid)

    async def set_egress(self, sid: str, egress: bool) -> None:
        net = self._nets.get(sid)
        if net is not None and net.egress != egress:
            self._nets[sid] = await asyncio.to_thread(netns.set_egress, net, egress)

    async def release(self, sid: str) -> None:
        """Remove ``sid``'s namespace (its veth and tap go with it). Idempotent; never raises
        (a leftover is removed at the next start by ``remove_orphans``)."""
        net = self._nets.pop(sid, None)
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
