"""Starting and stopping QEMU microVMs.

``VmSpec`` describes one VM; ``build_command`` turns it into a ``-M microvm``
command line (pure function, unit-tested); ``QemuProcess.start`` launches it
and connects QMP.

Every QEMU runs in its own process group with ``PR_SET_PDEATHSIG=SIGKILL`` set
between fork and exec, so it dies with the process that started it, even on
SIGKILL of that process (no orphans). A VM with ``netns`` set (tap networking,
aenv_vm/net) joins that network namespace in the same place, before exec,
and gets a tap netdev instead of user-mode networking. Linux delivers the death signal when the
*thread* that forked exits, so VMs are forked from one long-lived thread of this
module's (``_spawner``), never from a short-lived worker thread, nor from the event
loop, which would wait for each child to reach exec.

Its serial console is a socket whose other end the node reads into a bounded ring
(console.py): ``serial.log`` in its run dir holds the newest ``console_bytes`` of it.

A VM with ``jail`` set (aenv_vm/confine) is confined: its own uid, no
capabilities, no_new_privs, QEMU's seccomp filter, its own mount namespace
holding only the files ``jail_view`` lists, and a cgroup made here for this
process and removed when it is gone. The child-side order is in
aenv_vm/confine/jail.py (``enter``). Files such a QEMU could have replaced
(its run dir's files) are read with ``open_vm_file`` (no symlinks followed).

A VM whose RAM is a copy-on-write mapping (``mem_share`` off: a clone of a
template) gets, confined or not, the seccomp filter that keeps QEMU's RAM
discards out of the shared file (aenv_vm/confine/discard.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

from envd import ENVD_PORT

from ..childenv import ChildKind, child_env
from ..confine.cgroups import VmCgroup
from ..confine.errors import ConfinementError
from ..confine.jail import BASE_DEVICES, SECCOMP, FileView, Jail, child_plan, enter, file_view
from ..confine.refusals import refused_calls
from ..confine.romem import ENV as READONLY_RAM_ENV
from ..confine.romem import ReadonlyRam
from ..errors import VmError, VmTimeout
from .console import CONSOLE_BYTES, ConsoleReader, ConsoleRing
from .binary import MIN_QEMU_VERSION, QEMU_BINARY, find_qemu, qemu_version
from .errors import QemuExited, QemuNotFound
from .qmp import QmpClient

GUEST_IP = "10.0.2.15"
GUEST_MAC = "52:54:00:12:34:56"     # every clone's: its template's
_UNIX_PATH_MAX = 107

Accel = Literal["tcg", "kvm"]
# ARAT (APIC timer keeps running in deep C-states): without it the guest kernel
# finds no one-shot clock event device that survives idle on microvm (no HPET),
# never goes tickless and takes 250 timer interrupts a second while idle,
# which under TCG cost ~50 ms of host CPU per second per idle VM (~12 with it).
TCG_CPU = "qemu64,+arat"
# Free page reporting: the guest's virtio_balloon driver hands the host the 2-4 MiB
# blocks its page allocator has free, QEMU discards them (MADV_DONTNEED, a clone's hole
# punch made a no-op: aenv_vm/confine/discard.py), so memory a guest frees goes back to
# the host within seconds (docs/guest.md). page-poison=off: the guest reports only if
# it expects nothing of a reported page's content (a discarded page of a copy-on-write
# clone reads as the template's page again, not as zeroes). No stats polling and no
# inflation: the node never asks the guest anything through it. Every VM has it, so a
# template's device state and its clones' devices match.
BALLOON_DEVICE = "virtio-balloon-device,free-page-reporting=on,page-poison=off"


# ---------------------------------------------------------------- disks

@dataclass(frozen=True)
class QcowDisk:
    """A qcow2 file (typically a per-VM overlay whose backing file is the shared image)."""
    path: Path

    def blockdev(self) -> dict:
        return {"driver": "qcow2", "node-name": "disk0",
                "file": {"driver": "file", "filename": str(self.path)}}


@dataclass(frozen=True)
class RawDisk:
    """A raw image used as it is. Writable only if ``read_only`` is False: the guest
    then changes the file itself, so never point it at a cached image."""
    path: Path
    read_only: bool = True

    def blockdev(self) -> dict:
        return {"driver": "raw", "node-name": "disk0", "read-only": self.read_only,
                "file": {"driver": "file", "filename": str(self.path), "read-only": self.read_only}}


@dataclass(frozen=True)
class NbdDisk:
    """An NBD export on a Unix socket (aenv_vm.blockimage serves layered images this way)."""
    socket: Path
    export: str

    def blockdev(self) -> dict:
        return {"driver": "nbd", "node-name": "disk0",
                "server": {"type": "unix", "path": str(self.socket)}, "export": self.export}


Disk = Union[QcowDisk, RawDisk, NbdDisk]


def create_overlay(backing: Path, overlay: Path, backing_format: str = "raw",
                   qemu_img: str = "qemu-img") -> QcowDisk:
    """A qcow2 overlay on ``backing`` so the VM's writes never reach the shared image."""
    if not shutil.which(qemu_img):
        raise QemuNotFound(f"{qemu_img} not found: install Debian's qemu-utils")
    done = subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", "-b", str(Path(backing).resolve()),
                           "-F", backing_format, str(overlay)], capture_output=True, text=True, env=child_env())
    if done.returncode != 0:
        raise VmError(f"qemu-img create {overlay} failed: {done.stderr.strip()}")
    return QcowDisk(Path(overlay))


