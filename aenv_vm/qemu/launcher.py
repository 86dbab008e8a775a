"""Starting and stopping QEMU microVMs.

``VmSpec`` describes one VM; ``build_command`` turns it into a ``-M microvm``
command line (pure function, unit-tested); ``QemuProcess.start`` launches it
and connects QMP.

Every QEMU runs in its own process group with ``PR_SET_PDEATHSIG=SIGKILL`` set
between fork and exec, so it dies with the process that started it, even on
SIGKILL of that process (no orphans). A VM with ``netns`` set (tap networking,
aenv_vm/net) joins that network namespace in the same place, before exec,
and gets a tap netdev instead of user-mode networking. Linux delivers the death signal when the
*thread* that forked exits, so start VMs from a long-lived thread (the event
loop's), not from a short-lived worker thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

from envd import ENVD_PORT

from ..errors import VmError, VmTimeout
from .errors import QemuExited, QemuNotFound
from .qmp import QmpClient

QEMU_BINARY = "qemu-system-x86_64"
GUEST_IP = "10.0.2.15"
MIN_QEMU_VERSION = (7, 2, 0)
_PR_SET_PDEATHSIG = 1
_PR_SET_MEMORY_MERGE = 67        # Linux >= 6.4: every anonymous mapping KSM-mergeable
_ADDR_NO_RANDOMIZE = 0x0040000   # personality flag: no ASLR after exec
_UNIX_PATH_MAX = 107

Accel = Literal["tcg", "kvm"]
# ARAT (APIC timer keeps running in deep C-states): without it the guest kernel
# finds no one-shot clock event device that survives idle on microvm (no HPET),
# never goes tickless and takes 250 timer interrupts a second while idle,
# which under TCG cost ~50 ms of host CPU per second per idle VM (~12 with it).
TCG_CPU = "qemu64,+arat"


def find_qemu(binary: str | None = None) -> Path:
    """The QEMU system binary: ``binary``, $AENV_QEMU_BINARY, or qemu-system-x86_64 on PATH."""
    name = binary or os.environ.get("AENV_QEMU_BINARY") or QEMU_BINARY
    found = shutil.which(name)
    if not found:
        raise QemuNotFound(f"{name} not found: install Debian's qemu-system-x86 (bash scripts/install.sh)")
    return Path(found)


def qemu_version(binary: Path) -> tuple[int, int, int]:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise QemuNotFound(f"{binary} --version failed: {e}") from None
    m = re.search(r"version (\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise QemuNotFound(f"cannot read the version of {binary}: {out.strip()[:200]!r}")
    return (int(m[1]), int(m[2]), int(m[3]))


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
                           "-F", backing_format, str(overlay)], capture_output=True, text=True)
    if done.returncode != 0:
        raise VmError(f"qemu-img create {overlay} failed: {done.stderr.strip()}")
    return QcowDisk(Path(overlay))


# ---------------------------------------------------------------- spec

@dataclass(frozen=True)
class VmSpec:
    """Everything that defines one QEMU microVM process.

    Fields that must match between a template and its clones (or migration
    fails): memory_mib, vcpus, accel, the device set (disk/net present or not)."""
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
    mac: str = "52:54:00:12:34:56"
    incoming_defer: bool = False    # wait for migrate-incoming (clone restore)
    # TCG translation cache size in MiB (None: QEMU's default, 1 GiB of address space).
    # Smaller also shrinks TCG's lookup structures sized from it: less private memory per VM.
    tcg_tb_mib: int | None = None
    # KSM for the whole process and a fixed address layout (aenv_vm/ksm.py says why).
    merge_memory: bool = False
    fixed_layout: bool = False
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


def build_command(spec: VmSpec, qemu: Path | str = QEMU_BINARY) -> list[str]:
    if spec.memory_mib < 64:
        raise VmError(f"memory_mib must be >= 64, got {spec.memory_mib}")
    if spec.vcpus < 1:
        raise VmError(f"vcpus must be >= 1, got {spec.vcpus}")
    if len(str(spec.qmp_socket)) > _UNIX_PATH_MAX:
        raise VmError(f"QMP socket path too long for a Unix socket ({len(str(spec.qmp_socket))} > "
                      f"{_UNIX_PATH_MAX}): {spec.qmp_socket}")
    machine = "microvm"
    argv = [str(qemu), "-name", spec.name, "-nodefaults", "-no-user-config", "-display", "none",
            "-no-reboot", "-accel", spec.accel if spec.accel != "tcg" or spec.tcg_tb_mib is None
            else f"tcg,tb-size={spec.tcg_tb_mib}",
            # -cpu max/host break TCG here; KVM hosts get the host CPU.
            "-cpu", "host" if spec.accel == "kvm" else TCG_CPU,
            "-smp", str(spec.vcpus), "-m", f"{spec.memory_mib}M"]
    if spec.mem_path is not None:
        argv += ["-object", f"memory-backend-file,id=mem0,size={spec.memory_mib}M,"
                            f"mem-path={_opt(spec.mem_path)},share={'on' if spec.mem_share else 'off'}"]
        machine += ",memory-backend=mem0"
    argv += ["-machine", machine]
    if not spec.incoming_defer:
        # A VM that loads saved state never boots: with -kernel QEMU would keep the
        # kernel image in its own memory (~14 MiB private per clone) for nothing.
        argv += ["-kernel", str(spec.kernel), "-initrd", str(spec.initrd), "-append", spec.kernel_cmdline]
    argv += ["-chardev", f"file,id=serial0,path={_opt(spec.serial_log)}", "-serial", "chardev:serial0",
             "-qmp", f"unix:{_opt(spec.qmp_socket)},server=on,wait=off",
             "-object", "rng-random,id=rng0,filename=/dev/urandom", "-device", "virtio-rng-device,rng=rng0"]
    if spec.disk is not None:
        argv += ["-blockdev", json.dumps(spec.disk.blockdev(), separators=(",", ":")),
                 "-device", "virtio-blk-device,drive=disk0"]
    if spec.tap:
        if spec.netns is None:
            raise VmError("a tap network needs the sandbox's network namespace (VmSpec.netns)")
        argv += ["-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no",
                 "-device", f"virtio-net-device,netdev=net0,mac={spec.mac}"]
    elif spec.host_port is not None:
        argv += ["-netdev", f"user,id=net0,{'restrict=on,' if spec.net_restrict else ''}"
                            f"hostfwd=tcp:{spec.hostfwd_host}:{spec.host_port}-{GUEST_IP}:{spec.guest_port}",
                 "-device", f"virtio-net-device,netdev=net0,mac={spec.mac}"]
    if spec.incoming_defer:
        argv += ["-incoming", "defer"]
    return argv + list(spec.extra_args)


def _opt(path: Path) -> str:
    """A path inside a QEMU option string, where ',' must be doubled."""
    return str(path).replace(",", ",,")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (QEMU binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- process

# Resolved once in the parent: dlopen() in a child forked from a threaded process
# could deadlock on a loader lock another thread held at fork time.
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_personality = _libc.personality
_setns = _libc.setns
_CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")


def _child_setup(parent_pid: int, merge_memory: bool = False, fixed_layout: bool = False,
                 netns_fd: int = -1) -> None:
    """Runs in the child between fork and exec: no imports, no dlopen, no locks.
    The merge flag and the personality are kept across exec; a kernel without them
    returns an error that is ignored (the VM runs, without that saving)."""
    os.setpgid(0, 0)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    if merge_memory:
        _prctl(_PR_SET_MEMORY_MERGE, 1, 0, 0, 0)
    if fixed_layout:
        current = _personality(0xFFFFFFFF)
        if current != -1:
            _personality(current | _ADDR_NO_RANDOMIZE)
    # preexec runs before close_fds: the namespace's fd is still open here
    if netns_fd >= 0 and _setns(netns_fd, _CLONE_NEWNET) != 0:
        os._exit(2)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class QemuProcess:
    """One running QEMU: its process, its QMP connection and its run files."""

    def __init__(self, spec: VmSpec, proc: subprocess.Popen, argv: list[str]) -> None:
        self.spec = spec
        self.proc = proc
        self.argv = argv
        self.qmp: QmpClient | None = None
        self.started_at = time.monotonic()
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
        argv = build_command(spec, binary)
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        spec.qmp_socket.unlink(missing_ok=True)
        parent = os.getpid()
        netns_fd = -1
        if spec.netns is not None:
            try:
                netns_fd = os.open(NETNS_DIR / spec.netns, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise VmError(f"network namespace {spec.netns} of {spec.name} cannot be opened: {e}") from None
        try:
            with open(spec.stderr_log, "wb") as err:
                try:
                    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                            close_fds=True, preexec_fn=lambda: _child_setup(
                                                parent, spec.merge_memory, spec.fixed_layout, netns_fd))
                except OSError as e:
                    raise QemuNotFound(f"cannot start {binary}: {e}") from None
        finally:
            if netns_fd >= 0:
                os.close(netns_fd)
        vm = cls(spec, proc, argv)
        try:
            vm.qmp = await QmpClient.connect(spec.qmp_socket, timeout=qmp_timeout,
                                             alive=lambda: proc.poll() is None)
        except BaseException as e:
            await vm.kill()
            if isinstance(e, VmError):
                why = f"exited with code {proc.returncode}" if proc.returncode not in (None, -9) else str(e)
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
        if self._pidfd >= 0:
            if self._exited is not None and not self._exited.done():
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(self._pidfd)
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
        self._pidfd = -1
        self.spec.qmp_socket.unlink(missing_ok=True)
