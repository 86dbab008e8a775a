"""Host checks for running microVMs (`aenv doctor`): QEMU, the guest image, the
accelerator that will be used and why, /dev/kvm, disk space, whether tap
networking (``[vm] network = "tap"``) can work here, and which parts of QEMU
confinement (``[vm] confine``) apply."""
from __future__ import annotations

import asyncio
import enum
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .guest import find_guest, guest_cache_root
from .qemu.accel import kvm_usable, probe_accel
from .errors import VmError
from .qemu.launcher import MIN_QEMU_VERSION, find_qemu, qemu_version

if TYPE_CHECKING:
    from .confine.policy import Confinement

GIB = 1 << 30
DISK_FAIL_BYTES = 1 * GIB
DISK_WARN_BYTES = 5 * GIB
GUEST_BUILD_TOOLS = ("apt-get", "dpkg-deb", "debootstrap", "mkfs.ext4", "modinfo", "chroot")


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(name: str, path: Path) -> Check:
    where = _existing_parent(path)
    free = shutil.disk_usage(where).free
    text = f"{free / GIB:.1f} GiB free at {where}"
    if free < DISK_FAIL_BYTES:
        return Check(name, Status.FAIL, text + f" (need at least {DISK_FAIL_BYTES // GIB} GiB)")
    if free < DISK_WARN_BYTES:
        return Check(name, Status.WARN, text + f" (below {DISK_WARN_BYTES // GIB} GiB)")
    return Check(name, Status.OK, text)


def check_tap_network(data_dir: Path, configured: str = "auto", isolation: str = "auto") -> Check:
    """Can tap mode work: root, nft/ip/nsenter, /dev/net/tun, and a real namespace made
    and removed. FAIL only when the config asks for tap; otherwise a WARN says why not
    (and, for "auto", which mode the node then runs in)."""
    from .net.netns import NetError
    from .net.networks import decide_mode, probe_tap, tap_problems
    name = f"network (configured: {configured})"
    problems = tap_problems()
    if not problems:
        try:
            probe_tap(data_dir / "doctor-probe")   # its own tag: never one of a running node
        except (NetError, OSError) as e:
            problems = [f"a test namespace could not be made: {e}"]
    mode = decide_mode(configured, isolation, problems)
    if not problems:
        return Check(name, Status.OK, "tap mode works here (namespace, veth, tap and nft rules made and removed)"
                     + f"; {mode} mode in use")
    text = "tap mode cannot work: " + "; ".join(problems)
    if configured == "tap":
        return Check(name, Status.FAIL, text)
    return Check(name, Status.WARN, text + " (user mode in use works)")


def check_network_isolation(mode: str = "auto", isolation: str = "auto") -> Check:
    """Which network isolation a node configured so gets here (``[vm] network`` and
    ``[vm] isolation``): OK with namespaces per sandbox; WARN without (restricted or
    off); FAIL when the configuration cannot be met."""
    from .net.netns import NetError
    from .net.networks import describe, plan_network
    name = "network isolation"
    try:
        plan = plan_network(mode, isolation)
    except NetError as e:
        return Check(name, Status.FAIL, str(e))
    return Check(name, Status.OK if plan.isolated else Status.WARN,
                 describe(plan.mode, isolation, plan.isolated, plan.why_not))


def check_confinement(level: str = "auto", confinement: "Confinement | None" = None) -> list[Check]:
    """One row per part of QEMU confinement (aenv_vm/confine): OK when it applies here;
    when it does not, FAIL if ``[vm] confine = "required"``, else WARN saying why."""
    from .confine.errors import ConfinementError
    from .confine.policy import Confinement
    c = confinement if confinement is not None else Confinement(level)
    try:
        c.start()
    except ConfinementError:
        pass    # "required" not met: the rows below say which part
    except VmError as e:
        return [Check("confine", Status.FAIL, str(e))]
    out = []
    for part in c.parts():
        if part.on:
            out.append(Check(f"confine: {part.name}", Status.OK, part.detail))
        else:
            status = Status.FAIL if c.level.value == "required" else Status.WARN
            out.append(Check(f"confine: {part.name}", status, f"off: {part.detail}"))
    return out


