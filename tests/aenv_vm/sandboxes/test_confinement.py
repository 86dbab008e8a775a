"""Every QEMU the node starts is confined (issue 13, acceptance 3), checked from the
host through /proc: a template-build VM, pooled and fresh clones, a pool refill, a
paused sandbox's standby QEMU and the resume that uses it, a resume that starts a
fresh QEMU, a fork child, and the accelerator probe's spec. And a guest fork bomb
and a guest filling its disk leave the node and another sandbox working."""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aenv_vm.confine.cgroups import Layout, cpu_weight, host_layout
from aenv_vm.machine import bringup, cpushare
from aenv_vm.sandboxes import pool as pool_module
from aenv_vm.confine.policy import Confinement
from aenv_vm.confine.syscall_filter import Mode
from aenv_vm.qemu.accel import probe_accel
from aenv_vm.qemu.launcher import QemuProcess, VmSpec, tcg_buffer_mib
from aenv_vm.sandboxes.manager import SandboxManager
from aenv_vm.sandboxes.sandbox import Sandbox
from aenv_vm.sandboxes.node_service import read_console
from aenv_vm.templates.base import build_template

from tests.support import small_tmpfs

from .conftest import Env

pytestmark = pytest.mark.qemu

STATUS_KEYS = ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp",
               "Seccomp_filters")


@dataclass
class Seen:
    """One QEMU as the host saw it right after it started."""
    label: str
    spec: VmSpec
    pid: int
    status: dict[str, str]
    own_mount_ns: bool
    root_entries: list[str]
    mountpoints: list[str]
    cgroup: dict[str, dict[str, str]]
    cgroup_dirs: list[Path]
    own_user_ns: bool = False
    uid_map: list[str] = field(default_factory=list)
    gid_map: list[str] = field(default_factory=list)
    sees: dict[str, bool] = field(default_factory=dict)     # host path -> visible in its root


def cgroup_view(pid: int) -> tuple[dict[str, dict[str, str]], list[Path]]:
    layout = host_layout()
    assert isinstance(layout, Layout), layout
    own: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for n in names.split(",") if names else [""]:
            own[n] = path
    files = {"cpu": ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.max"),
             "memory": ("memory.limit_in_bytes", "memory.max"), "pids": ("pids.max",)}
    out: dict[str, dict[str, str]] = {}
    dirs = []
    for h in layout.hierarchies:
        key = h.controllers[0] if h.version.value == 1 else ""
        d = h.mountpoint / own[key].lstrip("/")
        dirs.append(d)
        for c in h.controllers:
            out[c] = {f: (d / f).read_text().strip() for f in files[c] if (d / f).exists()}
    return out, dirs


