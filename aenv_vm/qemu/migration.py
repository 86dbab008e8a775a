"""Device-state snapshots of a VM whose RAM is a shared memory file (templating).

With the migration capability ``x-ignore-shared``, QEMU leaves ``share=on``
RAM blocks out of the migration stream: the stream holds only device state
(tens of KB) and the RAM *is* the memory file. A clone maps that file
``share=off`` (copy-on-write, so clones share the host page cache), starts with
``-incoming defer`` and loads the device state with ``migrate-incoming``.

The memory file is only a valid snapshot while the source does not run on it
again: after ``save_device_state`` either stop the source for good, or copy
the memory file before resuming it.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import VmError, VmTimeout
from .errors import QemuExited, QmpConnectionError
from .launcher import QemuProcess


@dataclass(frozen=True)
class DeviceStateSnapshot:
    path: Path
    size: int
    stop_seconds: float     # stop (pause the vCPUs)
    save_seconds: float     # migrate to the file until "completed"


@dataclass(frozen=True)
class RestoreTiming:
    load_seconds: float     # migrate-incoming until the VM runs


async def _set_ignore_shared(vm: QemuProcess) -> None:
    assert vm.qmp is not None
    await vm.qmp.execute("migrate-set-capabilities", {"capabilities": [
        {"capability": "x-ignore-shared", "state": True}]})


async def status(vm: QemuProcess) -> str:
    assert vm.qmp is not None
    return str((await vm.qmp.execute("query-status"))["status"])


async def save_device_state(vm: QemuProcess, path: Path, timeout: float = 30.0) -> DeviceStateSnapshot:
    """Pause ``vm`` and write its device state (RAM excluded) to ``path``. The VM stays paused."""
    if vm.qmp is None:
        raise VmError("VM has no QMP connection")
    if vm.spec.mem_path is None or not vm.spec.mem_share:
        raise VmError("device-state snapshots need RAM in a share=on memory file (VmSpec.mem_path)")
    t0 = time.monotonic()
    if await status(vm) == "running":
        await vm.qmp.execute("stop")
    t1 = time.monotonic()
    await _set_ignore_shared(vm)
    tmp = path.with_name(path.name + ".tmp")
    await vm.qmp.execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(tmp))}"})
    deadline = time.monotonic() + timeout
    while True:
        info = await vm.qmp.execute("query-migrate")
        state = info.get("status")
        if state == "completed":
            break
        if state in ("failed", "cancelled"):
            tmp.unlink(missing_ok=True)
            raise VmError(f"device-state save failed: {info.get('error-desc', state)}")
        if time.monotonic() > deadline:
            await vm.qmp.execute("migrate_cancel")
            tmp.unlink(missing_ok=True)
            raise VmTimeout(f"device-state save not done after {timeout} s (status {state})")
        await asyncio.sleep(0.002)
    os.replace(tmp, path)
    t2 = time.monotonic()
    return DeviceStateSnapshot(path=path, size=path.stat().st_size, stop_seconds=t1 - t0, save_seconds=t2 - t1)


async def _wait_running(vm: QemuProcess, timeout: float) -> None:
    assert vm.qmp is not None
    deadline = time.monotonic() + timeout
    while True:
        if not vm.alive():
            raise QmpConnectionError("QEMU exited")
        state = await status(vm)
        if state == "running":
            return
        if state == "paused" and (await vm.qmp.execute("query-migrate")).get("status") == "completed":
            # The stream carries the source's run state: a snapshot taken paused loads paused.
            await vm.qmp.execute("cont")
            return
        if time.monotonic() > deadline:
            raise VmTimeout(f"{vm.spec.name} not running {timeout} s after migrate-incoming (status {state})")
        await asyncio.sleep(0.002)


async def load_device_state(vm: QemuProcess, path: Path, timeout: float = 30.0) -> RestoreTiming:
    """Restore ``path`` into ``vm`` (started with incoming_defer) and wait until it runs."""
    if vm.qmp is None:
        raise VmError("VM has no QMP connection")
    if not vm.spec.incoming_defer:
        raise VmError("restoring device state needs a VM started with incoming_defer=True")
    if not path.is_file():
        raise VmError(f"device-state file not found: {path}")
    t0 = time.monotonic()
    try:
        await _set_ignore_shared(vm)
        await vm.qmp.execute("migrate-incoming", {"uri": f"exec:cat {shlex.quote(str(path))}"})
        await _wait_running(vm, timeout)
    except VmError as e:
        if isinstance(e, QemuExited):
            raise
        # QEMU exits when an incoming stream does not load, possibly before it answers QMP.
        with contextlib.suppress(VmTimeout):
            await vm.wait_exit(2.0)
        if not vm.alive():
            raise QemuExited(f"QEMU {vm.spec.name} exited while loading {path}:\n{vm.log_tail()}") from None
        raise
    return RestoreTiming(load_seconds=time.monotonic() - t0)
