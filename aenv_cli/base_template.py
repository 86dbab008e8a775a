"""The base template (the guest cold-booted once and frozen), as a node's first start and
`aenv template build` (without -f) make it: the accelerator chosen by ``[vm] accel``, the
build in a scratch directory under the data dir. The one place aenv_cli probes the
accelerator and calls ``build_template``."""
from __future__ import annotations

import tempfile
from pathlib import Path

from aenv_store.store import Store
from aenv_vm.confine.policy import Confinement
from aenv_vm.config import VmConfig
from aenv_vm.guest import GuestImage
from aenv_vm.qemu.accel import probe_accel
from aenv_vm.qemu.launcher import Accel
from aenv_vm.templates.base import build_template
from aenv_vm.templates.template import Template
from aenv_vm.templates.trust import CaBundle


async def choose_accel(vm: VmConfig, guest: GuestImage, confinement: Confinement) -> tuple[Accel, str]:
    """The accelerator to build with and why: ``[vm] accel = "auto"`` probes (KVM if a
    probe VM boots with it, cached beside the guest), "tcg" or "kvm" force one."""
    if vm.accel == "auto":
        choice = await probe_accel(guest.kernel, guest.initrd, cache_file=guest.kernel.parent.parent / "accel.json",
                                   confinement=confinement)
        return choice.accel, choice.reason
    forced: Accel = "kvm" if vm.accel == "kvm" else "tcg"   # VmConfig allows auto, tcg or kvm only
    return forced, f"{vm.accel} (forced by [vm] accel)"


async def build_base_template(store: Store, guest: GuestImage, data_dir: Path, *, alias: str, memory_mib: int,
                              vcpus: int, disk_mib: int, accel: Accel, confinement: Confinement,
                              ca_bundle: CaBundle | None) -> Template:
    """Boot ``guest`` once and commit it as a template named ``alias`` (``disk_mib`` 0: the
    guest image's size)."""
    with tempfile.TemporaryDirectory(prefix="template-build-", dir=data_dir) as work:
        return await build_template(store, guest, Path(work), alias=alias, memory_mib=memory_mib, vcpus=vcpus,
                                    accel=accel, disk_mib=disk_mib or None, confinement=confinement,
                                    ca_bundle=ca_bundle)