def inspect(label: str, vm: QemuProcess, probes: list[Path]) -> Seen:
    pid = vm.pid
    status = {k: v.strip() for k, _, v in (line.partition(":") for line in
                                          Path(f"/proc/{pid}/status").read_text().splitlines()) if k in STATUS_KEYS}
    mountpoints = [line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
    root = Path(f"/proc/{pid}/root")
    cg, dirs = cgroup_view(pid)
    seen = Seen(label, vm.spec, pid, status, os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"),
                sorted(os.listdir(root)), mountpoints, cg, dirs,
                os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user"),
                Path(f"/proc/{pid}/uid_map").read_text().split(), Path(f"/proc/{pid}/gid_map").read_text().split())
    for p in probes + [vm.spec.run_dir] + ([vm.spec.mem_path] if vm.spec.mem_path else []):
        seen.sees[str(p)] = os.path.lexists(str(root) + str(p))
    return seen


def check_confined(s: Seen) -> None:
    what = f"{s.label} ({s.spec.name}, pid {s.pid})"
    uids = s.status["Uid"].split()
    assert all(int(u) >= 1000 for u in uids) and len(set(uids)) == 1, what
    assert s.status["Gid"].split()[0] == uids[0] and s.status["Groups"] == "", what
    for cap in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
        assert int(s.status[cap], 16) == 0, f"{what}: {cap} {s.status[cap]}"
    assert s.status["NoNewPrivs"] == "1" and s.status["Seccomp"] == "2", what
    # its filters: QEMU's -sandbox, discard.py's for copy-on-write RAM, and the syscall
    # allow-list's two programs (tests/aenv_vm/vm/test_syscall_filter.py runs a process
    # under the exact filter and sees what it refuses)
    assert s.spec.jail is not None and s.spec.jail.syscalls is not None, what
    assert s.spec.jail.syscalls.mode is Mode.ALLOW_LIST, what
    cow = s.spec.mem_path is not None and not s.spec.mem_share
    assert int(s.status["Seccomp_filters"]) == 1 + cow + 2, f"{what}: {s.status['Seccomp_filters']}"
    # its own user namespace, in which only its uid and gid exist
    assert s.spec.jail.user_ns and s.own_user_ns, what
    assert s.uid_map == [uids[0], uids[0], "1"] and s.gid_map == [uids[0], uids[0], "1"], what
    assert s.own_mount_ns, what
    assert "root" not in s.root_entries and not s.sees["/root"], what
    # its own files are there; the node's data dir, records and other sandboxes' files are not
    own = {str(s.spec.run_dir), str(s.spec.mem_path), str(s.spec.kernel), str(s.spec.initrd)}
    for path, visible in s.sees.items():
        assert visible == (path in own), f"{what}: {path} {'visible' if visible else 'missing'}"
    for mp in s.mountpoints:
        assert mp != "/root" and not mp.startswith("/root/"), what
        assert mp in own or mp in ("/", "/usr", "/etc/resolv.conf", "/etc/ld.so.cache") or \
            mp.startswith("/run/aenv/lib/"), \
            f"{what}: unexpected mount {mp}"
    # the cgroup bounds CPU (vCPUs), memory (guest + TCG code buffer + VMM) and tasks
    vcpus, mib = s.spec.vcpus, s.spec.memory_mib
    assert s.spec.jail is not None
    # a TCG QEMU's code buffer: the configured one, else the jail's; a KVM one (the
    # accelerator probe on a host with /dev/kvm) has none
    tb = (s.spec.tcg_tb_mib or s.spec.jail.tcg_tb_mib) if s.spec.accel == "tcg" else 0
    assert tb == (tcg_buffer_mib(s.spec) or 0), what
    mem = s.cgroup["memory"].get("memory.limit_in_bytes") or s.cgroup["memory"]["memory.max"]
    assert int(mem) == (mib + tb + s.spec.jail.vmm_mib) << 20, what
    cpu = s.cgroup["cpu"]
    quota = int(cpu["cpu.cfs_quota_us"]) if "cpu.cfs_quota_us" in cpu else int(cpu["cpu.max"].split()[0])
    assert quota == vcpus * 100_000, what
    assert int(s.cgroup["pids"]["pids.max"]) == s.spec.jail.pids + vcpus, what


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_for(pred, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def run_ok(sbx: Sandbox, cmd: str = "true", timeout: float = 60.0) -> str:
    r = await sbx.envd.run(cmd, user="root", timeout=timeout)
    assert r.exit_code == 0, r
    return r.stdout.decode()


def test_every_qemu_the_node_starts_is_confined(env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Seen] = []
    label = ["?"]
    specs: list[tuple[str, VmSpec]] = []
    ids: dict[str, str] = {}
    standby_uid_matches: list[bool] = []
    node = tmp_path / "node"
    data_dirs = [Path("/root"), env.root / "data", node / "records", node / "sandboxes", tmp_path / "work" / "upper"]
    original = QemuProcess.start.__func__   # type: ignore[attr-defined]

    async def recording_start(cls, spec: VmSpec, *args, **kwargs):  # type: ignore[no-untyped-def]
        specs.append((label[0], spec))
        vm = await original(cls, spec, *args, **kwargs)
        others = [node / "vm" / s.spec.name for s in seen if s.spec.name != spec.name and s.spec.run_dir != spec.run_dir]
        seen.append(inspect(label[0], vm, data_dirs + others))
        return vm

    monkeypatch.setattr(QemuProcess, "start", classmethod(recording_start))
    # every priority a QEMU was given, and the CPU weight its cgroup then had
    priorities: list[tuple[str, str, bringup.Priority, int]] = []

    def recording_prioritise(vm: QemuProcess, priority: bringup.Priority) -> None:
        real_prioritise(vm, priority)
        assert vm.cgroup is not None and vm.cgroup.cpu_weight_file is not None
        priorities.append((label[0], vm.spec.name, priority, int(vm.cgroup.cpu_weight_file.read_text())))

    real_prioritise = bringup.prioritise
    monkeypatch.setattr(bringup, "prioritise", recording_prioritise)
    monkeypatch.setattr(pool_module, "prioritise", recording_prioritise)
    # a fork child's cgroup weight while it started (its fork's StartingGroup), and after
    child_weights: list[tuple[str, int]] = []
    real_answered = cpushare.StartingGroup.answered

    def recording_answered(self: cpushare.StartingGroup, vm: QemuProcess) -> None:
        assert vm.cgroup is not None and vm.cgroup.cpu_weight_file is not None
        child_weights.append(("starting", int(vm.cgroup.cpu_weight_file.read_text())))
        real_answered(self, vm)

    monkeypatch.setattr(cpushare.StartingGroup, "answered", recording_answered)

    async def run() -> None:
        label[0] = "template build"
        await build_template(env.store, env.guest, tmp_path / "work", alias="confined", memory_mib=256)
        async with SandboxManager(env.store, env.guest, node, pool_size=1) as mgr:
            label[0] = "pooled clone"
            await mgr.fill_pool("base")
            label[0] = "create"
            a = await mgr.create("confined")        # no pool for this template: a fresh clone
            b = await mgr.create("base")            # from the pool
            assert b.timing is not None and b.timing.from_pool
            await run_ok(a)
            await run_ok(b)
            label[0] = "standby"
            n = len(seen)
            await mgr.pause(a.id)
            await wait_for(lambda: any(s.spec.name == a.id for s in seen[n:]))   # started in the background
            standby = next(s for s in seen[n:] if s.spec.name == a.id)
            standby_uid_matches.append(standby.status["Uid"] == next(s for s in seen if s.spec.name == a.id).status["Uid"])
            label[0] = "resume"
            a = await mgr.resume(a.id)
            assert a.vm.pid == standby.pid      # the resume took the standby QEMU
            assert "confined" in await run_ok(a, "echo confined")
            label[0] = "resume (fresh QEMU)"
            mgr.standby_limit = 0
            await mgr.pause(b.id)
            b = await mgr.resume(b.id)
            await run_ok(b)
            label[0] = "fork child"
            (kid,) = await mgr.fork(a.id, 1)
            assert isinstance(kid, Sandbox)
            assert kid.vm.cgroup is not None and kid.vm.cgroup.cpu_weight_file is not None
            child_weights.append(("forked", int(kid.vm.cgroup.cpu_weight_file.read_text())))
            assert a.vm.cgroup is not None and a.vm.cgroup.cpu_weight_file is not None
            child_weights.append(("parent", int(a.vm.cgroup.cpu_weight_file.read_text())))
            ids.update(a=a.id, kid=kid.id)
            await run_ok(kid)
            seen.append(inspect("fork child, running", kid.vm, data_dirs + [node / "vm" / a.id]))
            # the pools' refills (base's after b's create, confined's after a's): none may be
            # cut off by the manager's close while it warms, at its low priority still
            await wait_for(lambda: len(mgr.pooled("base")) == 1 and len(mgr.pooled("confined")) == 1, 120)
            for sbx in (a, b, kid):
                await mgr.kill(sbx.id)
        label[0] = "accelerator probe"
        conf = Confinement()
        await probe_accel(env.guest.kernel, env.guest.initrd, force=True, timeout=2.0, confinement=conf)
        conf.close()

    asyncio.run(run())
    labels = {s.label for s in seen}
    assert {"template build", "pooled clone", "create", "standby", "resume (fresh QEMU)", "fork child"} <= labels
    for s in seen:
        check_confined(s)
    # one uid per sandbox: never shared by two of them (its standby QEMU has its uid; a
    # resume without one may get another, its earlier uid having gone with its QEMU)
    names_of: dict[str, set[str]] = {}
    for s in seen:
        names_of.setdefault(s.status["Uid"].split()[0], set()).add(s.spec.name)
    assert all(len(names) == 1 for names in names_of.values()), names_of
    assert standby_uid_matches[0]
    # the accelerator probe's QEMU (KVM, which fails fast here) was given a jail too
    probe = [spec for lab, spec in specs if lab == "accelerator probe"]
    if probe:   # none when /dev/kvm does not open: TCG is chosen without a probe VM
        assert all(p.jail is not None and p.jail.uid is not None and p.jail.seccomp for p in probe)
    # every QEMU's cgroup went with it
    for s in seen:
        assert not any(d.exists() for d in s.cgroup_dirs), s.label
    # a pool refill yields the CPU to sandboxes in use (1/8 of their cgroup weight) until
    # it is warm, then has the full weight; nothing else is held back by ``prioritise``
    full = max(w for *_, w in priorities)
    assert full in (1024, 100), priorities
    P = bringup.Priority
    for _, name, priority, weight in priorities:
        assert weight == cpu_weight(full, priority.value[1]), priorities
    # a fork child shared its parent's weight (the two: 1 + the starting weight) until it
    # answered; then both had the full weight again
    shared = cpu_weight(full, cpushare.member_share(1, 1))
    assert shared < full
    assert child_weights == [("starting", shared), ("forked", full), ("parent", full)]
    refills = [name for lab, name, p, _ in priorities if p is P.BACKGROUND]
    assert len(set(refills)) >= 2, priorities        # the first fill and the refill after b's create
    for name in refills:
        assert [p for _, n, p, _ in priorities if n == name][-1] is P.RUNNING, priorities
    assert ids["a"] not in refills and ids["kid"] not in refills


FORK_BOMB = "nohup bash -c ':(){ :|:& };:' >/dev/null 2>&1 &"
FILL_DISK = ("nohup sh -c 'dd if=/dev/zero of=/fill bs=1M oflag=direct status=none; sync; echo done > /filled' "
             ">/dev/null 2>&1 &")


def test_fork_bomb_and_full_disk_leave_the_node_and_a_neighbour_working(env: Env, tmp_path: Path) -> None:
    free_before = shutil.disk_usage(tmp_path).free
    # the guest must meet its disk's end before the node's floor: the floor has its own test below
    floor = max(0, free_before - env.guest.rootfs.stat().st_size - (1 << 30))

    async def neighbour_ok(sbx: Sandbox) -> float:
        t0 = time.monotonic()
        await run_ok(sbx, "true", timeout=60.0)
        return time.monotonic() - t0

    async def run() -> None:
        async with SandboxManager(env.store, env.guest, tmp_path / "node", min_free_disk=floor) as mgr:
            neighbour = await mgr.create("base")
            bomb = await mgr.create("base")
            filler = await mgr.create("base")
            idle = await neighbour_ok(neighbour)
            await run_ok(bomb, FORK_BOMB)
            # the bombed guest's QEMU is busy but held to its one vCPU's worth of CPU time
            c0, t0 = cpu_seconds(bomb.vm.pid), time.monotonic()
            await asyncio.sleep(3)
            used, wall = cpu_seconds(bomb.vm.pid) - c0, time.monotonic() - t0
            assert used <= wall * bomb.vm.spec.vcpus + 0.25, (used, wall)
            await run_ok(filler, FILL_DISK)
            slow = []
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                slow.append(await neighbour_ok(neighbour))
                done = await filler.envd.run("cat /filled 2>/dev/null; df -k / | tail -1", user="root", timeout=60)
                if b"done" in done.stdout:
                    break
                await asyncio.sleep(1)
            print(f"\n[confine] fork-bombed QEMU: {used:.2f} s CPU in {wall:.2f} s; neighbour's commands.run: idle "
                  f"{idle * 1000:.0f} ms, next to the fork bomb and a disk fill: max {max(slow) * 1000:.0f} ms over "
                  f"{len(slow)}; filler: {done.stdout!r}")
            assert b"done" in done.stdout, "the guest's dd never ended"
            # the guest's disk stopped at its size; the host's upper file is bounded by it
            upper = tmp_path / "node" / "sandboxes" / filler.id / "upper" / "upper.data"
            disk = filler.image.size
            assert os.stat(upper).st_blocks * 512 <= disk
            assert shutil.disk_usage(tmp_path).free >= floor
            # the node still creates sandboxes and the fork-bombed one still exists
            extra = await mgr.create("base")
            await run_ok(extra)
            assert filler.vm.alive()    # (the fork-bombed guest may have panicked: its own affair)
            for sbx in (neighbour, bomb, filler, extra):
                await mgr.kill(sbx.id)

    asyncio.run(run())


def test_a_guest_cannot_push_the_node_below_its_free_disk_floor(env: Env, tmp_path: Path) -> None:
    """With the floor just below what is free now, the guest's writes fail (I/O errors
    in the guest, which keeps running) once ~64 MiB are written, instead of filling the host.
    The node's data dir is a filesystem of its own, so that what is free on it moves only
    with this node's writes, not with a test on the other worker."""
    async def run(node: Path) -> None:
        # a node's first create writes its own files (templates, records): made before the
        # floor is set, so that the guest finds ~64 MiB above it
        async with SandboxManager(env.store, env.guest, node) as mgr:
            await mgr.kill((await mgr.create("base")).id)
        floor = shutil.disk_usage(node).free - (64 << 20)
        async with SandboxManager(env.store, env.guest, node, min_free_disk=floor) as mgr:
            sbx = await mgr.create("base")
            room = shutil.disk_usage(node).free - floor
            assert room > 32 << 20, room        # the create itself left the guest room to write
            r = await sbx.envd.run("dd if=/dev/urandom of=/big bs=1M count=256 oflag=direct status=none; "
                                   "echo rc=$?", user="root", timeout=180)
            assert b"rc=0" not in r.stdout, r
            # the guest stopped at the floor: what it got onto the host is at most what there
            # was above it (4 MiB of slack: writes in flight, the upper file's own blocks)
            upper = node / "sandboxes" / sbx.id / "upper" / "upper.data"
            got = os.stat(upper).st_blocks * 512
            assert room - (16 << 20) <= got <= room + (4 << 20), (got, room, floor)
            assert shutil.disk_usage(node).free >= floor - (4 << 20)
            await run_ok(sbx, "true")       # the guest still answers
            assert sbx.vm.alive()
            await mgr.kill(sbx.id)

    # 1 GiB bounds the RAM the tmpfs can take; the node's files and the guest's 64 MiB fit
    with small_tmpfs(tmp_path / "node", "size=1g,mode=0700") as node:
        asyncio.run(run(node))


def test_the_console_of_a_jailed_qemu_is_read_without_following_links(env: Env, tmp_path: Path) -> None:
    """The console log a confined QEMU owns is read without following a link it could
    plant: a symlink to a host file reads as nothing."""
    async def run() -> None:
        async with SandboxManager(env.store, env.guest, tmp_path / "node") as mgr:
            sbx = await mgr.create("base")
            await run_ok(sbx, "echo from-the-guest > /dev/ttyS0")
            assert b"from-the-guest" in read_console(sbx.serial_log, "serial", 0, 1 << 20).data
            secret = tmp_path / "host-secret"
            secret.write_text("host only")
            sbx.serial_log.unlink()
            sbx.serial_log.symlink_to(secret)
            assert read_console(sbx.serial_log, "serial", 0, 1 << 20).data == b""
            await mgr.kill(sbx.id)

    asyncio.run(run())


def test_a_tap_mode_qemu_is_confined_and_opens_its_own_tap(env: Env, tmp_path: Path) -> None:
    """Tap mode: the QEMU joins the sandbox's network namespace before dropping root and
    opens tap0, which its uid owns, through the /dev/net/tun node of its jail."""
    async def run() -> None:
        async with SandboxManager(env.store, env.guest, tmp_path / "node", network="tap") as mgr:
            sbx = await mgr.create("base")
            await run_ok(sbx)
            s = inspect("tap", sbx.vm, [Path("/root")])
            check_confined(s)
            assert s.root_entries.count("dev") == 1 and os.path.exists(f"/proc/{sbx.vm.pid}/root/dev/net/tun")
            uid = int(s.status["Uid"].split()[0])
            assert os.stat(f"/proc/{sbx.vm.pid}/root/dev/net/tun").st_uid == uid
            assert os.readlink(f"/proc/{sbx.vm.pid}/ns/net") != os.readlink("/proc/self/ns/net")
            await mgr.kill(sbx.id)

    asyncio.run(run())