def check_ksm() -> Check:
    """Whether `[vm] ksm` can work here, and what ksmd has saved so far."""
    from . import ksm
    stats = ksm.read_stats()
    if stats is None:
        return Check("ksm", Status.WARN, "no KSM in this kernel: set [vm] ksm = false (clones use more memory)")
    if not ksm.process_merge_supported():
        return Check("ksm", Status.WARN, "kernel lacks PR_SET_MEMORY_MERGE (Linux >= 6.4): only guest RAM merges")
    if not os.access(ksm.KSM_SYSFS / "run", os.W_OK):
        return Check("ksm", Status.WARN, "/sys/kernel/mm/ksm is not writable: run the server as root or set "
                                         "[vm] ksm = false")
    state = {0: "stopped", 1: "running", 2: "unmerging"}.get(stats.run, str(stats.run))
    return Check("ksm", Status.OK, f"ksmd {state}; {stats.saved_bytes / (1 << 20):.1f} MiB saved, "
                                   f"{stats.full_scans} full scans")


def run_checks(data_dir: Path, *, probe: bool = True, guest_cache: Path | None = None,
               network: str = "auto", isolation: str = "auto",
               confinement: "Confinement | None" = None) -> list[Check]:
    """``confinement``: the node's policy (``VmConfig.confinement()``; None: ``auto``)."""
    from .confine.policy import Confinement
    confinement = confinement if confinement is not None else Confinement()
    checks: list[Check] = []
    qemu = None
    try:
        qemu = find_qemu()
        ver = qemu_version(qemu)
        text = f"QEMU {'.'.join(map(str, ver))} ({qemu})"
        if ver < MIN_QEMU_VERSION:
            checks.append(Check("qemu", Status.FAIL, text + f"; need >= {'.'.join(map(str, MIN_QEMU_VERSION))}"))
        else:
            checks.append(Check("qemu", Status.OK, text))
    except VmError as e:
        checks.append(Check("qemu", Status.FAIL, str(e)))
    img = shutil.which("qemu-img")
    checks.append(Check("qemu-img", Status.OK, img) if img else
                  Check("qemu-img", Status.FAIL, "qemu-img not found: install Debian's qemu-utils"))

    cache = guest_cache or guest_cache_root()
    guest = find_guest(cache)
    if guest is None:
        checks.append(Check("guest", Status.WARN, f"no guest image built in {cache} yet; "
                            "build it with: sudo python3 fixtures/build_guest.py"))
    else:
        checks.append(Check("guest", Status.OK, f"kernel {guest.kernel_release}, image {guest.key}"
                            f"{'' if guest.has_envd else ' (without envd)'} in {cache}"))
        if guest.tools is None or not (guest.tools / "init").is_file():
            checks.append(Check("guest-tools", Status.WARN, "no guest tools tree (images cannot be converted): "
                                "rebuild with: sudo python3 fixtures/build_guest.py"))
        else:
            size = guest.info.get("tools_bytes")
            checks.append(Check("guest-tools", Status.OK, f"tools {guest.tools_key}"
                                + (f", {size / (1 << 20):.1f} MiB" if isinstance(size, int) else "")))
    missing = [t for t in GUEST_BUILD_TOOLS if shutil.which(t) is None]
    checks.append(Check("guest-build-tools", Status.WARN, f"missing: {', '.join(missing)} (bash scripts/install.sh)")
                  if missing else Check("guest-build-tools", Status.OK, ", ".join(GUEST_BUILD_TOOLS)))

    kvm_ok, kvm_why = kvm_usable()
    checks.append(Check("/dev/kvm", Status.OK, kvm_why))
    if qemu is None:
        checks.append(Check("accelerator", Status.FAIL, "no QEMU"))
    elif not kvm_ok:
        checks.append(Check("accelerator", Status.OK, f"TCG (software CPU): {kvm_why}"))
    elif guest is None:
        checks.append(Check("accelerator", Status.WARN, "KVM not probed yet: needs the guest image"))
    elif not probe:
        checks.append(Check("accelerator", Status.WARN, "probe skipped (--no-probe)"))
    else:
        choice = asyncio.run(probe_accel(guest.kernel, guest.initrd, qemu=qemu, cache_file=cache / "accel.json",
                                         confinement=confinement if confinement.enabled else None))
        checks.append(Check("accelerator", Status.OK,
                            f"{choice.reason}{' (cached probe)' if choice.cached else ''}"))

    checks.append(check_tap_network(data_dir, network, isolation))
    checks.append(check_network_isolation(network, isolation))
    checks += check_confinement(confinement.level.value, confinement)
    confinement.close()
    checks.append(check_ksm())
    checks.append(check_disk("disk (data dir)", data_dir))
    checks.append(check_disk("disk (guest cache)", cache))
    return checks
