"""One network namespace per sandbox: the unit that isolates its network.

Every clone of a snapshot wakes up with the same guest address (10.0.2.15/24,
gateway 10.0.2.2) and the same MAC, so each sandbox gets its own namespace in
which that is the only guest::

    node ── veth <host_if> 10.201.a.b+1/30 ══ eth0 10.201.a.b+2/30 ── [netns aenv-<tag>-<id>]
          tap mode:   tap0 10.0.2.2/24 ── QEMU ── guest 10.0.2.15
          user mode:  QEMU's user-mode network (its sockets live here) ── guest 10.0.2.15

The node reaches the guest at ``<ns_ip>``: in tap mode nftables DNATs every TCP
connection that arrives on eth0 to the guest (any port); in user mode QEMU's
host forwards listen on ``<ns_ip>`` (``SandboxNet.endpoint``). tap0 carries the
MAC of user-mode networking's gateway (52:55:0a:00:02:02), so the neighbour
entry a guest restored from a template made in user mode already holds for
10.0.2.2 stays right. What the guest may reach is the namespace's nftables
table (rules.py, from the sandbox's policy): replaced atomically by ``apply``.
Internet access beyond the node needs the node's own forwarding and masquerade
for 10.201.0.0/16 (``enable_host_egress``).

QEMU joins the namespace itself: ``VmSpec.netns`` makes the launcher
``setns`` between fork and exec (aenv_vm/qemu/launcher.py). Links, addresses
and routes are made with ``ip -batch`` (one process on each side), nftables
rules with the ``nft`` tool inside the namespace. ``destroy`` removes the veth pair and
the namespace (which takes the tap with it); ``remove_orphans`` removes every
namespace of this node's tag that no live sandbox owns (after a restart).

Synchronous (subprocesses, and pyroute2's API runs its own event loop), so from
asyncio code call these functions in a worker thread (``asyncio.to_thread``).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..childenv import child_env
from ..errors import VmError
from ..qemu.launcher import GUEST_IP, GUEST_MAC

TAP_ADDR = "10.0.2.2"
SLIRP_DNS = "10.0.2.3"          # the resolver user-mode networking gives guests
TAP_MAC = "52:55:0a:00:02:02"   # QEMU slirp's gateway MAC (what template guests have cached)
NETNS_DIR = Path("/run/netns")
MAX_INDEX = 16384           # 10.201.0.0/16 in /30s
LOCK_PATH = "/run/aenv-netns.lock"


class NetError(VmError):
    """A sandbox network namespace could not be made or removed."""


@dataclass(frozen=True)
class SandboxNet:
    name: str               # network namespace
    index: int
    host_if: str
    host_ip: str
    ns_ip: str
    tap: bool = True        # a tap device for QEMU (tap mode), or QEMU's user-mode network inside

    @property
    def envd_host(self) -> str:
        return self.ns_ip


def node_tag(run_root: Path) -> str:
    """A short tag per node run directory, so two nodes on one host never touch
    each other's namespaces."""
    return hashlib.blake2s(str(run_root.resolve()).encode(), digest_size=2).hexdigest()


def addresses(index: int) -> tuple[str, str]:
    if not 0 <= index < MAX_INDEX:
        raise NetError(f"sandbox network index {index} out of range 0..{MAX_INDEX - 1}")
    base = index * 4
    a, b = base >> 8, base & 255
    return f"10.201.{a}.{b + 1}", f"10.201.{a}.{b + 2}"


def _run(argv: list[str], stdin: str, failure: str, pass_fds: tuple[int, ...] = ()) -> None:
    """Run ``argv`` with ``stdin``; NetError ``failure: <its stderr>`` if it fails."""
    done = subprocess.run(argv, input=stdin, text=True, capture_output=True, timeout=30, pass_fds=pass_fds,
                          env=child_env())
    if done.returncode != 0:
        raise NetError(f"{failure}: {done.stderr.strip()}")


def _nsenter(name: str, argv: list[str], stdin: str, pass_fds: tuple[int, ...] = ()) -> None:
    _run(["nsenter", f"--net={NETNS_DIR / name}", "--", *argv], stdin, f"{' '.join(argv)} in netns {name} failed",
         pass_fds)


