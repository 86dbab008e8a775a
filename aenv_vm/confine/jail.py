"""One QEMU's jail: what it is (``Jail``), what it sees (``FileView``) and the
child-side setup between fork and exec (``ChildPlan`` → ``enter``).

The file view mirrors host paths 1:1 ("identity" binds): inside its mount
namespace a QEMU finds its run dir, memory file, kernel, sockets at the very
paths the node uses, so command lines, ``/proc/PID/maps`` (read by the pause
code to find guest RAM) and error messages need no translation; everything
else of the host is simply absent. The jail's root is a small tmpfs (root's,
read-only after setup) holding the mount points, a few device nodes made for
this QEMU (``/dev/kvm`` and ``/dev/net/tun`` owned by its uid), ``/usr``
read-only and the usrmerge links. Nothing is ever created on the host side of
a bind: a target inside another bound directory is refused (``file_view``).

``enter`` runs in the forked child of the node (no imports, no locks: every
value is precomputed in ``ChildPlan``), in this order and for these reasons:

1. own process group; PR_SET_PDEATHSIG (also guards the setup itself);
2. join the QEMU's cgroups (writing "0" to ``cgroup.procs`` needs root);
3. ``setns`` into the sandbox's network namespace (tap mode; CAP_SYS_ADMIN);
4. a new mount namespace: everything private, the tmpfs root, the binds,
   ``pivot_root`` and the old root detached (CAP_SYS_ADMIN);
5. resource limits: no core dumps (a dump holds guest memory), a file-size
   cap with SIGXFSZ ignored (a guest flooding its serial console gets EFBIG,
   not the host's disk);
6. drop the capability bounding set (needs CAP_SETPCAP, so before 7);
7. groups, gid, uid: the kernel clears every capability when a root process
   becomes non-zero in all its uids — and clears the death signal too;
8. PR_SET_PDEATHSIG again, then check the node is still there (it may have
   died while the signal was unset); then its own user namespace mapping only
   its uid and gid (``_enter_user_ns``: as the uid, so no privilege is needed);
9. KSM's PR_SET_MEMORY_MERGE and ADDR_NO_RANDOMIZE (both unprivileged, both
   kept across exec);
10. PR_SET_NO_NEW_PRIVS (it also lets QEMU install its seccomp filter,
    ``-sandbox``, without privileges);
11. a QEMU whose RAM is a copy-on-write mapping of a shared file: the filter that
    keeps its RAM discards out of the file (discard.py; needs 10 or root, so a
    QEMU that is otherwise unconfined gets no_new_privs for it too);
12. the syscall allow-list (syscall_filter.py), last: from here to the exec only
    the child's close_fds and the execve run under it.
"""
from __future__ import annotations

import ctypes
import enum
import os
import platform
import resource
import signal
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..childenv import child_env
from . import discard
from .cgroups import CgroupTree, Limits
from .errors import ConfinementError
from .romem import ReadonlyRam
from .syscall_filter import CompiledFilter

# QEMU's own seccomp filter: no obsolete syscalls, no set*id/setpgid, no fork/exec,
# no scheduler or priority changes (docs/security.md).
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
DEFAULT_ROOT = Path("/run/aenv/jail-root")
JAIL_EXIT = 125             # the child's exit code when its setup failed (message on stderr)
FILE_SLACK_MIB = 64         # files a QEMU writes stay below its guest RAM + this

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_DUMPABLE = 4
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_MEMORY_MERGE = 67        # Linux >= 6.4: every anonymous mapping KSM-mergeable
ADDR_NO_RANDOMIZE = 0x0040000   # personality flag: no ASLR after exec
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine(), -1)

# Resolved once in the parent: dlopen() in a child forked from a threaded process
# could deadlock on a loader lock another thread held at fork time.
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_personality = _libc.personality
_setns = _libc.setns
_unshare = _libc.unshare
_mount = _libc.mount
_umount2 = _libc.umount2
_syscall = _libc.syscall
_get_errno = ctypes.get_errno
_signal = _libc.signal
_signal.restype = ctypes.c_void_p
_signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
_SIG_IGN = 1


# ---------------------------------------------------------------- the jail record

