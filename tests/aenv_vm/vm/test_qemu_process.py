"""QMP client and process control against a real QEMU (no root disk needed)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aenv_vm.guest import GuestImage
from aenv_vm.qemu.accel import kvm_usable, probe_accel
from aenv_vm.qemu.errors import QemuExited, QmpError
from aenv_vm.qemu.launcher import QemuProcess, VmSpec

from .procs import qemu_children

pytestmark = pytest.mark.qemu


def bare_spec(guest: GuestImage, run: Path, **kw) -> VmSpec:
    return VmSpec(**{**dict(name="bare", kernel=guest.kernel, initrd=guest.initrd,
                            kernel_cmdline="console=ttyS0 quiet", run_dir=run, memory_mib=128), **kw})


def test_qmp_commands_errors_and_events(guest: GuestImage, tmp_path: Path) -> None:
    async def run() -> None:
        # -S: vCPUs start paused, so "cont" and "stop" produce RESUME/STOP events.
        vm = await QemuProcess.start(bare_spec(guest, tmp_path, extra_args=("-S",)))
        try:
            assert vm.qmp is not None and vm.qmp.greeting is not None
            version = await vm.qmp.execute("query-version")
            assert vm.qmp.greeting.qemu_version == (version["qemu"]["major"], version["qemu"]["minor"],
                                                    version["qemu"]["micro"])
            assert (await vm.qmp.execute("query-status"))["status"] == "prelaunch"
            # Concurrent commands are matched to their replies by id.
            replies = await asyncio.gather(*(vm.qmp.execute("query-status") for _ in range(20)),
                                           vm.qmp.execute("query-name"))
            assert replies[-1] == {"name": "bare"} and all(r["status"] == "prelaunch" for r in replies[:-1])
            with pytest.raises(QmpError) as err:
                await vm.qmp.execute("no-such-command")
            assert err.value.error_class == "CommandNotFound"
            await vm.qmp.execute("cont")
            assert (await vm.qmp.wait_event("RESUME", timeout=10)).name == "RESUME"
            await vm.qmp.execute("stop")
            await vm.qmp.wait_event("STOP", timeout=10)
            assert (await vm.qmp.execute("query-status"))["status"] == "paused"
            waiters = [asyncio.create_task(vm.wait_exit(10)) for _ in range(2)]  # share one pidfd reader
            await vm.qmp.execute("quit")
            assert await asyncio.gather(*waiters) == [0, 0]
            await vm.qmp.wait_event("SHUTDOWN", timeout=5)
        finally:
            await vm.stop()
        assert not vm.spec.qmp_socket.exists()

    asyncio.run(run())


def test_startup_failure_reports_qemu_stderr(guest: GuestImage, tmp_path: Path) -> None:
    async def run() -> None:
        with pytest.raises(QemuExited) as err:
            await QemuProcess.start(bare_spec(guest, tmp_path, kernel=tmp_path / "no-such-vmlinuz"))
        assert "no-such-vmlinuz" in str(err.value)
        assert "exited with code" in str(err.value)

    asyncio.run(run())


def test_a_start_cancelled_while_its_qemu_is_spawned_leaves_no_qemu(guest: GuestImage, tmp_path: Path) -> None:
    """QEMU is forked on the launcher's spawner thread while the event loop goes on; a
    start cancelled meanwhile (its client went away) kills that QEMU once it exists."""
    async def run() -> None:
        loop_ran = False

        async def beside() -> None:
            nonlocal loop_ran
            loop_ran = True

        start = asyncio.ensure_future(QemuProcess.start(bare_spec(guest, tmp_path / "a", incoming_defer=True)))
        await asyncio.sleep(0)          # the spawn is under way on its thread
        await beside()
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert loop_ran
        # VMs are spawned one after another: once the next one has started, the cancelled
        # one was forked, and killed
        other = await QemuProcess.start(bare_spec(guest, tmp_path / "b", name="other", incoming_defer=True))
        try:
            deadline = time.monotonic() + 10
            while qemu_children() != [other.pid] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert qemu_children() == [other.pid]
        finally:
            await other.stop()

    asyncio.run(run())


def test_qemu_dies_with_its_parent_on_sigkill(guest: GuestImage, tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: SIGKILL of the process that started QEMU kills QEMU too."""
    script = textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        from aenv_vm.qemu.launcher import QemuProcess, VmSpec
        async def main():
            spec = VmSpec(name="orphan-check", kernel=Path({str(guest.kernel)!r}), initrd=Path({str(guest.initrd)!r}),
                          kernel_cmdline="console=ttyS0", run_dir=Path({str(tmp_path / 'run')!r}),
                          memory_mib=128, incoming_defer=True)
            vm = await QemuProcess.start(spec)
            print(vm.pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        qemu_pid = int(line)
        assert Path(f"/proc/{qemu_pid}").exists()
        assert os.getpgid(qemu_pid) == qemu_pid  # its own process group
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{qemu_pid}").exists() and time.monotonic() < deadline:
            # QEMU was reparented (to init or a subreaper) and killed; it may linger as a zombie.
            try:
                if Path(f"/proc/{qemu_pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.05)
        alive = Path(f"/proc/{qemu_pid}/stat").exists() and \
            Path(f"/proc/{qemu_pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        assert not alive, "QEMU outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_accel_probe_picks_a_working_accelerator(guest: GuestImage, tmp_path: Path) -> None:
    cache = tmp_path / "accel.json"
    first = asyncio.run(probe_accel(guest.kernel, guest.initrd, cache_file=cache, timeout=5))
    assert first.accel in ("tcg", "kvm") and first.reason
    usable, why = kvm_usable()
    if not usable:
        assert first.accel == "tcg" and why in first.reason
    else:
        second = asyncio.run(probe_accel(guest.kernel, guest.initrd, cache_file=cache, timeout=5))
        assert second.cached and second.accel == first.accel
    print(f"\n[vm] accelerator: {first.reason} ({first.probe_seconds:.2f} s)")
