"""Boot the real guest under QEMU (TCG here), snapshot its device state with
x-ignore-shared, and restore copy-on-write clones from it."""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv_vm.envd_client import http_request, wait_http_ok
from aenv_vm.guest import GuestImage, kernel_cmdline
from aenv_vm.qemu.errors import QemuExited
from aenv_vm.qemu.launcher import QemuProcess, VmSpec, create_overlay, free_port
from aenv_vm.qemu.migration import load_device_state, save_device_state, status

pytestmark = pytest.mark.qemu
MEMORY_MIB = 256


@dataclass(frozen=True)
class Template:
    dir: Path
    mem: Path
    state: Path
    disk: Path
    cmdline: str
    boot_seconds: float
    status_before: str
    status_after: str
    state_size: int
    snapshot_seconds: float
    serial: str
    qmp_socket_left: bool


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def clone_spec(guest: GuestImage, tpl: Template, name: str, run: Path) -> VmSpec:
    overlay = create_overlay(tpl.disk, run / f"{name}.qcow2", backing_format="qcow2")
    return VmSpec(name=name, kernel=guest.kernel, initrd=guest.initrd, kernel_cmdline=tpl.cmdline,
                  run_dir=run / name, memory_mib=MEMORY_MIB, mem_path=tpl.mem, mem_share=False,
                  disk=overlay, host_port=free_port(), incoming_defer=True)


@pytest.fixture(scope="module")
def template(guest: GuestImage, tmp_path_factory: pytest.TempPathFactory) -> Template:
    """Cold-boot the guest, wait for envd, snapshot the device state, quit."""
    d = tmp_path_factory.mktemp("template")

    async def run() -> Template:
        disk = create_overlay(guest.rootfs, d / "disk.qcow2")
        spec = VmSpec(name="template", kernel=guest.kernel, initrd=guest.initrd, kernel_cmdline=kernel_cmdline(),
                      run_dir=d / "run", memory_mib=MEMORY_MIB, mem_path=d / "memory", disk=disk,
                      host_port=free_port())
        start = time.monotonic()
        vm = await QemuProcess.start(spec)
        try:
            await wait_http_ok("127.0.0.1", spec.host_port, "/health", timeout=120, alive=vm.alive)
            boot = time.monotonic() - start
            before = await status(vm)
            snap = await save_device_state(vm, d / "device-state")
            after = await status(vm)
        finally:
            await vm.stop()
        return Template(dir=d, mem=spec.mem_path, state=snap.path, disk=disk.path, cmdline=spec.kernel_cmdline,
                        boot_seconds=boot, status_before=before, status_after=after, state_size=snap.size,
                        snapshot_seconds=snap.stop_seconds + snap.save_seconds,
                        serial=spec.serial_log.read_text(errors="replace"),
                        qmp_socket_left=spec.qmp_socket.exists())

    tpl = asyncio.run(run())
    print(f"\n[vm] cold boot to /health {tpl.boot_seconds:.2f} s; snapshot {tpl.snapshot_seconds * 1000:.0f} ms, "
          f"{tpl.state_size} bytes")
    return tpl


def test_cold_boot_reaches_envd(guest: GuestImage, template: Template) -> None:
    assert template.status_before == "running"
    assert "aenv-init: started" in template.serial
    if guest.has_envd:
        assert "envd listening on 0.0.0.0:49983" in template.serial
    assert not template.qmp_socket_left


def test_snapshot_holds_device_state_only(template: Template) -> None:
    assert template.status_after == "postmigrate"
    # x-ignore-shared: RAM stays in the memory file, the stream is device state only.
    assert 1000 < template.state_size < 1 << 20
    assert template.mem.stat().st_size == MEMORY_MIB << 20
    assert template.state.read_bytes()[:4] == b"QEVM"  # QEMU migration stream magic


def test_clones_restore_and_answer_without_touching_the_template(guest: GuestImage, template: Template,
                                                                 tmp_path: Path) -> None:
    mem_digest = file_digest(template.mem)

    async def run() -> list[tuple[float, float, float]]:
        specs = [clone_spec(guest, template, f"clone{i}", tmp_path) for i in range(2)]
        clones: list[QemuProcess] = []
        timings = []
        try:
            for spec in specs:
                t0 = time.monotonic()
                vm = await QemuProcess.start(spec)
                clones.append(vm)
                assert await status(vm) == "inmigrate"
                t1 = time.monotonic()
                await load_device_state(vm, template.state)
                t2 = time.monotonic()
                await wait_http_ok("127.0.0.1", spec.host_port, "/health", timeout=30, alive=vm.alive)
                timings.append((t1 - t0, t2 - t1, time.monotonic() - t2))
            for vm in clones:  # both still serve after the other started
                code = (await http_request("127.0.0.1", vm.spec.host_port, "GET", "/health", timeout=10)).status
                assert 200 <= code < 300
                assert await status(vm) == "running"
        finally:
            for vm in clones:
                await vm.stop()
        for spec in specs:
            assert not spec.qmp_socket.exists()
        return timings

    timings = asyncio.run(run())
    for start, load, first in timings:
        print(f"\n[vm] clone: QEMU start {start * 1000:.0f} ms, state load {load * 1000:.0f} ms, "
              f"first /health {first * 1000:.0f} ms")
    # share=off: the clones' writes to RAM are private, the template memory file is untouched.
    assert file_digest(template.mem) == mem_digest


def test_corrupt_device_state_fails_cleanly(guest: GuestImage, template: Template, tmp_path: Path) -> None:
    bad = tmp_path / "bad-state"
    good = template.state.read_bytes()
    bad.write_bytes(good[:64] + bytes(len(good) - 64))

    async def run() -> None:
        vm = await QemuProcess.start(clone_spec(guest, template, "corrupt", tmp_path))
        try:
            with pytest.raises(QemuExited, match="exited while loading"):
                await load_device_state(vm, bad, timeout=30)
        finally:
            await vm.stop()
        assert not vm.alive()

    asyncio.run(run())
