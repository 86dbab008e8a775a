"""A plan's QEMU, and where its envd is reached: pure functions of the plan and the host."""
from __future__ import annotations

from envd import ENVD_PORT

from ..confine.jail import Jail
from ..net.netns import SandboxNet
from ..net.networks import Attachment
from ..qemu.launcher import NbdDisk, VmSpec
from .host import Host
from .plan import MachinePlan, Restore


def machine_spec(host: Host, plan: MachinePlan, network: Attachment, jail: Jail | None) -> VmSpec:
    """The QEMU of ``plan`` on ``host``: its disk the machine's NBD export (on the export's
    own socket), networked as ``network`` says, confined by ``jail``; a restore waits for
    its device state (``-incoming defer``), a boot boots the guest's kernel."""
    name, shape, clone = plan.name, plan.shape, plan.clone
    return network.on(VmSpec(
        name=name, kernel=host.guest.kernel, initrd=host.guest.initrd, kernel_cmdline=shape.kernel_cmdline,
        run_dir=host.vm_dir(name), memory_mib=shape.memory_mib, vcpus=shape.vcpus, accel=shape.accel,
        mem_path=plan.memory_file, mem_share=not clone, disk=NbdDisk(host.nbd.socket_of(name), name),
        incoming_defer=isinstance(plan.start, Restore), tcg_tb_mib=host.tcg_tb_mib, console_bytes=host.console_bytes,
        merge_memory=clone and host.merge_memory, fixed_layout=clone and host.fixed_layout, jail=jail))


def envd_address(net: SandboxNet | None, spec: VmSpec) -> tuple[str, int]:
    """Where the host reaches the guest's envd: on a tap, the namespace's address (every
    guest port); in user mode, envd's host forward (on the namespace's address when the
    machine has one, else on 127.0.0.1)."""
    if net is not None and net.tap:
        return net.ns_ip, ENVD_PORT
    assert spec.host_port is not None
    return ("127.0.0.1" if net is None else net.ns_ip), spec.host_port
