"""Device-state snapshots of a VM whose RAM is a shared memory file (templating).

With the migration capability ``x-ignore-shared``, QEMU leaves ``share=on``
RAM blocks out of the migration stream: the stream holds only device state
(tens of KB) and the RAM *is* the memory file. A clone maps that file
``share=off`` (copy-on-write, so clones share the host page cache), starts with
``-incoming defer`` and loads the device state with ``migrate-incoming``.

The memory file is only a valid snapshot while the source does not run on it
again: after ``save_device_state`` either stop the source for good, or copy
the memory file before resuming it.

The stream files are opened by this process and handed to QEMU over QMP
(``getfd`` + ``fd:NAME`` URIs): a confined QEMU may not spawn ``exec:``
helpers (seccomp ``spawn=deny``) and sees no path of the host's but its own
(aenv_vm/confine). ``passed_fd`` does the same for commands that take a file
name (``/dev/fdset/N``, QEMU's ``add-fd``).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

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


async def _give_fd(vm: QemuProcess, fd: int, name: str) -> str:
    """Pass ``fd`` to QEMU as ``name`` (``getfd``; an older fd of that name is closed):
    the ``fd:NAME`` URI it returns takes it over."""
    assert vm.qmp is not None
    await vm.qmp.execute_with_fd("getfd", {"fdname": name}, fd)
    return f"fd:{name}"


@contextlib.asynccontextmanager
async def passed_fd(vm: QemuProcess, path: Path, flags: int) -> AsyncIterator[str]:
    """``path`` opened here with ``flags`` and put in a QEMU fd set: yields the
    ``/dev/fdset/N`` name a file-name argument of a QMP command can use (QEMU
    checks that the command's access mode matches ``flags``). Removed afterwards."""
    assert vm.qmp is not None
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    try:
        added = await vm.qmp.execute_with_fd("add-fd", None, fd)
    finally:
        os.close(fd)
    fdset = int(added["fdset-id"])
    try:
        yield f"/dev/fdset/{fdset}"
    finally:
        with contextlib.suppress(VmError):
            if vm.alive():
                await vm.qmp.execute("remove-fd", {"fdset-id": fdset})


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
    await migrate_to_file(vm, path, timeout)
    t2 = time.monotonic()
    return DeviceStateSnapshot(path=path, size=path.stat().st_size, stop_seconds=t1 - t0, save_seconds=t2 - t1)


async def migrate_to_file(vm: QemuProcess, path: Path, timeout: float = 30.0) -> None:
    """Migrate ``vm`` (with the capabilities and parameters already set) into ``path``
    (written as ``path.tmp``, renamed when QEMU reports the migration completed)."""
    assert vm.qmp is not None
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        await vm.qmp.execute("migrate", {"uri": await _give_fd(vm, fd, "aenv-out")})
    finally:
        os.close(fd)   # QEMU has its own copy, closed when the migration ends
    deadline = time.monotonic() + timeout
    while True:
        info = await vm.qmp.execute("query-migrate")
        state = info.get("status")
        if state == "completed":
            break
        if state in ("failed", "cancelled"):
            tmp.unlink(missing_ok=True)
            raise VmError(f"migration to {path} failed: {info.get('error-desc', state)}")
        if time.monotonic() > deadline:
            await vm.qmp.execute("migrate_cancel")
            tmp.unlink(missing_ok=True)
            raise VmTimeout(f"migration to {path} not done after {timeout} s (status {state})")
        await asyncio.sleep(0.002)
    os.replace(tmp, path)


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
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise VmError(f"device-state file not found: {path}") from None
    t0 = time.monotonic()
    try:
        await _set_ignore_shared(vm)
        uri = await _give_fd(vm, fd, "aenv-in")
        os.close(fd)
        fd = -1
        await vm.qmp.execute("migrate-incoming", {"uri": uri})
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
    finally:
        if fd >= 0:
            os.close(fd)
    return RestoreTiming(load_seconds=time.monotonic() - t0)