def _require_tools() -> None:
    for tool in ("nsenter", "nft", "ip"):
        if shutil.which(tool) is None:
            raise NetError(f"{tool} not found: sandbox namespaces need iproute2, util-linux and nftables "
                           "(scripts/install.sh)")


def used_indexes() -> set[int]:
    """Indexes whose /30 already has an address on the host (any node's, or a leftover)."""
    from pyroute2 import IPRoute
    out = set()
    with IPRoute() as ipr:
        for msg in ipr.get_addr(family=socket.AF_INET):
            addr = msg.get_attr("IFA_ADDRESS") or ""
            parts = addr.split(".")
            if len(parts) == 4 and parts[0] == "10" and parts[1] == "201":
                out.add((int(parts[2]) * 256 + int(parts[3])) // 4)
    return out


def create(tag: str, sid: str, ruleset: Callable[[SandboxNet], str], index: int | None = None,
           tap: bool = True, owner: int | None = None) -> SandboxNet:
    """The namespace, veth pair, tap device (``tap``) and nftables table of one sandbox
    (``ruleset(net)``: rules.py). ``index`` picks its /30 in 10.201.0.0/16; None takes
    the lowest one free on this host (under a host-wide lock, so concurrent nodes never
    pick the same). The lock is held only until the /30 is claimed (its host address
    added); the namespace side is set up after, so concurrent creates (a fork's
    children) overlap there. ``owner``: the uid (and gid) that may open ``tap0``
    without CAP_NET_ADMIN, a confined QEMU's (aenv_vm/confine)."""
    _require_tools()
    with open(LOCK_PATH, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if index is None:
            used = used_indexes()
            index = next((i for i in range(MAX_INDEX) if i not in used), None)
            if index is None:
                raise NetError("no free sandbox network left in 10.201.0.0/16")
        elif index in used_indexes():
            raise NetError(f"sandbox network {addresses(index)[0]}/30 is already in use on this host")
        return _create(tag, sid, index, tap, ruleset, claimed=lambda: fcntl.flock(lock, fcntl.LOCK_UN), owner=owner)


def _create(tag: str, sid: str, index: int, tap: bool, ruleset: Callable[[SandboxNet], str],
            claimed: Callable[[], None], owner: int | None = None) -> SandboxNet:
    host_ip, ns_ip = addresses(index)
    net = SandboxNet(name=f"aenv-{tag}-{sid[-12:]}", index=index, host_if=f"ae{tag}{index:x}"[:15],
                     host_ip=host_ip, ns_ip=ns_ip, tap=tap)
    # Two processes: ip(8) in batch mode on the node's side, then one in the namespace
    # for the links, its forwarding switch and the nftables table (pyroute2 took ~25 ms
    # of Python per namespace for the same netlink calls; each process costs ~3 ms)
    host = (f"netns add {net.name}\n"
            f"link add {net.host_if} type veth peer name eth0 netns {net.name}\n"
            f"addr add {host_ip}/30 dev {net.host_if}\n"
            f"link set {net.host_if} up\n")
    inside = ("link set lo up\n"
              f"addr add {ns_ip}/30 dev eth0\n"
              "link set eth0 up\n"
              f"route add default via {host_ip}\n")
    if tap:
        who = "" if owner is None else f" user {owner} group {owner}"
        inside += (f"tuntap add dev tap0 mode tap{who}\n"
                   f"link set tap0 address {TAP_MAC}\n"
                   f"addr add {TAP_ADDR}/24 dev tap0\n"
                   # 10.0.2.3 answers the guest's ARP on tap0, so its DNS queries are sent (then redirected)
                   f"addr add {SLIRP_DNS}/32 dev tap0\n"
                   "link set tap0 up\n"
                   # the guest's MAC is known (every clone's is its template's): no ARP
                   # round trip to a guest that answers slowly under TCG on the first connection
                   f"neigh replace {GUEST_IP} lladdr {GUEST_MAC} dev tap0 nud permanent\n")
    try:
        _run(["ip", "-batch", "-"], host, f"creating the network of {sid} failed: ip")
        claimed()   # the /30 has its host address: others see it as used
        # the ip batch reaches nft through a file descriptor, nft reads the rules on stdin
        r, w = os.pipe()
        try:
            os.write(w, inside.encode())   # a few hundred bytes: within the pipe's buffer
            os.close(w)
            w = -1
            _nsenter(net.name, ["sh", "-c", f"ip -batch /dev/fd/{r} && sysctl -q -w net.ipv4.ip_forward={int(tap)}"
                                            " && exec nft -f -"], ruleset(net), pass_fds=(r,))
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
    except BaseException as e:
        destroy(net)
        if isinstance(e, NetError):
            raise
        if isinstance(e, Exception):
            raise NetError(f"creating the network of {sid} failed: {e}") from None
        raise
    return net


def apply(net: SandboxNet, ruleset: str) -> None:
    """Replace the namespace's nftables table in one transaction (the guest keeps running)."""
    _nsenter(net.name, ["nft", "-f", "-"], ruleset)


def destroy(net: SandboxNet | str) -> None:
    """Remove a sandbox's namespace and everything in it. Idempotent.

    The veth pair goes by its end inside the namespace (``eth0``), never by the host
    end's name: that name is the /30's (``ae<tag><index>``), and once this sandbox's
    /30 is free a new sandbox may hold it, so a late or repeated destroy by name would
    remove the newcomer's link. Deleting ``eth0`` now rather than leaving the pair to
    the namespace's teardown (which the kernel runs asynchronously) frees the /30 at
    once. The host's sockets to the guest are aborted first, while the address is
    still this sandbox's."""
    name = net if isinstance(net, str) else net.name
    if not (NETNS_DIR / name).exists():
        return
    if not isinstance(net, str):
        abort_host_sockets(net.ns_ip)
    # one ip(8) process in the namespace; netns del works on /run/netns, from any namespace
    done = subprocess.run(["ip", "-n", name, "-force", "-batch", "-"], input=f"link del dev eth0\nnetns del {name}\n",
                          text=True, capture_output=True, timeout=30, env=child_env())
    failed = [line for line in done.stderr.splitlines()
              if line.strip() and "Cannot find device" not in line and "Command failed" not in line
              and "Cannot open network namespace" not in line]   # removed meanwhile
    if done.returncode != 0 and failed:
        raise NetError(f"removing netns {name} failed: {'; '.join(failed)}")


def abort_host_sockets(ns_ip: str) -> None:
    """Abort this host's TCP sockets to a sandbox's address whose guest vanished (its
    namespace removed, or its QEMU killed at a pause while the namespace stays for the
    standby): the guest went without a FIN, so a keep-alive connection (the API proxy
    pools them) would stay open and carry a request to whatever answers that address
    next (a new sandbox on the /30, or the resumed guest's stale TCP state): a failed
    or hung request. ``ss -K`` (sock_destroy) closes them now. Best
    effort: a kernel without CONFIG_INET_DIAG_DESTROY leaves them to the keep-alive timeout."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["ss", "-K", "-t", "dst", ns_ip], capture_output=True, timeout=10, env=child_env())


def list_namespaces(tag: str) -> list[str]:
    prefix = f"aenv-{tag}-"
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_orphans(tag: str, keep: set[str]) -> list[str]:
    """Remove this node's namespaces that no live sandbox owns; returns their names. A
    name whose namespace is gone already (its bind mount was made in a mount namespace
    that died with the node that made it, e.g. one run under ``ip netns exec``) is only
    an empty file: it is unlinked."""
    gone = []
    for n in list_namespaces(tag):
        if n in keep:
            continue
        path = NETNS_DIR / n
        if os.path.ismount(path):
            if _has_processes(n):       # a QEMU still in it is no orphan's (whoever runs it)
                continue
            destroy(n)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        gone.append(n)
    return gone


def _has_processes(name: str) -> bool:
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30,
                          env=child_env())
    return bool(done.stdout.split())


def enable_host_egress(outbound_if: str | None = None) -> None:
    """Host side of internet access: forwarding on, sandbox traffic masqueraded."""
    _require_tools()
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    rule = f'oifname "{outbound_if}" ' if outbound_if else 'oifname != "ae*" '
    script = ("table ip aenv_host {\n  chain post {\n    type nat hook postrouting priority 100; policy accept;\n"
              f"    ip saddr 10.201.0.0/16 {rule}masquerade\n  }}\n}}\n")
    _run(["nft", "-f", "-"], "add table ip aenv_host\ndelete table ip aenv_host\n" + script, "host egress rules failed")