@dataclass(frozen=True)
class Jail:
    """How one sandbox's QEMUs are confined (``Confinement.jail`` makes it; every QEMU
    of the sandbox — its standby after a pause too — gets the same one)."""
    uid: int | None = None              # None: the node's own uid
    gid: int | None = None
    seccomp: bool = True                # QEMU's -sandbox filter
    mount_ns: bool = False              # its own mount namespace and root (FileView)
    cgroups: CgroupTree | None = None   # its own cgroup per QEMU (None: none)
    readonly_ram: ReadonlyRam = ReadonlyRam.NONE
    shim: Path | None = None            # the LD_PRELOAD library (ReadonlyRam.PRELOAD)
    root_dir: Path = DEFAULT_ROOT       # the empty dir its tmpfs root is mounted on (in its namespace)
    vmm_mib: int = 64                   # QEMU's own memory beyond guest RAM and TCG's code buffer
    tcg_tb_mib: int = 128               # TCG's code buffer when none is configured (QEMU's: 1 GiB)
    pids: int = 256                     # threads (QEMU's I/O pool alone may start 64)
    cpu_extra: float = 0.0              # CPUs beyond the vCPUs (QEMU's main loop and I/O threads)
    cap_last: int = -1                  # drop the bounding set 0..cap_last (-1: keep it)
    # the syscall allow-list (or its log mode), built once per node; None: QEMU's -sandbox only
    syscalls: CompiledFilter | None = field(default=None, compare=False)
    user_ns: bool = False               # its own user namespace mapping only its uid and gid

    def limits(self, memory_mib: int, vcpus: int, tb_mib: int) -> Limits:
        """The cgroup of a QEMU with ``memory_mib`` of guest RAM, ``vcpus`` and a TCG
        code buffer of ``tb_mib`` (0 under KVM), docs/security.md says how measured."""
        return Limits(cpus=vcpus + self.cpu_extra, memory_bytes=(memory_mib + tb_mib + self.vmm_mib) << 20,
                      pids=self.pids + vcpus)

    def file_size_limit(self, memory_mib: int) -> int:
        return (memory_mib + FILE_SLACK_MIB) << 20


# ---------------------------------------------------------------- the file view

class Access(enum.Enum):
    READ = "ro"                 # read-only, no exec, no suid, no devices
    WRITE = "rw"                # read-write, no exec, no suid, no devices
    EXEC = "rx"                 # read-only, executable (binaries, libraries)


@dataclass(frozen=True)
class Bind:
    source: Path                # host path
    target: Path                # path in the jail (the same, but for /etc/resolv.conf's symlink target)
    access: Access
    is_dir: bool


@dataclass(frozen=True)
class DeviceNode:
    path: Path
    rdev: int
    mode: int                   # permission bits
    owner: int                  # uid (-1: root)


@dataclass(frozen=True)
class FileView:
    binds: tuple[Bind, ...]
    devices: tuple[DeviceNode, ...]
    links: tuple[tuple[str, str], ...]      # (name under /, target) e.g. ("lib", "usr/lib")

    @property
    def targets(self) -> tuple[Path, ...]:
        return tuple(b.target for b in self.binds) + tuple(d.path for d in self.devices)


# The device nodes a jail may get; kvm and tun are owned by the QEMU's uid.
DEVICES = {"null": 0o666, "zero": 0o666, "random": 0o666, "urandom": 0o666, "kvm": 0o600, "net/tun": 0o600}
BASE_DEVICES = ("null", "zero", "random", "urandom")
_TOP_LEVEL = ("bin", "sbin", "lib", "lib64", "lib32", "libx32")


def _covers(outer: Bind, inner: Path) -> bool:
    return outer.is_dir and inner != outer.target and inner.is_relative_to(outer.target)


