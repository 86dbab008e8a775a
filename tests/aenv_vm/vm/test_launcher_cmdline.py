"""QEMU command-line building (pure) and startup errors that need no guest."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from aenv_vm.errors import VmError

from aenv_vm.qemu.errors import QemuNotFound
from aenv_vm.qemu.launcher import NbdDisk, QcowDisk, RawDisk, VmSpec, build_command, find_qemu, free_port


def spec(tmp_path: Path, **kw) -> VmSpec:
    base = dict(name="t", kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd", kernel_cmdline="console=ttyS0",
                run_dir=tmp_path / "run")
    return VmSpec(**{**base, **kw})


def opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_template_source_maps_memory_shared(tmp_path: Path) -> None:
    argv = build_command(spec(tmp_path, mem_path=tmp_path / "mem", memory_mib=512, vcpus=2), "qemu", console_fd=7)
    assert argv[0] == "qemu"
    objs = opt(argv, "-object")
    assert f"memory-backend-file,id=mem0,size=512M,mem-path={tmp_path}/mem,share=on" in objs
    assert opt(argv, "-machine") == ["microvm,memory-backend=mem0"]
    assert opt(argv, "-m") == ["512M"] and opt(argv, "-smp") == ["2"]
    assert opt(argv, "-cpu") == ["qemu64,+arat"] and opt(argv, "-accel") == ["tcg"]  # ARAT: tickless idle
    assert "-incoming" not in argv and "-no-reboot" in argv
    assert opt(argv, "-kernel") == [f"{tmp_path}/vmlinuz"] and opt(argv, "-append") == ["console=ttyS0"]
    assert opt(argv, "-qmp") == [f"unix:{tmp_path}/run/qmp.sock,server=on,wait=off"]
    assert opt(argv, "-serial") == ["chardev:serial0"]
    # the console is the node's socket (a ring it keeps, aenv_vm/qemu/console.py), not a file QEMU grows
    assert opt(argv, "-chardev") == ["socket,id=serial0,fd=7"]
    assert "virtio-rng-device,rng=rng0" in opt(argv, "-device")


def test_clone_maps_memory_private_and_waits_for_incoming(tmp_path: Path) -> None:
    argv = build_command(spec(tmp_path, mem_path=tmp_path / "mem", mem_share=False, incoming_defer=True,
                              host_port=40001), "qemu", console_fd=7)
    assert any(o.endswith("share=off") for o in opt(argv, "-object"))
    assert opt(argv, "-incoming") == ["defer"]
    # a restored VM never boots: no kernel/initrd copy kept in QEMU's memory
    assert not {"-kernel", "-initrd", "-append"} & set(argv)
    assert opt(argv, "-netdev") == ["user,id=net0,hostfwd=tcp:127.0.0.1:40001-10.0.2.15:49983"]
    assert "virtio-net-device,netdev=net0,mac=52:54:00:12:34:56" in opt(argv, "-device")


@pytest.mark.parametrize("kw", [{}, {"mem_path": Path("/m"), "mem_share": False, "incoming_defer": True},
                                {"accel": "kvm", "host_port": 40001}])
def test_every_vm_has_the_reporting_balloon(tmp_path: Path, kw: dict) -> None:
    """Builds, cold boots and restores alike (a template's device state must find it in
    its clones), with free page reporting and without page poisoning or stats polling."""
    devices = opt(build_command(spec(tmp_path, **kw), "qemu", console_fd=7), "-device")
    assert [d for d in devices if d.startswith("virtio-balloon")] == [
        "virtio-balloon-device,free-page-reporting=on,page-poison=off"]


def test_kvm_uses_host_cpu(tmp_path: Path) -> None:
    argv = build_command(spec(tmp_path, accel="kvm"), "qemu", console_fd=7)
    assert opt(argv, "-accel") == ["kvm"] and opt(argv, "-cpu") == ["host"]


@pytest.mark.parametrize("disk,expected", [
    (NbdDisk(Path("/run/x.sock"), "layer1"),
     {"driver": "nbd", "node-name": "disk0", "server": {"type": "unix", "path": "/run/x.sock"}, "export": "layer1"}),
    (QcowDisk(Path("/v/o.qcow2")),
     {"driver": "qcow2", "node-name": "disk0", "file": {"driver": "file", "filename": "/v/o.qcow2"}}),
    (RawDisk(Path("/v/r.ext4")),
     {"driver": "raw", "node-name": "disk0", "read-only": True,
      "file": {"driver": "file", "filename": "/v/r.ext4", "read-only": True}}),
])
def test_disks_become_blockdev_json(tmp_path: Path, disk, expected: dict) -> None:
    argv = build_command(spec(tmp_path, disk=disk), "qemu", console_fd=7)
    assert [json.loads(b) for b in opt(argv, "-blockdev")] == [expected]
    assert "virtio-blk-device,drive=disk0,werror=report" in opt(argv, "-device")


def test_commas_in_paths_are_escaped(tmp_path: Path) -> None:
    argv = build_command(spec(tmp_path, mem_path=tmp_path / "a,b"), "qemu", console_fd=7)
    assert any("mem-path=" + str(tmp_path) + "/a,,b," in o for o in opt(argv, "-object"))


def test_invalid_specs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(VmError, match="memory_mib"):
        build_command(spec(tmp_path, memory_mib=16), console_fd=7)
    with pytest.raises(VmError, match="vcpus"):
        build_command(spec(tmp_path, vcpus=0), console_fd=7)
    with pytest.raises(VmError, match="too long"):
        build_command(spec(tmp_path, run_dir=tmp_path / ("x" * 120)), console_fd=7)


def test_missing_qemu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_QEMU_BINARY", "qemu-system-does-not-exist")
    with pytest.raises(QemuNotFound, match="qemu-system-does-not-exist not found"):
        find_qemu()


def test_free_port_is_bindable() -> None:
    import socket
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_tcg_translation_cache_size(tmp_path: Path) -> None:
    assert opt(build_command(spec(tmp_path, tcg_tb_mib=64), "qemu", console_fd=7), "-accel") == ["tcg,tb-size=64"]
    # KVM has no translation cache: the knob is ignored there.
    assert opt(build_command(spec(tmp_path, accel="kvm", tcg_tb_mib=64), "qemu", console_fd=7), "-accel") == ["kvm"]


def test_a_confined_qemu_gets_the_seccomp_filter_and_a_bounded_code_buffer(tmp_path: Path) -> None:
    from aenv_vm.confine.jail import SECCOMP, Jail
    from aenv_vm.confine.romem import ReadonlyRam
    jail = Jail(uid=1_900_000_000, gid=1_900_000_000, tcg_tb_mib=128)
    argv = build_command(spec(tmp_path, jail=jail, mem_path=tmp_path / "mem", mem_share=False), "qemu", console_fd=7)
    assert opt(argv, "-sandbox") == [SECCOMP] and "spawn=deny" in SECCOMP and "elevateprivileges=deny" in SECCOMP
    assert opt(argv, "-accel") == ["tcg,tb-size=128"]          # the cgroup's memory bound includes it
    assert opt(build_command(spec(tmp_path, jail=jail, tcg_tb_mib=64), "qemu", console_fd=7), "-accel") == ["tcg,tb-size=64"]
    assert opt(build_command(spec(tmp_path, jail=jail, accel="kvm"), "qemu", console_fd=7), "-accel") == ["kvm"]
    assert "-sandbox" not in build_command(spec(tmp_path), "qemu", console_fd=7)
    # QEMU >= 8.2 maps a file opened read-only as copy-on-write RAM; a share=on file stays writable
    rom = Jail(uid=1_900_000_000, readonly_ram=ReadonlyRam.ROM_OFF)
    objs = opt(build_command(spec(tmp_path, jail=rom, mem_path=tmp_path / "mem", mem_share=False), "qemu", console_fd=7), "-object")
    assert any(o.endswith("share=off,readonly=on,rom=off") for o in objs)
    objs = opt(build_command(spec(tmp_path, jail=rom, mem_path=tmp_path / "mem"), "qemu", console_fd=7), "-object")
    assert not any("readonly" in o for o in objs)
