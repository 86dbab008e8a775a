"""One control group per QEMU: its CPU time, memory and number of tasks bounded.

Both kernel interfaces, chosen per controller from what the host mounts:

* **cgroup v2** (most production hosts): one hierarchy; the node's own cgroup
  must delegate ``cpu memory pids`` to its children (``cgroup.subtree_control``).
  A v2 cgroup with processes cannot delegate (the "no internal processes" rule),
  so a node alone in a non-root cgroup (a systemd service with ``Delegate=yes``)
  first moves itself into a leaf ``aenv-node`` beside the VMs' groups.
* **cgroup v1** (this development machine: see docs/security.md): one hierarchy
  per controller under ``/sys/fs/cgroup/<controller>``; the cgroup2 mount there
  has no controllers.

VM groups live under ``<the node's cgroup>/aenv/vm-<uid>-<n>`` in each
hierarchy, so they stay inside whatever bounds the node itself has. What to
write (``limit_files``) and where (``find_layout``) are pure functions of the
host's mount table, ``/proc/self/cgroup`` and the limits, tested for both
layouts; ``CgroupTree`` does the mkdir/write/rmdir.
"""
from __future__ import annotations

import enum
import errno
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ConfinementError

CONTROLLERS = ("cpu", "memory", "pids")
PARENT = "aenv"             # the VM groups' parent, under the node's own cgroup
NODE_LEAF = "aenv-node"     # v2: where a node moves itself so its cgroup may delegate
VM_PREFIX = "vm-"
CPU_PERIOD_US = 100_000
# a group's CPU weight file and its default: v1 cpu.shares 1024 (min 2), v2 cpu.weight 100 (min 1)
CPU_WEIGHT = {1: ("cpu.shares", 1024), 2: ("cpu.weight", 100)}


class Version(enum.IntEnum):
    V1 = 1
    V2 = 2


@dataclass(frozen=True)
class Limits:
    cpus: float                 # CPU time per period, in CPUs (the sandbox's vCPUs)
    memory_bytes: int           # guest RAM + the VMM's own memory
    pids: int                   # QEMU's threads (it may not fork under seccomp spawn=deny)
    period_us: int = CPU_PERIOD_US

    @property
    def quota_us(self) -> int:
        return max(1000, int(round(self.cpus * self.period_us)))


@dataclass(frozen=True)
class LimitFile:
    controller: str             # which controller's hierarchy the file is in
    name: str
    value: str


def limit_files(version: Version, limits: Limits, controllers: tuple[str, ...] = CONTROLLERS,
                memsw: bool = False, swap_max: bool = False) -> list[LimitFile]:
    """The files (in write order) that give a group ``limits``. ``memsw``: v1 swap
    accounting exists (memory+swap bounded like memory alone; written after
    ``memory.limit_in_bytes``, which it may not undercut); ``swap_max``: v2
    ``memory.swap.max`` exists (no swap for a VM's memory)."""
    out: list[LimitFile] = []
    if version is Version.V1:
        if "cpu" in controllers:
            out += [LimitFile("cpu", "cpu.cfs_period_us", str(limits.period_us)),
                    LimitFile("cpu", "cpu.cfs_quota_us", str(limits.quota_us))]
        if "memory" in controllers:
            out.append(LimitFile("memory", "memory.limit_in_bytes", str(limits.memory_bytes)))
            if memsw:
                out.append(LimitFile("memory", "memory.memsw.limit_in_bytes", str(limits.memory_bytes)))
        if "pids" in controllers:
            out.append(LimitFile("pids", "pids.max", str(limits.pids)))
        return out
    if "cpu" in controllers:
        out.append(LimitFile("cpu", "cpu.max", f"{limits.quota_us} {limits.period_us}"))
    if "memory" in controllers:
        out += [LimitFile("memory", "memory.max", str(limits.memory_bytes)),
                LimitFile("memory", "memory.oom.group", "1")]   # an OOM kills the whole QEMU
        if swap_max:
            out.append(LimitFile("memory", "memory.swap.max", "0"))
    if "pids" in controllers:
        out.append(LimitFile("pids", "pids.max", str(limits.pids)))
    return out


# ---------------------------------------------------------------- layout (pure)

@dataclass(frozen=True)
class Hierarchy:
    """One mounted hierarchy and where this node's groups go in it."""
    version: Version
    controllers: tuple[str, ...]    # the ones of CONTROLLERS it bounds
    mountpoint: Path
    node_dir: Path                  # the node's own cgroup in it

    @property
    def parent(self) -> Path:
        return self.node_dir / PARENT