# ---------------------------------------------------------------- spec

@dataclass(frozen=True)
class VmSpec:
    """Everything that defines one QEMU microVM process.

    Fields that must match between a template and its clones (or migration
    fails): memory_mib, vcpus, accel, the device set (disk/net present or not;
    the rng and balloon devices every VM has)."""
    name: str
    kernel: Path
    initrd: Path
    kernel_cmdline: str
    run_dir: Path                   # qmp.sock, serial.log, qemu.log live here
    memory_mib: int = 256
    vcpus: int = 1
    accel: Accel = "tcg"
    mem_path: Path | None = None    # RAM as memory-backend-file; None = anonymous RAM
    mem_share: bool = True          # share=on (template/source) or share=off (copy-on-write clone)
    disk: Disk | None = None
    host_port: int | None = None    # user-mode net with hostfwd <hostfwd_host>:host_port -> guest envd
    hostfwd_host: str = "127.0.0.1" # where user-mode host forwards listen (the namespace's address when isolated)
    netns: str | None = None        # run in this network namespace (/run/netns)
    tap: bool = False               # tap net (tap0 in ``netns``) instead of user-mode networking
    net_restrict: bool = False      # user net: the guest reaches neither the host nor beyond (forwards still work)
    guest_port: int = ENVD_PORT
    mac: str = GUEST_MAC
    incoming_defer: bool = False    # wait for migrate-incoming (clone restore)
    # TCG translation cache size in MiB (None: QEMU's default, 1 GiB of address space).
    # Smaller also shrinks TCG's lookup structures sized from it: less private memory per VM.
    tcg_tb_mib: int | None = None
    # KSM for the whole process and a fixed address layout (aenv_vm/ksm.py says why).
    merge_memory: bool = False
    fixed_layout: bool = False
    jail: Jail | None = None        # confined (aenv_vm/confine); None: runs as the node does
    console_bytes: int = CONSOLE_BYTES  # the most of its serial console the node keeps (console.py)
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def qmp_socket(self) -> Path:
        return self.run_dir / "qmp.sock"

    @property
    def serial_log(self) -> Path:
        return self.run_dir / "serial.log"

    @property
    def stderr_log(self) -> Path:
        return self.run_dir / "qemu.log"