def file_view(*, read: Iterable[Path] = (), write: Iterable[Path] = (), write_dirs: Iterable[Path] = (),
              execute: Iterable[Path] = (), devices: Iterable[str] = BASE_DEVICES, owner: int = -1,
              resolv_conf: Path | None = None, host_root: Path = Path("/")) -> FileView:
    """The view of one QEMU: ``/usr`` (+ usrmerge links, or the top-level library and
    binary dirs bound where they are real directories), the files it reads, writes
    and executes, the dirs it writes in, ``devices`` (names in DEVICES, made from the
    host's nodes), ``/etc/resolv.conf`` read-only (user-mode networking's DNS).
    ConfinementError when a path lies inside another bound directory (the bind
    would create it on the host) or does not exist."""
    binds = [Bind(Path("/usr"), Path("/usr"), Access.EXEC, True)]
    links: list[tuple[str, str]] = []
    for name in _TOP_LEVEL:
        p = host_root / name
        if p.is_symlink():
            links.append((name, os.readlink(p)))
        elif p.is_dir():
            binds.append(Bind(Path("/") / name, Path("/") / name, Access.EXEC, True))
    if resolv_conf is not None:
        binds.append(Bind(resolv_conf.resolve(), Path("/etc/resolv.conf"), Access.READ, False))
    for paths, access, is_dir in ((read, Access.READ, False), (write, Access.WRITE, False),
                                  (write_dirs, Access.WRITE, True), (execute, Access.EXEC, False)):
        for p in paths:
            path = Path(os.path.abspath(p))
            if any(_covers(b, path) for b in binds):
                outer = next(b for b in binds if _covers(b, path))
                if outer.access is Access.EXEC and access is not Access.WRITE:
                    continue   # e.g. a QEMU binary under /usr
                raise ConfinementError(f"{path} lies inside {outer.target}, bound into the jail as a whole")
            if not path.exists():
                raise ConfinementError(f"{path} does not exist: it cannot be bound into the jail")
            binds.append(Bind(path, path, access, is_dir or path.is_dir()))
    for b in binds:
        inside = [o for o in binds if _covers(o, b.target)]
        if inside:
            raise ConfinementError(f"{b.target} lies inside {inside[0].target}, bound into the jail as a whole")
    nodes = []
    for name in devices:
        host = Path("/dev") / name
        try:
            st = host.stat()
        except OSError as e:
            raise ConfinementError(f"{host}: {e.strerror}") from None
        if not stat.S_ISCHR(st.st_mode):
            raise ConfinementError(f"{host} is not a character device")
        mode = DEVICES[name]
        nodes.append(DeviceNode(host, st.st_rdev, mode, owner if mode == 0o600 else -1))
    return FileView(tuple(binds), tuple(nodes), tuple(links))


# ---------------------------------------------------------------- the child side

@dataclass(frozen=True)
class ChildPlan:
    """Everything ``enter`` does, precomputed in the parent (paths as bytes)."""
    parent_pid: int
    cgroup_procs: tuple[bytes, ...] = ()
    netns_fd: int = -1
    root: bytes | None = None                           # where the jail's tmpfs goes (None: no namespace)
    dirs: tuple[bytes, ...] = ()                        # made in the tmpfs, parents first
    files: tuple[bytes, ...] = ()                       # empty files made in the tmpfs (file bind targets)
    binds: tuple[tuple[bytes, bytes, int], ...] = ()    # (source, target in the tmpfs, remount flags)
    devices: tuple[tuple[bytes, int, int, int], ...] = ()   # (path in the tmpfs, mode, rdev, uid)
    links: tuple[tuple[bytes, bytes], ...] = ()
    core_zero: bool = False
    file_size: int = -1                                 # RLIMIT_FSIZE (-1: unchanged)
    cap_last: int = -1                                  # drop the bounding set 0..cap_last (-1: keep)
    uid: int = -1
    gid: int = -1
    merge_memory: bool = False
    fixed_layout: bool = False
    no_new_privs: bool = False
    private_discard: bool = False                       # discard.py's filter (copy-on-write RAM)
    syscall_filter: CompiledFilter | None = field(default=None, compare=False)   # the allow-list
    user_ns: bool = False                               # its own user namespace, mapping only its uid


def _flags(access: Access) -> int:
    base = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV
    if access is Access.WRITE:
        return base | MS_NOEXEC
    if access is Access.READ:
        return base | MS_RDONLY | MS_NOEXEC
    return base | MS_RDONLY


def _ancestors(p: Path) -> list[Path]:
    return list(reversed(p.parents))[1:] + [p]