@dataclass(frozen=True)
class Layout:
    hierarchies: tuple[Hierarchy, ...]

    @property
    def version(self) -> Version:
        return max(h.version for h in self.hierarchies)

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(c for c in CONTROLLERS if any(c in h.controllers for h in self.hierarchies))

    def describe(self) -> str:
        versions = sorted({h.version for h in self.hierarchies})
        return f"cgroup {'+'.join(f'v{v.value}' for v in versions)} ({', '.join(self.controllers)})"


@dataclass(frozen=True)
class MountEntry:
    fstype: str
    mountpoint: Path
    root: str                   # the mount's root within its filesystem (a bind of a sub-cgroup)
    super_options: tuple[str, ...]


def parse_mountinfo(text: str) -> list[MountEntry]:
    """The cgroup and cgroup2 mounts of a /proc/PID/mountinfo text."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        mountpoint = fields[4].replace("\\040", " ")
        out.append(MountEntry(rest[0], Path(mountpoint), fields[3], tuple(rest[2].split(","))))
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/PID/cgroup as {controller: path}; the v2 hierarchy's path is under ""."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, names, path = parts
        if names == "":
            out[""] = path
        for name in names.split(","):
            if name:
                out[name] = path
    return out


def _within(mount: MountEntry, path: str) -> Path:
    rel = path
    if mount.root not in ("/", "") and (path == mount.root or path.startswith(mount.root.rstrip("/") + "/")):
        rel = path[len(mount.root.rstrip("/")):]
    return mount.mountpoint / rel.lstrip("/")


def find_layout(mountinfo: str, proc_cgroup: str, v2_controllers: str | None) -> Layout | str:
    """Where each of CONTROLLERS is bounded: a v1 hierarchy mounted with it, else the
    v2 hierarchy if it has it (``v2_controllers``: the text of its root's
    ``cgroup.controllers``, None if unreadable). A string says why none is usable."""
    mounts = parse_mountinfo(mountinfo)
    own = parse_proc_cgroup(proc_cgroup)
    hierarchies: list[Hierarchy] = []
    covered: set[str] = set()
    seen: set[Path] = set()
    for m in mounts:
        if m.fstype != "cgroup" or m.mountpoint in seen:
            continue
        names = tuple(c for c in CONTROLLERS if c in m.super_options and c not in covered)
        if not names:
            continue
        path = own.get(names[0])
        if path is None:
            continue
        seen.add(m.mountpoint)
        covered.update(names)
        hierarchies.append(Hierarchy(Version.V1, names, m.mountpoint, _within(m, path)))
    missing = [c for c in CONTROLLERS if c not in covered]
    if missing:
        v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
        available = set((v2_controllers or "").split())
        names = tuple(c for c in missing if c in available)
        if v2 is not None and names and "" in own:
            hierarchies.append(Hierarchy(Version.V2, names, v2.mountpoint, _within(v2, own[""])))
            covered.update(names)
    if not hierarchies:
        if not mounts:
            return "no cgroup filesystem is mounted"
        return f"no mounted cgroup hierarchy has any of the {', '.join(CONTROLLERS)} controllers"
    missing = [c for c in CONTROLLERS if c not in covered]
    if missing:
        return f"no cgroup hierarchy has the {', '.join(missing)} controller" + ("s" if len(missing) > 1 else "")
    return Layout(tuple(hierarchies))


def host_layout() -> Layout | str:
    """``find_layout`` for this process."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError as e:
        return f"cannot read the cgroup mounts: {e}"
    v2_controllers = None
    for m in parse_mountinfo(mountinfo):
        if m.fstype == "cgroup2":
            try:
                v2_controllers = (m.mountpoint / "cgroup.controllers").read_text()
            except OSError:
                pass
            break
    return find_layout(mountinfo, proc_cgroup, v2_controllers)


def cpu_weight(full: int, share: float) -> int:
    """The weight file's value for ``share`` of ``full`` (a running sandbox's weight),
    never below 2 (v1's least; v2's is 1)."""
    if not share > 0:
        raise ValueError(f"a CPU share must be positive, not {share}")
    return max(2, round(full * min(share, 1.0)))


# ---------------------------------------------------------------- groups (I/O)