def build_command(spec: VmSpec, qemu: Path | str = QEMU_BINARY, *, console_fd: int) -> list[str]:
    """QEMU's command line for ``spec``; its serial console is the connected socket
    ``console_fd`` (inherited by QEMU; the node reads the other end, console.py)."""
    if spec.memory_mib < 64:
        raise VmError(f"memory_mib must be >= 64, got {spec.memory_mib}")
    if spec.vcpus < 1:
        raise VmError(f"vcpus must be >= 1, got {spec.vcpus}")
    if len(str(spec.qmp_socket)) > _UNIX_PATH_MAX:
        raise VmError(f"QMP socket path too long for a Unix socket ({len(str(spec.qmp_socket))} > "
                      f"{_UNIX_PATH_MAX}): {spec.qmp_socket}")
    machine = "microvm"
    tb = tcg_buffer_mib(spec)
    argv = [str(qemu), "-name", spec.name, "-nodefaults", "-no-user-config", "-display", "none",
            "-no-reboot", "-accel", spec.accel if spec.accel != "tcg" or tb is None else f"tcg,tb-size={tb}",
            # -cpu max/host break TCG here; KVM hosts get the host CPU.
            "-cpu", "host" if spec.accel == "kvm" else TCG_CPU,
            "-smp", str(spec.vcpus), "-m", f"{spec.memory_mib}M"]
    if spec.jail is not None and spec.jail.seccomp:
        argv += ["-sandbox", SECCOMP]
    if spec.mem_path is not None:
        # QEMU >= 8.2 maps a file it opened read-only as writable RAM (copy-on-write)
        rom_off = (spec.jail is not None and spec.jail.readonly_ram is ReadonlyRam.ROM_OFF
                   and not spec.mem_share)
        argv += ["-object", f"memory-backend-file,id=mem0,size={spec.memory_mib}M,"
                            f"mem-path={_opt(spec.mem_path)},share={'on' if spec.mem_share else 'off'}"
                            + (",readonly=on,rom=off" if rom_off else "")]
        machine += ",memory-backend=mem0"
    argv += ["-machine", machine]
    if not spec.incoming_defer:
        # A VM that loads saved state never boots: with -kernel QEMU would keep the
        # kernel image in its own memory (~14 MiB private per clone) for nothing.
        argv += ["-kernel", str(spec.kernel), "-initrd", str(spec.initrd), "-append", spec.kernel_cmdline]
    argv += ["-chardev", f"socket,id=serial0,fd={console_fd}", "-serial", "chardev:serial0",
             "-qmp", f"unix:{_opt(spec.qmp_socket)},server=on,wait=off",
             "-object", "rng-random,id=rng0,filename=/dev/urandom", "-device", "virtio-rng-device,rng=rng0"]
    if spec.disk is not None:
        # werror=report: a write the host refuses (the node's free-disk floor: ENOSPC) is an
        # I/O error in the guest, instead of QEMU's default of stopping the VM for good
        argv += ["-blockdev", json.dumps(spec.disk.blockdev(), separators=(",", ":")),
                 "-device", "virtio-blk-device,drive=disk0,werror=report"]
    if spec.tap:
        if spec.netns is None:
            raise VmError("a tap network needs the sandbox's network namespace (VmSpec.netns)")
        argv += ["-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no",
                 "-device", f"virtio-net-device,netdev=net0,mac={spec.mac}"]
    elif spec.host_port is not None:
        argv += ["-netdev", f"user,id=net0,{'restrict=on,' if spec.net_restrict else ''}"
                            f"hostfwd=tcp:{spec.hostfwd_host}:{spec.host_port}-{GUEST_IP}:{spec.guest_port}",
                 "-device", f"virtio-net-device,netdev=net0,mac={spec.mac}"]
    argv += ["-device", BALLOON_DEVICE]
    if spec.incoming_defer:
        argv += ["-incoming", "defer"]
    return argv + list(spec.extra_args)


def tcg_buffer_mib(spec: VmSpec) -> int | None:
    """TCG's translated-code buffer in MiB (None: QEMU's default, 1 GiB; KVM: none). A
    confined QEMU gets the jail's when none is configured: its cgroup's memory bound
    includes the buffer, which must therefore be bounded itself."""
    if spec.accel != "tcg":
        return None
    if spec.tcg_tb_mib is not None:
        return spec.tcg_tb_mib
    return spec.jail.tcg_tb_mib if spec.jail is not None else None


