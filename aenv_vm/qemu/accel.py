"""Choosing the accelerator: KVM only if a probe VM really boots with it, else TCG.

/dev/kvm existing (even opening and running real-mode code) is not enough:
on PVM hosts stock guest kernels hang at boot under KVM. So the probe boots
the guest kernel + initramfs with ``aenv.probe`` on the command line; the
initramfs prints AENV_PROBE_OK and reboots (QEMU exits, -no-reboot). No marker
within the timeout means TCG. The result is cached in a JSON file keyed by
QEMU binary, kernel, initramfs and host boot id, so the probe runs once per
host boot and guest build.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..confine.policy import Confinement, jail_for
from ..errors import VmError
from ..confine.jail import Jail
from .launcher import Accel, QemuProcess, VmSpec, find_qemu, open_vm_file

log = logging.getLogger(__name__)
PROBE_MARKER = "AENV_PROBE_OK"
PROBE_CMDLINE = "console=ttyS0 quiet panic=-1 tsc_early_khz=2000000 tsc=reliable no_timer_check aenv.probe"


@dataclass(frozen=True)
class AccelChoice:
    accel: Accel
    reason: str
    probe_seconds: float = 0.0
    cached: bool = False


def kvm_usable() -> tuple[bool, str]:
    """Whether /dev/kvm exists and opens read-write (necessary, not sufficient)."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False, "/dev/kvm does not exist"
    except OSError as e:
        return False, f"/dev/kvm cannot be opened: {e.strerror}"
    os.close(fd)
    return True, "/dev/kvm opens read-write"


def _cache_key(qemu: Path, kernel: Path, initrd: Path) -> str:
    h = hashlib.sha256()
    for p in (qemu, kernel, initrd):
        st = p.stat()
        h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    try:
        h.update(Path("/proc/sys/kernel/random/boot_id").read_bytes())
    except OSError:
        pass
    return h.hexdigest()[:16]


async def _boot_probe(qemu: Path, kernel: Path, initrd: Path, timeout: float,
                      confinement: Confinement | None) -> tuple[bool, str, float]:
    async with jail_for(confinement, f"accel-probe-{os.getpid()}") as jail:
        return await _boot(qemu, kernel, initrd, timeout, jail)


async def _boot(qemu: Path, kernel: Path, initrd: Path, timeout: float, jail: Jail | None) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="aenv-probe-") as tmp:
        spec = VmSpec(name="aenv-accel-probe", kernel=kernel, initrd=initrd, kernel_cmdline=PROBE_CMDLINE,
                      run_dir=Path(tmp), memory_mib=128, accel="kvm", jail=jail)
        start = time.monotonic()
        try:
            vm = await QemuProcess.start(spec, qemu=qemu, qmp_timeout=timeout)
        except VmError as e:
            lines = (getattr(e, "stderr", "") or str(e)).strip().splitlines() or ["?"]
            return False, f"QEMU failed under KVM: {lines[0]}", time.monotonic() - start
        try:
            while time.monotonic() - start < timeout:
                if PROBE_MARKER in _console(spec.serial_log):
                    return True, "probe VM booted under KVM", time.monotonic() - start
                if not vm.alive():
                    return False, f"probe VM exited (code {vm.returncode}) without booting", time.monotonic() - start
                await asyncio.sleep(0.05)
            return False, f"probe VM did not boot under KVM within {timeout:.0f} s", time.monotonic() - start
        finally:
            await vm.kill()


def _console(path: Path) -> str:
    try:
        with open(open_vm_file(path), "rb") as f:
            return f.read(1 << 20).decode(errors="replace")
    except OSError:
        return ""


async def probe_accel(kernel: Path, initrd: Path, *, qemu: Path | None = None, timeout: float = 5.0,
                      cache_file: Path | None = None, force: bool = False,
                      confinement: Confinement | None = None) -> AccelChoice:
    """KVM if a probe VM boots under it within ``timeout`` seconds, else TCG (logged).
    The probe VM is confined by ``confinement`` (None: an ``auto`` policy of its own)."""
    qemu = qemu or find_qemu()
    ok, why = kvm_usable()
    if not ok:
        choice = AccelChoice("tcg", f"TCG: {why}")
        log.info("accelerator: %s", choice.reason)
        return choice
    key = _cache_key(qemu, kernel, initrd)
    if cache_file is not None and not force:
        try:
            data = json.loads(cache_file.read_text())
            if data.get("key") == key:
                choice = AccelChoice(data["accel"], data["reason"], data["probe_seconds"], cached=True)
                log.info("accelerator: %s (cached probe)", choice.reason)
                return choice
        except (OSError, ValueError, KeyError):
            pass
    booted, detail, seconds = await _boot_probe(qemu, kernel, initrd, timeout, confinement)
    choice = AccelChoice("kvm" if booted else "tcg", f"{'KVM' if booted else 'TCG'}: {detail}", round(seconds, 2))
    log.info("accelerator: %s", choice.reason)
    if cache_file is not None:
        tmp = cache_file.with_name(cache_file.name + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, **asdict(choice)}))
        os.replace(tmp, cache_file)
    return choice