def child_plan(view: FileView | None, *, parent_pid: int, root: Path = DEFAULT_ROOT, cgroup_procs: Iterable[Path] = (),
               netns_fd: int = -1, uid: int | None = None, gid: int | None = None, cap_last: int = -1,
               file_size: int = -1, merge_memory: bool = False, fixed_layout: bool = False,
               no_new_privs: bool = True, core_dumps: bool = False, private_discard: bool = False,
               syscall_filter: CompiledFilter | None = None, user_ns: bool = False) -> ChildPlan:
    """The ``ChildPlan`` of a QEMU: with ``view`` a mount namespace rooted at a tmpfs on
    ``root`` holding exactly that view. ``core_dumps``: leave RLIMIT_CORE as it is.
    ``private_discard``: its RAM is a copy-on-write file mapping (discard.py).
    ``syscall_filter``: installed last (syscall_filter.py)."""
    dirs: list[bytes] = []
    files: list[bytes] = []
    binds: list[tuple[bytes, bytes, int]] = []
    devs: list[tuple[bytes, int, int, int]] = []
    r = os.fsencode(root)
    if view is not None:
        def need_dir(p: Path) -> None:
            for a in _ancestors(p):
                b = r + os.fsencode(a)
                if b not in dirs:
                    dirs.append(b)
        for b in sorted(view.binds, key=lambda b: len(b.target.parts)):
            if b.is_dir:
                need_dir(b.target)
            else:
                need_dir(b.target.parent)
                files.append(r + os.fsencode(b.target))
            binds.append((os.fsencode(b.source), r + os.fsencode(b.target), _flags(b.access)))
        for d in view.devices:
            need_dir(d.path.parent)
            devs.append((r + os.fsencode(d.path), stat.S_IFCHR | d.mode, d.rdev, d.owner))
    return ChildPlan(
        parent_pid=parent_pid, cgroup_procs=tuple(os.fsencode(p) for p in cgroup_procs), netns_fd=netns_fd,
        root=r if view is not None else None, dirs=tuple(dirs), files=tuple(files), binds=tuple(binds),
        devices=tuple(devs), links=tuple((r + b"/" + os.fsencode(n), os.fsencode(t)) for n, t in view.links)
        if view is not None else (), core_zero=not core_dumps, file_size=file_size, cap_last=cap_last,
        uid=-1 if uid is None else uid, gid=-1 if gid is None else gid, merge_memory=merge_memory,
        fixed_layout=fixed_layout, no_new_privs=no_new_privs, private_discard=private_discard,
        syscall_filter=syscall_filter, user_ns=user_ns and uid is not None)


def _fail(step: bytes, err: int = 0) -> None:
    err = err or _get_errno()
    os.write(2, b"aenv-jail: " + step + b": " + os.strerror(err).encode() + b"\n")
    os._exit(JAIL_EXIT)


def _ok(result: int, step: bytes) -> None:
    if result != 0:
        _fail(step)


def _mkdir(path: bytes) -> None:
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass


def _build_root(plan: ChildPlan) -> None:
    root = plan.root
    assert root is not None
    _ok(_unshare(CLONE_NEWNS), b"unshare(CLONE_NEWNS)")
    _ok(_mount(None, b"/", None, MS_REC | MS_PRIVATE, None), b"mount --make-rprivate /")
    _ok(_mount(b"tmpfs", root, b"tmpfs", MS_NOSUID | MS_NOEXEC, b"size=256k,nr_inodes=512,mode=755"),
        b"mount tmpfs " + root)
    for d in plan.dirs:
        _mkdir(d)
    for f in plan.files:
        os.close(os.open(f, os.O_WRONLY | os.O_CREAT, 0o600))
    for name, target in plan.links:
        os.symlink(target, name)
    for path, mode, rdev, owner in plan.devices:
        os.mknod(path, mode, rdev)
        os.chmod(path, mode & 0o7777)
        if owner >= 0:
            os.chown(path, owner, owner)
    for source, target, flags in plan.binds:
        _ok(_mount(source, target, None, MS_BIND, None), b"bind " + source)
        _ok(_mount(None, target, None, flags, None), b"remount " + source)
    os.chdir(root)
    _ok(_syscall(_SYS_PIVOT_ROOT, b".", b"."), b"pivot_root " + root)
    _ok(_umount2(b".", MNT_DETACH), b"detach the host's root")
    os.chdir(b"/")
    _ok(_mount(None, b"/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC, None),
        b"remount the jail root read-only")


def enter(plan: ChildPlan) -> None:
    """The child's setup before exec (see the module doc for the order and why)."""
    os.setpgid(0, 0)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != plan.parent_pid:      # the node died before the signal was armed
        os._exit(1)
    # /proc of this process, for its user namespace's maps once the host's /proc is gone
    proc_fd = os.open(b"/proc/self", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if plan.user_ns else -1
    for procs in plan.cgroup_procs:
        try:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        except OSError as e:
            _fail(b"join " + procs, e.errno or 0)
    # preexec runs before close_fds: the namespace's fd is still open here
    if plan.netns_fd >= 0:
        _ok(_setns(plan.netns_fd, CLONE_NEWNET), b"setns(CLONE_NEWNET)")
    if plan.root is not None:
        try:
            _build_root(plan)
        except OSError as e:
            _fail(b"jail file view: " + (e.filename if isinstance(e.filename, bytes) else b"?"), e.errno or 0)
    if plan.core_zero:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if plan.file_size >= 0:
        _signal(signal.SIGXFSZ, _SIG_IGN)   # ignored dispositions survive exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (plan.file_size, plan.file_size))
    for cap in range(plan.cap_last + 1):
        _ok(_prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), b"PR_CAPBSET_DROP")
    if plan.uid >= 0:
        try:
            os.setgroups([])
            os.setresgid(plan.gid, plan.gid, plan.gid)
            os.setresuid(plan.uid, plan.uid, plan.uid)
        except OSError as e:
            _fail(b"setuid", e.errno or 0)
        # the credential change cleared the death signal
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != plan.parent_pid:
            os._exit(1)
    if plan.user_ns:
        _enter_user_ns(plan, proc_fd)
    # Kept across exec; a kernel without them returns an error that is ignored
    # (the VM runs, without that saving).
    if plan.merge_memory:
        _prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0)
    if plan.fixed_layout:
        current = _personality(0xFFFFFFFF)
        if current != -1:
            _personality(current | ADDR_NO_RANDOMIZE)
    if plan.no_new_privs or plan.private_discard or plan.syscall_filter is not None:
        _ok(_prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), b"PR_SET_NO_NEW_PRIVS")
    if plan.private_discard:
        err = discard.install()
        if err:
            _fail(b"seccomp filter for copy-on-write RAM discards (aenv_vm/confine/discard.py)", err)
    if plan.syscall_filter is not None:
        err = plan.syscall_filter.install()
        if err:
            _fail(b"the syscall allow-list (aenv_vm/confine/syscall_filter.py)", err)