def _opt(path: Path) -> str:
    """A path inside a QEMU option string, where ',' must be doubled."""
    return str(path).replace(",", ",,")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (QEMU binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- process

NETNS_DIR = Path("/run/netns")
RESOLV_CONF = Path("/etc/resolv.conf")
LD_SO_CACHE = Path("/etc/ld.so.cache")


def jail_view(spec: VmSpec, binary: Path) -> FileView:
    """The files a confined QEMU of ``spec`` sees (its mount namespace): its run dir
    (read-write: QMP socket, console, NBD socket), its memory file (read-only when
    mapped copy-on-write, read-write when it is the VM's own ``share=on`` file),
    kernel and initrd when it boots, its disk's socket or file, the device nodes it
    opens, ``/etc/resolv.conf`` for user-mode DNS, ``/etc/ld.so.cache``, the
    read-only RAM shim."""
    jail = spec.jail
    assert jail is not None
    read: list[Path] = []
    write: list[Path] = []
    execute: list[Path] = []
    if spec.mem_path is not None:
        (write if spec.mem_share else read).append(spec.mem_path)
    if not spec.incoming_defer:
        read += [spec.kernel, spec.initrd]
    disk = spec.disk
    if isinstance(disk, NbdDisk):
        if not disk.socket.is_relative_to(spec.run_dir):
            write.append(disk.socket)
    elif isinstance(disk, RawDisk):
        (read if disk.read_only else write).append(disk.path)
    elif isinstance(disk, QcowDisk):
        raise ConfinementError(f"{spec.name}: a confined VM's disk must be NBD or raw "
                               "(a qcow2 overlay's backing chain is not bound into the jail)")
    if _preload(spec):
        assert jail.shim is not None
        execute.append(jail.shim)
    if not binary.resolve().is_relative_to("/usr"):
        execute.append(binary.resolve())
    devices = list(BASE_DEVICES) + (["kvm"] if spec.accel == "kvm" else []) + (
        ["net/tun"] if spec.tap else [])
    if LD_SO_CACHE.is_file():   # without it the loader searches every library dir for QEMU's ~100 libraries
        read.append(LD_SO_CACHE)
    # user mode: slirp sends the guest's DNS to the nameserver resolv.conf names (none
    # there: no DNS at all); in a sandbox namespace the rules redirect it, whatever it
    # names, to the node's forwarder
    resolv = RESOLV_CONF if not spec.tap and RESOLV_CONF.exists() else None
    return file_view(read=read, write=write, write_dirs=[spec.run_dir], execute=execute, devices=devices,
                     owner=-1 if jail.uid is None else jail.uid, resolv_conf=resolv)


def _preload(spec: VmSpec) -> bool:
    return (spec.jail is not None and spec.jail.readonly_ram is ReadonlyRam.PRELOAD and spec.jail.shim is not None
            and spec.mem_path is not None and not spec.mem_share)


def _give_to_jail(spec: VmSpec) -> None:
    """Hand the files a confined QEMU writes to its uid: the run dir (and whatever an
    earlier QEMU of the sandbox left in it), its own share=on memory file (made here
    at its size), the socket of its disk. Nothing else on the host becomes its."""
    jail = spec.jail
    assert jail is not None
    uid = jail.uid
    if uid is None:
        return
    gid = uid if jail.gid is None else jail.gid
    os.chown(spec.run_dir, uid, gid)
    os.chmod(spec.run_dir, 0o700)
    for entry in spec.run_dir.iterdir():
        os.chown(entry, uid, gid, follow_symlinks=False)
    if spec.mem_path is not None and spec.mem_share:
        fd = os.open(spec.mem_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < spec.memory_mib << 20:
                os.ftruncate(fd, spec.memory_mib << 20)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
    if isinstance(spec.disk, NbdDisk) and spec.disk.socket.exists():
        os.chown(spec.disk.socket, uid, gid, follow_symlinks=False)


def open_vm_file(path: Path) -> int:
    """A file a QEMU wrote (its console log), opened for reading without following a
    symlink: a confined QEMU owns its run dir and could point the name anywhere.
    OSError if it is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def _tail(path: Path, lines: int = 20) -> str:
    try:
        with open(open_vm_file(path), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


_spawner_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread this process forks every QEMU from. Linux sends a QEMU its death
    signal (PR_SET_PDEATHSIG) when the *thread* that forked it exits, so that thread must
    live as long as the process: this one does (one worker, never shut down; a forked
    child process makes its own). Spawning here instead of on the event loop keeps the
    loop serving while a child sets itself up before exec (its jail, namespaces,
    cgroup): Popen returns only once the child has exec'd, 10-100 ms under a burst of
    restores on a busy host, and making the cgroup (mkdir and limit writes in cgroupfs)
    takes ~10 ms more."""
    global _spawner_pool
    if _spawner_pool is None or _spawner_pool[0] != os.getpid():
        _spawner_pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="aenv-qemu-spawn"))
    return _spawner_pool[1]


Spawned = tuple[subprocess.Popen, VmCgroup | None, bool, ConsoleReader]


