"""The pure parts of QEMU confinement (aenv_vm/confine): which cgroup files get which
values on cgroup v1 and v2, where the groups go for both layouts, the jail's file
view and the child's plan, uid leases, the read-only RAM shim."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from aenv_vm.confine.cgroups import (CONTROLLERS, Hierarchy, Layout, LimitFile, Limits, Version, find_layout,
                                     limit_files, parse_mountinfo, parse_proc_cgroup)
from aenv_vm.confine.errors import ConfinementError
from aenv_vm.confine.jail import (MS_NOEXEC, MS_RDONLY, Access, Jail, child_plan, file_view)
from aenv_vm.confine.policy import Confinement, Level
from aenv_vm.confine.romem import build_shim, library_name
from aenv_vm.confine.uids import UidLeases

# This development machine: cgroup v1 controllers, a cgroup2 mount without any.
V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_CGROUP = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/e19\n2:cpuacct:/\n1:cpu:/\n0::/\n"
# A systemd host: the unified hierarchy only, the node in its service's cgroup.
V2_MOUNTINFO = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V2_CGROUP = "0::/system.slice/aenv.service\n"
# Debian 10 style: cpu and cpuacct co-mounted, the container sees a bind of its own subtree.
COMOUNTED = ("25 20 0:22 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
             "26 20 0:23 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
             "27 20 0:24 /docker/abc /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n")
COMOUNTED_CGROUP = "4:pids:/docker/abc\n3:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n"

LIMITS = Limits(cpus=2, memory_bytes=448 << 20, pids=258)


def test_v1_layout_of_this_kind_of_machine() -> None:
    layout = find_layout(V1_MOUNTINFO, V1_CGROUP, "hugetlb\n")
    assert isinstance(layout, Layout) and layout.version is Version.V1
    dirs = {h.controllers: h.node_dir for h in layout.hierarchies}
    assert dirs == {("cpu",): Path("/sys/fs/cgroup/cpu"),
                    ("memory",): Path("/sys/fs/cgroup/memory/process_api/e19"),
                    ("pids",): Path("/sys/fs/cgroup/pids")}
    assert layout.controllers == CONTROLLERS and layout.describe() == "cgroup v1 (cpu, memory, pids)"
    assert all(h.parent == h.node_dir / "aenv" for h in layout.hierarchies)


def test_v2_layout_and_its_files() -> None:
    layout = find_layout(V2_MOUNTINFO, V2_CGROUP, "cpuset cpu io memory hugetlb pids rdma misc\n")
    assert isinstance(layout, Layout) and layout.version is Version.V2
    (h,) = layout.hierarchies
    assert h.controllers == CONTROLLERS and h.node_dir == Path("/sys/fs/cgroup/system.slice/aenv.service")
    assert limit_files(Version.V2, LIMITS, swap_max=True) == [
        LimitFile("cpu", "cpu.max", "200000 100000"), LimitFile("memory", "memory.max", str(448 << 20)),
        LimitFile("memory", "memory.oom.group", "1"), LimitFile("memory", "memory.swap.max", "0"),
        LimitFile("pids", "pids.max", "258")]


def test_v1_files_in_write_order() -> None:
    assert limit_files(Version.V1, LIMITS, memsw=True) == [
        LimitFile("cpu", "cpu.cfs_period_us", "100000"), LimitFile("cpu", "cpu.cfs_quota_us", "200000"),
        LimitFile("memory", "memory.limit_in_bytes", str(448 << 20)),
        LimitFile("memory", "memory.memsw.limit_in_bytes", str(448 << 20)),   # never below the first
        LimitFile("pids", "pids.max", "258")]
    assert [f.name for f in limit_files(Version.V1, LIMITS, controllers=("pids",))] == ["pids.max"]
    assert Limits(cpus=0.001, memory_bytes=1, pids=1).quota_us == 1000   # the kernel's minimum


def test_comounted_v1_and_a_container_bind() -> None:
    layout = find_layout(COMOUNTED, COMOUNTED_CGROUP, None)
    assert isinstance(layout, Layout)
    cpu = next(h for h in layout.hierarchies if "cpu" in h.controllers)
    # the mount's root is the container's own cgroup: its groups go right under the mount
    assert cpu.mountpoint == Path("/sys/fs/cgroup/cpu,cpuacct") and cpu.node_dir == cpu.mountpoint


def test_layouts_that_cannot_bound_a_qemu() -> None:
    assert find_layout("", "", None) == "no cgroup filesystem is mounted"
    no_ctl = "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    assert "no mounted cgroup hierarchy" in str(find_layout(no_ctl, "0::/\n", ""))
    only_v1_memory = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    assert find_layout(only_v1_memory, "4:memory:/\n", None) == "no cgroup hierarchy has the cpu, pids controllers"
    # hybrid: memory in v1, the rest delegated in v2
    mixed = find_layout(only_v1_memory + V2_MOUNTINFO, "4:memory:/\n0::/x\n", "cpu pids\n")
    assert isinstance(mixed, Layout) and mixed.describe() == "cgroup v1+v2 (cpu, memory, pids)"


def test_mountinfo_and_proc_cgroup_parsing() -> None:
    entries = parse_mountinfo(V1_MOUNTINFO)
    assert [e.fstype for e in entries].count("cgroup2") == 1 and entries[0].super_options == ("rw", "cpu")
    assert parse_proc_cgroup(V1_CGROUP)["memory"] == "/process_api/e19"
    assert parse_proc_cgroup(COMOUNTED_CGROUP)["cpuacct"] == "/docker/abc"
    assert parse_proc_cgroup("0::/a\n")[""] == "/a"


def test_jail_limits_add_the_vmm_and_code_buffer() -> None:
    jail = Jail(uid=1_900_000_001, vmm_mib=64, pids=256, cpu_extra=0.5)
    lim = jail.limits(256, 2, 128)
    assert (lim.cpus, lim.memory_bytes, lim.pids) == (2.5, (256 + 128 + 64) << 20, 258)
    assert jail.limits(256, 1, 0).memory_bytes == (256 + 64) << 20          # KVM: no code buffer
    assert jail.file_size_limit(256) == (256 + 64) << 20


def test_file_view_binds_only_what_it_names(tmp_path: Path) -> None:
    run = tmp_path / "vm" / "sbx-1"
    run.mkdir(parents=True)
    mem = tmp_path / "templates" / "tpl-1" / "memory"
    mem.parent.mkdir(parents=True)
    mem.write_bytes(b"\0" * 4096)
    view = file_view(read=[mem], write_dirs=[run], devices=("null", "urandom", "net/tun"), owner=1_900_000_001,
                     resolv_conf=Path("/etc/resolv.conf") if Path("/etc/resolv.conf").exists() else None)
    binds = {b.target: b for b in view.binds}
    assert binds[mem].access is Access.READ and not binds[mem].is_dir
    assert binds[run].access is Access.WRITE and binds[run].is_dir
    assert binds[Path("/usr")].access is Access.EXEC
    assert not any(t == Path("/root") or Path("/root") in t.parents for t in view.targets)
    assert tmp_path / "templates" not in binds            # only the file, not its directory
    tun = next(d for d in view.devices if d.path == Path("/dev/net/tun"))
    assert (tun.mode, tun.owner) == (0o600, 1_900_000_001)
    null = next(d for d in view.devices if d.path == Path("/dev/null"))
    assert (null.mode, null.owner) == (0o666, -1) and null.rdev == os.stat("/dev/null").st_rdev
    if Path("/lib").is_symlink():
        assert ("lib", os.readlink("/lib")) in view.links


def test_file_view_refuses_what_it_cannot_bind_cleanly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "inner").write_bytes(b"x")
    with pytest.raises(ConfinementError, match="lies inside"):   # the bind would create it on the host
        file_view(write_dirs=[run], read=[run / "inner"])
    with pytest.raises(ConfinementError, match="does not exist"):
        file_view(read=[tmp_path / "missing"])
    with pytest.raises(ConfinementError, match="not a character device"):
        file_view(devices=("../tmp",))


def test_child_plan_precomputes_everything(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    view = file_view(write_dirs=[run], devices=("null",))
    plan = child_plan(view, parent_pid=123, root=Path("/r"), cgroup_procs=[Path("/sys/fs/cgroup/pids/x/cgroup.procs")],
                      uid=1_900_000_002, gid=1_900_000_002, cap_last=40, file_size=1 << 30)
    assert plan.root == b"/r" and plan.uid == 1_900_000_002 and plan.no_new_privs
    # every parent directory of a target is made before it, inside the jail's root only
    assert plan.dirs.index(b"/r" + os.fsencode(tmp_path)) < plan.dirs.index(b"/r" + os.fsencode(run))
    assert all(d.startswith(b"/r/") for d in plan.dirs)
    run_bind = next(b for b in plan.binds if b[0] == os.fsencode(run))
    assert run_bind[1] == b"/r" + os.fsencode(run) and run_bind[2] & MS_NOEXEC and not run_bind[2] & MS_RDONLY
    usr = next(b for b in plan.binds if b[0] == b"/usr")
    assert usr[2] & MS_RDONLY and not usr[2] & MS_NOEXEC
    assert plan.devices[0][0] == b"/r/dev/null" and stat.S_ISCHR(plan.devices[0][1])
    bare = child_plan(None, parent_pid=1)
    assert bare.root is None and bare.uid == -1 and not bare.binds


def test_uid_leases_are_exclusive_across_holders(tmp_path: Path) -> None:
    a, b = UidLeases(tmp_path, 2_000_000_000, 3), UidLeases(tmp_path, 2_000_000_000, 3)
    got = {a.acquire(), a.acquire(), b.acquire()}
    assert got == {2_000_000_000, 2_000_000_001, 2_000_000_002}
    with pytest.raises(ConfinementError, match="all 3 uids"):
        b.acquire()
    uid = a.held()[0]
    a.release(uid)
    assert b.acquire() == uid            # given back, taken by another holder
    a.close()
    b.close()
    # a lease dies with its holder process: flock goes with the descriptor
    code = "from aenv_vm.confine.uids import UidLeases; import sys; print(UidLeases(__import__('pathlib').Path(sys.argv[1]), 2_000_000_000, 1).acquire())"
    out = [subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True).stdout
           for _ in range(2)]
    assert out == ["2000000000\n", "2000000000\n"]
    with pytest.raises(ConfinementError):
        UidLeases(tmp_path, 0, 10)


def test_confinement_off_gives_no_jail() -> None:
    c = Confinement(Level.OFF)
    c.start()
    assert c.jail("sbx-1") is None and not c.enabled
    assert all(not p.on for p in c.parts()) and c.summary().startswith("off")
    with pytest.raises(ConfinementError, match="auto, required or off"):
        Confinement("sometimes")


def test_the_shim_builds_once_per_source(tmp_path: Path) -> None:
    if not any(Path(d, "cc").exists() for d in os.environ.get("PATH", "").split(":")):
        pytest.skip("no C compiler")
    lib = build_shim(tmp_path)
    assert lib.name == library_name() and lib.stat().st_mode & 0o755 == 0o755
    mtime = lib.stat().st_mtime_ns
    assert build_shim(tmp_path) == lib and lib.stat().st_mtime_ns == mtime


def test_the_shim_opens_only_the_named_file_read_only(tmp_path: Path) -> None:
    """Under the shim, O_RDWR on the named path gives a read-only descriptor (a write
    fails) while a MAP_PRIVATE writable mapping of it still works; other paths are as asked."""
    if not any(Path(d, "cc").exists() for d in os.environ.get("PATH", "").split(":")):
        pytest.skip("no C compiler")
    lib = build_shim(tmp_path / "lib")
    ram, other = tmp_path / "ram", tmp_path / "other"
    ram.write_bytes(b"a" * 4096)
    other.write_bytes(b"b" * 4096)
    probe = (
        "import mmap, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "m = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)\n"
        "m[0:1] = b'z'\n"
        "try:\n    os.pwrite(fd, b'w', 0); print('wrote')\nexcept OSError as e:\n    print('refused', e.errno)\n"
        "fd2 = os.open(sys.argv[2], os.O_RDWR); os.pwrite(fd2, b'w', 0); print('other ok')\n")
    env = {**os.environ, "LD_PRELOAD": str(lib), "AENV_READONLY_RAM": str(ram)}
    out = subprocess.run([sys.executable, "-c", probe, str(ram), str(other)], env=env, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    assert out[0].startswith("refused") and out[1] == "other ok"
    assert ram.read_bytes() == b"a" * 4096 and other.read_bytes()[:1] == b"w"


PUNCH_PROBE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "fd = os.open(sys.argv[1], os.O_RDWR)\n"
    "r = libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(8192))\n"     # PUNCH_HOLE | KEEP_SIZE
    "print(r, ctypes.get_errno())\n"
    "r = libc.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long(16384))\n"    # plain: still the kernel's
    "print(r, os.fstat(fd).st_size)\n")


@pytest.mark.parametrize("filtered", [True, False])
def test_a_copy_on_write_qemu_punches_no_holes(tmp_path: Path, filtered: bool) -> None:
    """The child side of a QEMU whose RAM is a copy-on-write file mapping: its hole punches
    succeed without touching the file (aenv_vm/confine/discard.py); every other fallocate
    is the kernel's. Unfiltered (control), the same punch zeroes the file's pages."""
    from aenv_vm.confine import discard
    from aenv_vm.confine.jail import enter
    if not discard.supported():
        pytest.skip("no filter for this host architecture")
    f = tmp_path / "memory"
    f.write_bytes(b"t" * 8192)
    plan = child_plan(None, parent_pid=os.getpid(), no_new_privs=False, core_dumps=True, private_discard=filtered)
    out = subprocess.run([sys.executable, "-c", PUNCH_PROBE, str(f)], preexec_fn=lambda: enter(plan),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "0 0" and out[1] == "0 16384"
    data = f.read_bytes()
    assert len(data) == 16384 and data[8192:] == bytes(8192)
    assert data[:8192] == (b"t" * 8192 if filtered else bytes(8192))


def test_sweep_removes_only_groups_nobody_holds(tmp_path: Path) -> None:
    from aenv_vm.confine.cgroups import CgroupTree, vm_group_uid
    assert vm_group_uid("vm-1900000001-abcdef") == 1_900_000_001
    assert vm_group_uid("aenv-node") is None and vm_group_uid("vm-x-1") is None
    h = Hierarchy(Version.V1, ("pids",), tmp_path, tmp_path / "node")
    tree = CgroupTree(Layout((h,)))
    h.parent.mkdir(parents=True)
    for name in ("vm-2000000000-aaaaaa", "vm-2000000001-bbbbbb", "unrelated"):
        (h.parent / name).mkdir()
    (h.parent / "vm-2000000002-cccccc").mkdir()
    (h.parent / "vm-2000000002-cccccc" / "busy").mkdir()   # a group with something in it: rmdir fails
    leases = UidLeases(tmp_path / "uids", 2_000_000_000, 2)
    assert leases.acquire() in (2_000_000_000, 2_000_000_001)
    held = leases.held()[0]
    other = UidLeases(tmp_path / "uids", 2_000_000_000, 2)
    assert other.leased(held) and not other.leased(2_000_000_000 + 2_000_000_001 - held)
    assert tree.sweep(other.leased) == 1                      # the free, empty one
    left = sorted(p.name for p in h.parent.iterdir())
    assert f"vm-{held}-{'aaaaaa' if held == 2_000_000_000 else 'bbbbbb'}" in left and "unrelated" in left
    assert "vm-2000000002-cccccc" in left
    leases.close()


@pytest.mark.qemu
def test_required_refuses_to_start_without_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv_vm.confine import policy
    monkeypatch.setattr(policy, "host_layout", lambda: "no cgroup filesystem is mounted")
    c = Confinement("required")
    with pytest.raises(ConfinementError, match="cannot be met on this host: .*cgroup: no cgroup filesystem"):
        c.start()
    assert not next(p for p in c.parts() if p.name == "cgroup").on
    c.close()
    auto = Confinement("auto")      # auto runs without it and says so
    auto.start()
    assert "off: cgroup (no cgroup filesystem is mounted)" in auto.summary()
    j = auto.jail("sbx-x")
    assert j is not None and j.cgroups is None
    auto.close()
