"""The machine package's pure parts (aenv_vm/machine), without a guest: the QEMU each
mode of MachinePlan makes, where envd is reached, the greeting's token, and a teardown
of a half-made machine."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from envd import ENVD_PORT

from aenv_store.formats.ids import Digest
from aenv_store.store import Store
from aenv_vm.blockimage.nbd_server import NbdServer
from aenv_vm.confine.policy import Confinement
from aenv_vm.guest import GuestImage
from aenv_vm.machine.host import Host, StandaloneHost
from aenv_vm.machine.machine import remove_work, teardown
from aenv_vm.machine.plan import Disk, Greeting, MachinePlan, Restore, Shape, boot_cmdline
from aenv_vm.machine.spec import envd_address, machine_spec
from aenv_vm.memory.lazyfs import LazyImage
from aenv_vm.net.netns import SandboxNet
from aenv_vm.net.networks import Attachment, NodeNetworks
from aenv_vm.qemu.console import CONSOLE_BYTES
from aenv_vm.qemu.launcher import NbdDisk, build_command

LAYER = Digest(bytes(32))
SHAPE = Shape(512, 2, "tcg", "console=ttyS0 aenv.hostname=t")


@dataclass(frozen=True)
class NodeHost:
    """A node's host as the machine sees it (NodeRuntime's fields), without a store."""
    store: Store
    guest: GuestImage
    nbd: NbdServer
    networks: NodeNetworks
    confinement: Confinement
    root: Path
    readahead: int = 4 << 20
    min_free_disk: int = 0
    tcg_tb_mib: int | None = 64
    console_bytes: int = CONSOLE_BYTES
    merge_memory: bool = True
    fixed_layout: bool = True

    def vm_dir(self, name: str) -> Path:
        return self.root / "vm" / name

    def lazy_image(self, memory: Path) -> LazyImage | None:
        return None


def host(tmp_path: Path) -> Host:
    guest = GuestImage(key="g", kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd", rootfs=tmp_path / "root",
                       kernel_release="6.1", has_envd=True, info={})
    return NodeHost(None, guest, NbdServer(tmp_path / "nbd.sock"),   # type: ignore[arg-type]  # no store needed
                    NodeNetworks("user", tmp_path, "off"), Confinement("off", state_dir=tmp_path / "confine"),
                    tmp_path)


def greeting() -> Greeting:
    return Greeting({"hostname": "m"}, None, 5.0)


def opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_a_restore_waits_for_its_state_over_the_templates_memory(tmp_path: Path) -> None:
    h = host(tmp_path)
    plan = MachinePlan.restore("sbx-1", tmp_path / "sandboxes" / "sbx-1", SHAPE, tmp_path / "tpl" / "memory",
                               Restore(tmp_path / "tpl" / "device-state"), Disk(LAYER), greeting())
    assert plan.readahead           # a sandbox's disk may be cold on this node
    spec = machine_spec(h, plan, Attachment(host_port=4000, restrict=True), None)
    assert spec.incoming_defer and not spec.mem_share and spec.mem_path == tmp_path / "tpl" / "memory"
    assert spec.merge_memory and spec.fixed_layout and spec.tcg_tb_mib == 64     # a clone: the node's KSM
    assert spec.disk == NbdDisk(tmp_path / "nbd.sock", "sbx-1") and spec.run_dir == tmp_path / "vm" / "sbx-1"
    assert (spec.memory_mib, spec.vcpus, spec.accel, spec.kernel_cmdline) == (512, 2, "tcg", SHAPE.kernel_cmdline)
    assert spec.host_port == 4000 and spec.net_restrict and spec.netns is None and not spec.tap
    argv = build_command(spec, "qemu", console_fd=7)
    assert opt(argv, "-incoming") == ["defer"] and "-kernel" not in argv


def test_a_cold_boot_boots_the_clones_machine(tmp_path: Path) -> None:
    h = host(tmp_path)
    plan = MachinePlan.cold_boot("sbx-1", tmp_path / "sbx-1", SHAPE, tmp_path / "memory", Disk(LAYER, True),
                                 greeting(), "sandbox sbx-1 did not boot from its disk")
    assert plan.readahead
    net = SandboxNet("aenv-ab-1", 1, "veth", "10.0.0.1", "10.0.0.2", tap=True)
    spec = machine_spec(h, plan, Attachment(host_port=None, netns=net.name, tap=True, net=net), None)
    assert not spec.incoming_defer and not spec.mem_share and spec.merge_memory
    assert spec.tap and spec.netns == net.name and spec.host_port is None
    argv = build_command(spec, "qemu", console_fd=7)
    assert "-incoming" not in argv and opt(argv, "-append") == [SHAPE.kernel_cmdline]


def test_a_build_vm_boots_with_ram_of_its_own(tmp_path: Path) -> None:
    h = host(tmp_path)
    plan = MachinePlan.build("build-1", tmp_path / "builds" / "build-1", LAYER, disk_mib=4096, memory_mib=1024,
                             vcpus=2, accel="tcg", greeting=greeting(), failure="the build VM did not boot")
    assert plan.user_mode and plan.disk == Disk(LAYER, size_mib=4096) and not plan.clone
    assert not plan.readahead       # its layer is local: read-ahead only cost builds time
    spec = machine_spec(h, plan, Attachment(host_port=5000), None)
    assert spec.mem_share and spec.mem_path == tmp_path / "builds" / "build-1" / "memory"
    assert not spec.merge_memory and not spec.fixed_layout and not spec.incoming_defer
    assert spec.memory_mib == 1024 and "norandmaps" in spec.kernel_cmdline
    assert "norandmaps" not in boot_cmdline("kvm") and boot_cmdline("kvm") != boot_cmdline("kvm")  # a seed each


def test_the_base_templates_host_is_plain(tmp_path: Path) -> None:
    """The standalone host: unfiltered user mode on 127.0.0.1 (as the base template's boot
    always was), its run dir in the work dir, no read-ahead, no KSM."""
    guest = GuestImage(key="g", kernel=tmp_path / "k", initrd=tmp_path / "i", rootfs=tmp_path / "r",
                       kernel_release="6.1", has_envd=True, info={})
    h = StandaloneHost(None, guest, NbdServer(tmp_path / "nbd.sock"),   # type: ignore[arg-type]  # no store needed
                       NodeNetworks("user", tmp_path, "off"), Confinement("off", state_dir=tmp_path / "c"),
                       tmp_path / "run")
    assert h.vm_dir("template-build-1") == tmp_path / "run" and h.readahead == 0 and h.lazy_image(tmp_path) is None
    network = asyncio.run(h.networks.attach("template-build-1"))
    assert network.netns is None and not network.restrict and network.net is None
    plan = MachinePlan.build("template-build-1", tmp_path, LAYER, disk_mib=2048, memory_mib=256, vcpus=1,
                             accel="kvm", greeting=greeting(), failure="template boot failed", keep_work=True)
    spec = machine_spec(h, plan, network, None)
    assert spec.hostfwd_host == "127.0.0.1" and not spec.net_restrict and spec.tcg_tb_mib is None
    assert "norandmaps" not in spec.kernel_cmdline


def test_envd_is_reached_where_the_network_says(tmp_path: Path) -> None:
    h = host(tmp_path)
    plan = MachinePlan.restore("s", tmp_path, SHAPE, tmp_path / "m", Restore(tmp_path / "d"), Disk(LAYER), greeting())
    user = SandboxNet("aenv-ab-2", 2, "veth", "10.0.0.5", "10.0.0.6", tap=False)
    tap = SandboxNet("aenv-ab-3", 3, "veth", "10.0.0.9", "10.0.0.10", tap=True)
    assert envd_address(None, machine_spec(h, plan, Attachment(host_port=4321), None)) == ("127.0.0.1", 4321)
    isolated = Attachment(host_port=ENVD_PORT, hostfwd_host=user.ns_ip, netns=user.name, net=user)
    assert envd_address(user, machine_spec(h, plan, isolated, None)) == (user.ns_ip, ENVD_PORT)
    on_tap = Attachment(host_port=None, netns=tap.name, tap=True, net=tap)
    assert envd_address(tap, machine_spec(h, plan, on_tap, None)) == (tap.ns_ip, ENVD_PORT)


def test_the_greeting_says_which_token_envd_demands_after_it() -> None:
    assert Greeting({"hostname": "a"}, "old", 1.0).token_after == "old"
    assert Greeting({"accessToken": "new"}, "old", 1.0).token_after == "new"
    assert Greeting({"accessToken": ""}, "old", 1.0).token_after is None     # re-keyed to none


def test_teardown_of_a_half_made_machine(tmp_path: Path) -> None:
    """Nothing but its dirs was made: they go, and the caller's work dir stays when it is kept."""
    h = host(tmp_path)
    for keep in (False, True):
        work = tmp_path / f"work-{keep}"
        for name in ("upper", "run-of-the-caller"):
            (work / name).mkdir(parents=True)
        (work / "memory").write_bytes(b"ram")
        h.vm_dir("m").mkdir(parents=True)
        asyncio.run(teardown(h, "m", None, None, work, keep_work=keep))
        assert not h.vm_dir("m").exists()
        if keep:
            assert sorted(p.name for p in work.iterdir()) == ["run-of-the-caller"]
        else:
            assert not work.exists()
    remove_work(tmp_path / "never-made", False)     # nothing there: no error


@pytest.mark.parametrize("accel", ["tcg", "kvm"])
def test_boot_cmdline_is_the_guests(accel: str) -> None:
    line = boot_cmdline(accel)  # type: ignore[arg-type]
    assert line.startswith("console=ttyS0") and "aenv.seed=" in line and ("norandmaps" in line) == (accel == "tcg")