def _spawn(spec: VmSpec, binary: Path, argv: list[str], console: ConsoleReader) -> Spawned:
    """QEMU of ``spec`` forked and exec'd (on the ``_spawner`` thread): its process, its cgroup
    (confined), whether it is still to be moved into it (``late``) and its console, whose
    ring file is made once the run dir is the QEMU's (the node's file in it)."""
    try:
        return _spawn_qemu(spec, binary, argv, console)
    except BaseException:
        console.discard()
        raise


def _spawn_qemu(spec: VmSpec, binary: Path, argv: list[str], console: ConsoleReader) -> Spawned:
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    spec.qmp_socket.unlink(missing_ok=True)
    jail = spec.jail
    # never the node's environment (its secrets): what QEMU needs, and the shim's below
    env = child_env(ChildKind.QEMU)
    view: FileView | None = None
    cgroup: VmCgroup | None = None
    if jail is not None:
        _give_to_jail(spec)
        view = jail_view(spec, binary) if jail.mount_ns else None
        if _preload(spec):
            assert jail.shim is not None and spec.mem_path is not None
            env.update({"LD_PRELOAD": str(jail.shim), READONLY_RAM_ENV: str(spec.mem_path)})
        if jail.cgroups is not None:
            cgroup = jail.cgroups.create(jail.uid if jail.uid is not None else os.getuid(),
                                         jail.limits(spec.memory_mib, spec.vcpus, tcg_buffer_mib(spec) or 0))
    netns_fd = -1
    if spec.netns is not None:
        try:
            netns_fd = os.open(NETNS_DIR / spec.netns, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            if cgroup is not None:
                cgroup.remove(wait=0)
            raise VmError(f"network namespace {spec.netns} of {spec.name} cannot be opened: {e}") from None
    # Joining a cgroup costs a RCU grace period (~13 ms here, cgroup v1's threadgroup
    # lock): a QEMU that waits for its state (-incoming defer) runs no guest code before
    # start() returns, so it is moved in from there while it initialises; one that boots
    # joins before exec.
    late_cgroup = cgroup is not None and spec.incoming_defer
    plan = child_plan(
        view, parent_pid=os.getpid(), root=jail.root_dir if jail is not None else Path("/"),
        cgroup_procs=cgroup.procs_files if cgroup is not None and not late_cgroup else (), netns_fd=netns_fd,
        uid=jail.uid if jail is not None else None, gid=jail.gid if jail is not None else None,
        cap_last=jail.cap_last if jail is not None else -1,
        file_size=jail.file_size_limit(spec.memory_mib) if jail is not None else -1,
        merge_memory=spec.merge_memory, fixed_layout=spec.fixed_layout, no_new_privs=jail is not None,
        core_dumps=jail is None, private_discard=spec.mem_path is not None and not spec.mem_share,
        syscall_filter=jail.syscalls if jail is not None else None, user_ns=jail is not None and jail.user_ns)
    try:
        ring = ConsoleRing(spec.serial_log, spec.console_bytes)
        with open(spec.stderr_log, "wb") as err:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env,
                                        close_fds=True, pass_fds=(console.qemu_fd,), preexec_fn=lambda: enter(plan))
            except OSError as e:
                ring.close()
                if cgroup is not None:
                    cgroup.remove(wait=0)
                raise QemuNotFound(f"cannot start {binary}: {e}") from None
    finally:
        if netns_fd >= 0:
            os.close(netns_fd)
    console.handed_over(ring)
    return proc, cgroup, late_cgroup, console


def _kill_unclaimed(spawned: asyncio.Future[Spawned]) -> None:
    """A QEMU whose start was cancelled while it was being spawned: killed, its cgroup
    removed, its console closed."""
    if spawned.cancelled() or spawned.exception() is not None:
        return
    proc, cgroup, _, console = spawned.result()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)

    def reap() -> None:
        proc.wait()
        console.discard()
        if cgroup is not None:
            cgroup.remove()
    _spawner().submit(reap)