def _enter_user_ns(plan: ChildPlan, proc_fd: int) -> None:
    """A user namespace of its own mapping only its uid and gid to themselves (the
    process maps its own ids: no privilege needed). Creating it gives the process every
    capability *in* it, bounding set included: the set is dropped again, and the exec
    (by a non-root id, no_new_privs) clears the rest."""
    _prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)     # its /proc files are its own, not root's, to write the maps
    _ok(_unshare(CLONE_NEWUSER), b"unshare(CLONE_NEWUSER)")
    try:
        for name, text in ((b"setgroups", b"deny"), (b"uid_map", b"%d %d 1" % (plan.uid, plan.uid)),
                           (b"gid_map", b"%d %d 1" % (plan.gid, plan.gid))):
            fd = os.open(name, os.O_WRONLY, dir_fd=proc_fd)
            try:
                os.write(fd, text)
            finally:
                os.close(fd)
    except OSError as e:
        _fail(b"user namespace maps", e.errno or 0)
    os.close(proc_fd)
    for cap in range(plan.cap_last + 1):
        _ok(_prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), b"PR_CAPBSET_DROP (user namespace)")
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != plan.parent_pid:
        os._exit(1)


def probe_user_namespace(uid: int) -> str | None:
    """None if a child of this process, as ``uid``, can make a user namespace mapping its
    own ids (what ``enter`` does; AppArmor or ``max_user_namespaces = 0`` may forbid it),
    else why not."""
    import subprocess

    def child() -> None:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
            if _unshare(CLONE_NEWUSER) != 0:
                os._exit(3)
            for name, text in (("setgroups", b"deny"), ("uid_map", b"%d %d 1" % (uid, uid)),
                               ("gid_map", b"%d %d 1" % (uid, uid))):
                with open(f"/proc/self/{name}", "wb") as f:
                    f.write(text)
        except OSError:
            os._exit(4)
    try:
        done = subprocess.run(["true"], preexec_fn=child, timeout=10, env=child_env())
    except (OSError, subprocess.SubprocessError) as e:
        return f"a child could not make a user namespace: {e}"
    return None if done.returncode == 0 else \
        "an unprivileged process may not make a user namespace here (user.max_user_namespaces, AppArmor)"


def probe_mount_namespace(root: Path) -> str | None:
    """None if a child of this process can make a mount namespace and mount a tmpfs on
    ``root`` in it (what ``enter`` does), else why not."""
    import subprocess

    def child() -> None:
        if _unshare(CLONE_NEWNS) != 0 or _mount(b"tmpfs", os.fsencode(root), b"tmpfs", 0, b"size=4k") != 0:
            os._exit(3)
    try:
        done = subprocess.run(["true"], preexec_fn=child, timeout=10, env=child_env())
    except (OSError, subprocess.SubprocessError) as e:
        return f"a child could not make a mount namespace: {e}"
    return None if done.returncode == 0 else "unshare(CLONE_NEWNS) or mounting a tmpfs is not permitted here"