@dataclass(frozen=True)
class VmCgroup:
    """The groups of one QEMU (one directory per hierarchy)."""
    name: str
    dirs: tuple[Path, ...]
    cpu_weight_file: Path | None = None     # cpu.shares (v1) or cpu.weight (v2)
    cpu_weight_full: int = 0                # that file's default: a running sandbox's weight

    def set_cpu_share(self, share: float) -> None:
        """Give the QEMU ``share`` of a running sandbox's CPU weight (1.0: all of it).
        Each QEMU is alone in its group, so its nice value weighs only against its own
        threads; between QEMUs the groups' weights decide who runs under contention.
        Best effort: a group that is gone (its QEMU died) is no error."""
        if self.cpu_weight_file is None:
            return
        try:
            _write(self.cpu_weight_file, str(cpu_weight(self.cpu_weight_full, share)))
        except OSError:
            pass

    @property
    def procs_files(self) -> tuple[Path, ...]:
        """What the QEMU's child process writes "0" to, to join (before exec)."""
        return tuple(d / "cgroup.procs" for d in self.dirs)

    def attach(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the groups. ConfinementError if it
        cannot be moved (e.g. it is gone)."""
        for f in self.procs_files:
            try:
                _write(f, str(pid))
            except OSError as e:
                raise ConfinementError(f"moving pid {pid} into {f.parent}: {e.strerror or e}") from None

    def remove(self, wait: float = 0.5) -> bool:
        """rmdir every group (the QEMU is gone; its last tasks may take a moment to
        leave). False if one is still busy (the next ``sweep`` removes it)."""
        deadline = time.monotonic() + wait
        done = True
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        done = False
                        break
                    time.sleep(0.005)
        return done


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)     # cgroupfs ignores the truncation (as `echo >` does)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class CgroupTree:
    """The node's VM groups in every hierarchy of ``layout``."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def prepare(self) -> None:
        """Make the parents (and on v2 delegate the controllers); ConfinementError if
        the host does not let this node make groups."""
        for h in self.layout.hierarchies:
            try:
                if h.version is Version.V2:
                    _delegate_v2(h)
                h.parent.mkdir(exist_ok=True)
                if h.version is Version.V2:
                    _enable(h.parent, h.controllers)
            except OSError as e:
                raise ConfinementError(f"cannot make cgroups under {h.node_dir}: {e.strerror or e}") from None

    def create(self, uid: int, limits: Limits) -> VmCgroup:
        name = f"{VM_PREFIX}{uid}-{secrets.token_hex(3)}"
        dirs: list[Path] = []
        try:
            for h in self.layout.hierarchies:
                d = h.parent / name
                try:
                    d.mkdir()
                except FileNotFoundError:   # another node removed the empty parent meanwhile
                    self.prepare()
                    d.mkdir()
                dirs.append(d)
                for f in limit_files(h.version, limits, h.controllers,
                                     memsw=(d / "memory.memsw.limit_in_bytes").exists(),
                                     swap_max=(d / "memory.swap.max").exists()):
                    _write(d / f.name, f.value)
        except OSError as e:
            VmCgroup(name, tuple(dirs)).remove(wait=0)
            raise ConfinementError(f"cgroup {name}: {e.strerror or e}") from None
        weight: tuple[Path, int] | None = None
        for h, d in zip(self.layout.hierarchies, dirs):
            if "cpu" in h.controllers:
                fname, full = CPU_WEIGHT[int(h.version)]
                if (d / fname).exists():
                    weight = (d / fname, full)
        return VmCgroup(name, tuple(dirs), *(weight or (None, 0)))

    def sweep(self, leased: Callable[[int], bool] = lambda uid: False) -> int:
        """Remove VM groups nobody uses any more (their QEMU died with a crashed node).
        Groups with a task are busy and stay; so do empty ones whose uid is ``leased``
        (another node made the group and is about to move its QEMU in). Returns how
        many went."""
        n = 0
        for h in self.layout.hierarchies:
            try:
                entries = list(h.parent.iterdir())
            except OSError:
                continue
            for d in entries:
                uid = vm_group_uid(d.name)
                if uid is None or leased(uid) or not d.is_dir():
                    continue
                try:
                    d.rmdir()
                    n += 1
                except OSError:
                    pass
        return n

    def close(self, leased: Callable[[int], bool] = lambda uid: False) -> None:
        """Remove the parents if no group is left in them (other nodes' may be)."""
        self.sweep(leased)
        for h in self.layout.hierarchies:
            try:
                h.parent.rmdir()
            except OSError:
                pass


def vm_group_uid(name: str) -> int | None:
    """The uid in a VM group's name (``vm-<uid>-<hex>``); None for any other name."""
    parts = name.split("-")
    if len(parts) != 3 or parts[0] + "-" != VM_PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1])


def _enable(d: Path, controllers: tuple[str, ...]) -> None:
    have = set((d / "cgroup.subtree_control").read_text().split())
    want = [c for c in controllers if c not in have]
    if want:
        _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in want))


def _delegate_v2(h: Hierarchy) -> None:
    """The node's v2 cgroup must pass cpu/memory/pids down; a non-root cgroup holding
    processes cannot, so the node moves itself into a leaf first."""
    try:
        _enable(h.node_dir, h.controllers)
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    leaf = h.node_dir / NODE_LEAF
    leaf.mkdir(exist_ok=True)
    _write(leaf / "cgroup.procs", "0")
    _enable(h.node_dir, h.controllers)   # still EBUSY when other processes share it: the node's setup