class QemuProcess:
    """One running QEMU: its process, its QMP connection and its run files."""

    def __init__(self, spec: VmSpec, proc: subprocess.Popen, argv: list[str], console: ConsoleReader) -> None:
        self.spec = spec
        self.proc = proc
        self.argv = argv
        self.console = console          # its serial console's reader and ring (console.py)
        self.qmp: QmpClient | None = None
        self.started_at = time.monotonic()
        self.cgroup: VmCgroup | None = None     # its own cgroup (confined), removed with it
        self._pidfd = os.pidfd_open(proc.pid)
        self._exited: asyncio.Future[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, spec: VmSpec, qemu: Path | None = None, qmp_timeout: float = 10.0) -> "QemuProcess":
        """Launch QEMU and connect QMP. On any failure QEMU is killed and the error
        carries the tail of QEMU's stderr and of the serial console."""
        binary = qemu or find_qemu()
        console = ConsoleReader()
        try:
            argv = build_command(spec, binary, console_fd=console.qemu_fd)
        except BaseException:
            console.discard()
            raise
        # Forked and exec'd on the spawner thread (see ``_spawn``): the event loop goes on
        # serving while the child sets itself up.
        spawned = asyncio.get_running_loop().run_in_executor(_spawner(), _spawn, spec, binary, argv, console)
        try:
            proc, cgroup, late_cgroup, _ = await asyncio.shield(spawned)
        except asyncio.CancelledError:
            spawned.add_done_callback(_kill_unclaimed)     # it runs on: its QEMU must not outlive this
            raise
        vm = cls(spec, proc, argv, console)
        vm.cgroup = cgroup
        joined = asyncio.ensure_future(asyncio.to_thread(cgroup.attach, proc.pid)) \
            if cgroup is not None and late_cgroup else None
        try:
            await console.start()
            vm.qmp = await QmpClient.connect(spec.qmp_socket, timeout=qmp_timeout,
                                             alive=lambda: proc.poll() is None)
            if joined is not None:
                await joined
        except BaseException as e:
            if joined is not None:
                with contextlib.suppress(BaseException):
                    await joined
            await vm.kill()
            if isinstance(e, VmError):
                why = f"exited with code {proc.returncode}" if proc.returncode not in (None, -9) else str(e)
                if spec.jail is not None:   # a refused syscall shows only in the kernel log
                    note = await asyncio.to_thread(refused_calls, proc.pid)
                    why += f"\n{note}" if note else ""
                raise QemuExited(f"QEMU {spec.name} failed to start: {why}\n{vm.log_tail()}",
                                 stderr=_tail(spec.stderr_log)) from None
            raise
        return vm

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def wait_exit(self, timeout: float) -> int:
        """Wait for QEMU to exit (pidfd readiness, no polling) and return its exit code."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        if self._exited is None:  # one pidfd reader shared by every waiter
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[None] = loop.create_future()
            pidfd = self._pidfd

            def ready() -> None:
                loop.remove_reader(pidfd)
                if not exited.done():
                    exited.set_result(None)
            loop.add_reader(pidfd, ready)
            self._exited = exited
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        except asyncio.TimeoutError:
            raise VmTimeout(f"QEMU {self.spec.name} (pid {self.pid}) still running after {timeout} s") from None
        return self.proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        parts = []
        err = _tail(self.spec.stderr_log, lines)
        if err:
            parts.append(f"--- qemu stderr ({self.spec.stderr_log}) ---\n{err}")
        ser = _tail(self.spec.serial_log, lines)
        if ser:
            parts.append(f"--- serial console ({self.spec.serial_log}) ---\n{ser}")
        return "\n".join(parts)

    async def stop(self, timeout: float = 3.0) -> None:
        """Ask QEMU to quit, then SIGKILL its process group if it lingers; remove the QMP socket."""
        if self.alive() and self.qmp is not None and not self.qmp.closed:
            with contextlib.suppress(VmError, OSError):
                await self.qmp.execute("quit", timeout=timeout)
            with contextlib.suppress(VmTimeout):
                await self.wait_exit(timeout)
        await self.kill()

    async def kill(self) -> None:
        """SIGKILL QEMU's process group and reap it. Idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(VmTimeout):
                await self.wait_exit(10.0)
            self.proc.wait()
        if self.qmp is not None:
            await self.qmp.close()
        await self.console.close()      # after the exit: what QEMU left in the socket is kept
        if self._pidfd >= 0:
            if self._exited is not None and not self._exited.done():
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(self._pidfd)
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
        self._pidfd = -1
        if self.cgroup is not None:
            cgroup, self.cgroup = self.cgroup, None
            await asyncio.to_thread(cgroup.remove)
        self.spec.qmp_socket.unlink(missing_ok=True)
