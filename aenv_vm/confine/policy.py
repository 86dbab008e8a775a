"""The node's confinement policy: ``[vm] confine = "auto" | "required" | "off"``.

``probe_host`` finds out what this host lets the node do to a QEMU (each part
on, or why not); ``Confinement`` applies the configured level over it:

* ``auto`` (default): every part the host allows, the others off and said so
  (``parts``: the server's start line, ``aenv doctor``);
* ``required``: ``start`` raises ConfinementError naming every part that
  cannot be applied, so no QEMU starts less confined than configured;
* ``off``: QEMUs run as the node does (root, all capabilities, the host's
  filesystem, no limits) — for debugging only.

The parts: a uid of its own per sandbox (uids.py), which also takes every
capability away; ``no_new_privs``; seccomp: QEMU's own filter and the node's
allow-list of its system calls (syscall_filter.py); its own mount
namespace and root (jail.py); a cgroup bounding CPU, memory and tasks
(cgroups.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from .cgroups import CgroupTree, Layout, host_layout
from .errors import ConfinementError
from ..childenv import ChildKind, child_env
from ..qemu.binary import find_qemu, qemu_version
from .jail import DEFAULT_ROOT, SECCOMP, Jail, probe_mount_namespace, probe_user_namespace
from .romem import ROM_OFF_QEMU, ReadonlyRam, build_shim
from .syscall_filter import CompiledFilter, Mode
from .uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT, UidLeases

STATE_DIR = Path("/run/aenv")       # host-wide: uid leases, the jail's mount point, the shim
PARTS = ("user", "capabilities", "no_new_privs", "seccomp", "mount namespace", "cgroup", "user namespace")


class Level(str, enum.Enum):
    AUTO = "auto"
    REQUIRED = "required"
    OFF = "off"


@dataclass(frozen=True)
class Part:
    name: str           # one of PARTS
    on: bool
    detail: str         # what it does here, or why it is off


@dataclass(frozen=True)
class HostSupport:
    """What this host allows, part by part (None: possible; a string: why not)."""
    root: bool
    seccomp: str | None
    mount_ns: str | None
    user: str | None
    cgroup: Layout | str
    readonly_ram: ReadonlyRam
    shim: Path | None
    cap_last: int
    syscalls: CompiledFilter | str | None = None   # the allow-list built here, why not, or None (mode qemu)
    user_ns: str | None = "not probed"              # None: a user namespace per QEMU works here


@functools.lru_cache(maxsize=8)
def _qemu_seccomp(qemu: str, mtime_ns: int) -> str | None:
    """Whether this QEMU build runs with the filter (a fact of the binary: cached)."""
    try:
        done = subprocess.run([qemu, "-sandbox", SECCOMP, "-machine", "none", "-nodefaults", "-display", "none",
                               "-qmp", "stdio"], input=b'{"execute":"qmp_capabilities"}\n{"execute":"quit"}\n',
                              capture_output=True, timeout=20, env=child_env(ChildKind.QEMU))
    except (OSError, subprocess.SubprocessError) as e:
        return f"{qemu} could not be run: {e}"
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines() or [f"exit code {done.returncode}"]
        return f"QEMU refuses -sandbox: {lines[-1]}"
    return None


def probe_host(qemu: Path, state_dir: Path = STATE_DIR, seccomp_mode: Mode = Mode.ALLOW_LIST,
               probe_uid: int = DEFAULT_UID_BASE) -> HostSupport:
    """Find out which parts of confinement this host allows (~50 ms; the QEMU run is cached)."""
    root = os.geteuid() == 0
    status = Path("/proc/self/status").read_text()
    seccomp = _qemu_seccomp(str(qemu), qemu.stat().st_mtime_ns) if "Seccomp:" in status else \
        "the kernel has no seccomp"
    jail_root = state_dir / DEFAULT_ROOT.name
    if root:
        jail_root.mkdir(parents=True, exist_ok=True)
        mount_ns = probe_mount_namespace(jail_root)
    else:
        mount_ns = "needs root (mount namespaces are made by the node)"
    # The shim first, on every QEMU: QEMU >= 8.2's readonly=on,rom=off also keeps the file
    # read-only, but QEMU then refuses to discard that RAM at all, and a clone's guest
    # could no longer give memory back (free page reporting, romem.py).
    shim: Path | None = None
    user: str | None = None
    try:
        shim = build_shim(state_dir / "lib")
        readonly = ReadonlyRam.PRELOAD
    except (ConfinementError, OSError) as e:
        if qemu_version(qemu) >= ROM_OFF_QEMU:
            readonly = ReadonlyRam.ROM_OFF
        else:
            readonly = ReadonlyRam.NONE
            user = f"QEMU < 8.2 opens the template memory file read-write and the read-only shim is missing: {e}"
    if not root:
        user = "needs root (the node runs as uid %d: QEMUs run as the node does)" % os.geteuid()
    layout: Layout | str = host_layout()
    if isinstance(layout, Layout):
        try:
            CgroupTree(layout).prepare()
        except ConfinementError as e:
            layout = str(e)
    try:
        cap_last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        cap_last = 40
    syscalls: CompiledFilter | str | None = None
    if seccomp_mode is not Mode.QEMU:
        try:
            syscalls = CompiledFilter.build(seccomp_mode) if "Seccomp:" in status else "the kernel has no seccomp"
        except ConfinementError as e:
            syscalls = str(e)
    user_ns = probe_user_namespace(probe_uid) if user is None else "needs the uid part (a uid of its own to map)"
    return HostSupport(root, seccomp, mount_ns, user, layout, readonly, shim, cap_last, syscalls, user_ns)


class Confinement:
    """The confinement of one node's QEMUs. ``start`` probes the host (and raises when
    ``required`` cannot be met); ``jail(sandbox)`` leases the sandbox a uid and gives
    the ``Jail`` its QEMUs run in until ``release``. Use from one event loop."""

    def __init__(self, level: Level | str = Level.AUTO, *, qemu: Path | None = None, state_dir: Path = STATE_DIR,
                 uid_base: int = DEFAULT_UID_BASE, uid_count: int = DEFAULT_UID_COUNT, vmm_mib: int = 64,
                 tcg_tb_mib: int = 128, pids: int = 256, cpu_extra: float = 0.0,
                 seccomp: Mode | str = Mode.ALLOW_LIST) -> None:
        try:
            self.level = Level(level)
        except ValueError:
            raise ConfinementError(f"confinement level must be auto, required or off, got {level!r}") from None
        try:
            self.seccomp_mode = Mode(seccomp)
        except ValueError:
            raise ConfinementError(f"the syscall filter mode must be allow-list, log or qemu, got {seccomp!r}") from None
        self.qemu = qemu
        self.state_dir = state_dir
        self.vmm_mib = vmm_mib
        self.tcg_tb_mib = tcg_tb_mib
        self.pids = pids
        self.cpu_extra = cpu_extra
        self.support: HostSupport | None = None
        self._leases = UidLeases(state_dir / "uids", uid_base, uid_count)
        self._cgroups: CgroupTree | None = None
        self._jails: dict[str, Jail] = {}

    @classmethod
    def off(cls) -> "Confinement":
        return cls(Level.OFF)

    def start(self) -> None:
        """Probe the host once; ConfinementError if ``required`` cannot be met."""
        if self.support is not None or self.level is Level.OFF:
            return
        self.support = probe_host(self.qemu or find_qemu(), self.state_dir, self.seccomp_mode, self._leases.first)
        if isinstance(self.support.cgroup, Layout):
            self._cgroups = CgroupTree(self.support.cgroup)
            self._cgroups.sweep(self._leases.leased)   # groups a crashed node left
        if self.level is Level.REQUIRED:
            off = [f"{p.name}: {p.detail}" for p in self.parts() if not p.on]
            if off:
                raise ConfinementError("[vm] confine = \"required\" cannot be met on this host: " + "; ".join(off))

    @property
    def enabled(self) -> bool:
        return self.level is not Level.OFF

    @property
    def qemu_walks_host_paths(self) -> bool:
        """QEMUs run under uids of their own but without a mount namespace: they reach
        their files through the host's own directories (the data dir must let them pass)."""
        s = self.support
        return self.enabled and s is not None and s.user is None and s.mount_ns is not None

    def parts(self) -> list[Part]:
        """Each part of confinement: on here or not, and why."""
        if self.level is Level.OFF:
            return [Part(n, False, "[vm] confine = \"off\"") for n in PARTS]
        s = self.support
        if s is None:
            raise ConfinementError("Confinement.start() was not called")
        user_on = s.user is None
        first = self._leases.first
        ram = {ReadonlyRam.ROM_OFF: "memory files mapped readonly=on,rom=off (no shim: clones return no memory)",
               ReadonlyRam.PRELOAD: "template memory opened read-only (LD_PRELOAD shim)",
               ReadonlyRam.NONE: ""}[s.readonly_ram]
        parts = [
            Part("user", user_on, f"one uid per sandbox from {first} ({self._leases.count} leasable); {ram}"
                 if user_on else str(s.user)),
            Part("capabilities", user_on, "none (bounding set dropped too)" if user_on else
                 "kept: QEMU runs as root" if s.root else "the node's own"),
            Part("no_new_privs", True, "set before exec"),
            self._seccomp_part(s),
            Part("mount namespace", s.mount_ns is None,
                 "own root: /usr, its run dir, memory file, kernel, sockets, device nodes"
                 if s.mount_ns is None else s.mount_ns),
            Part("cgroup", isinstance(s.cgroup, Layout),
                 (s.cgroup.describe() + f": CPU = vCPUs{f' + {self.cpu_extra:g}' if self.cpu_extra else ''}, "
                  f"memory = guest + TCG code buffer (default {self.tcg_tb_mib} MiB) + {self.vmm_mib} MiB, "
                  f"tasks = {self.pids} + vCPUs")
                 if isinstance(s.cgroup, Layout) else str(s.cgroup)),
            Part("user namespace", s.user_ns is None, "its own, mapping only its uid and gid"
                 if s.user_ns is None else s.user_ns),
        ]
        return parts

    def _seccomp_part(self, s: HostSupport) -> Part:
        """On when QEMU's -sandbox applies and so does the allow-list (unless
        ``[vm] confine_seccomp = "qemu"`` leaves QEMU's filter alone)."""
        if s.seccomp is not None:
            return Part("seccomp", False, s.seccomp)
        own = "-sandbox " + SECCOMP
        if isinstance(s.syscalls, str):
            return Part("seccomp", False, f"QEMU's {own} only: the syscall allow-list cannot apply: {s.syscalls}")
        if s.syscalls is None:
            return Part("seccomp", True, f"{own} only ([vm] confine_seccomp = \"qemu\")")
        calls = len(s.syscalls.allowed)
        if s.syscalls.mode is Mode.LOG:
            return Part("seccomp", True, f"{own}; syscalls outside the allow-list of {calls} logged, not refused "
                                         "([vm] confine_seccomp = \"log\")")
        return Part("seccomp", True, f"{own}; an allow-list of {calls} syscalls, every other one refused")

    def summary(self) -> str:
        """One line: the level, what is on, what is off (the server's start line)."""
        if self.level is Level.OFF:
            return "off ([vm] confine = \"off\"): QEMU runs as root with the host's filesystem and no limits"
        parts = self.parts()
        on = [p.name for p in parts if p.on]
        off = [f"{p.name} ({p.detail})" for p in parts if not p.on]
        cg = next(p for p in parts if p.name == "cgroup")
        text = f"{self.level.value}: " + ", ".join(on) if on else f"{self.level.value}: nothing"
        if cg.on and self.support is not None and isinstance(self.support.cgroup, Layout):
            text += f" [{self.support.cgroup.describe()}]"
        return text + ("; off: " + "; ".join(off) if off else "")

    def qemu_uids(self) -> range:
        """The uids this node's confined QEMUs may run as (the leased range)."""
        return range(self._leases.first, self._leases.first + self._leases.count)

    def jail(self, holder: str) -> Jail | None:
        """The jail of sandbox ``holder`` (the same until ``release``); None when off."""
        if self.level is Level.OFF:
            return None
        if self.support is None:
            self.start()
        s = self.support
        assert s is not None
        j = self._jails.get(holder)
        if j is not None:
            return j
        uid = self._leases.acquire() if s.user is None else None
        syscalls = s.syscalls if isinstance(s.syscalls, CompiledFilter) else None
        j = Jail(uid=uid, gid=uid, seccomp=s.seccomp is None, mount_ns=s.mount_ns is None, cgroups=self._cgroups,
                 readonly_ram=s.readonly_ram if uid is not None else ReadonlyRam.NONE,
                 shim=s.shim if uid is not None else None, root_dir=self.state_dir / DEFAULT_ROOT.name,
                 vmm_mib=self.vmm_mib, tcg_tb_mib=self.tcg_tb_mib, pids=self.pids, cpu_extra=self.cpu_extra,
                 cap_last=s.cap_last if uid is not None else -1, syscalls=syscalls,
                 user_ns=uid is not None and s.user_ns is None)
        self._jails[holder] = j
        return j

    def release(self, holder: str) -> None:
        """``holder`` has no QEMU on this node any more: its uid goes back."""
        j = self._jails.pop(holder, None)
        if j is not None and j.uid is not None:
            self._leases.release(j.uid)

    def close(self) -> None:
        for holder in list(self._jails):
            self.release(holder)
        self._leases.close()
        if self._cgroups is not None:
            self._cgroups.close(self._leases.leased)


@contextlib.asynccontextmanager
async def jail_for(confinement: Confinement | None, holder: str) -> AsyncIterator[Jail | None]:
    """The jail of one QEMU outside a sandbox (a template build, the accelerator probe):
    from ``confinement``, or from an ``auto`` policy of its own when None."""
    own = confinement is None
    c = Confinement() if confinement is None else confinement
    try:
        await asyncio.to_thread(c.start)
        yield c.jail(holder)
    finally:
        c.release(holder)
        if own:
            c.close()
