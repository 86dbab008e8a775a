"""Device state of a VM whose RAM is a copy-on-write (``share=off``) mapping.

QEMU 7.2's ``x-ignore-shared`` skips only ``share=on`` RAM, so a normal
migration of a copy-on-write clone streams all its used RAM (~190 ms per
88 MiB here). ``xen-save-devices-state`` writes every device section and no
RAM at all (in 12 ms here, ~17 KB); aenv takes the RAM it needs from
/proc/PID/pagemap + /proc/PID/mem instead (pagemap.py). The command's output
has no configuration section, which ``migrate-incoming`` insists on, so the
section of the template's own stream is put in front
(migration_stream.device_state_stream): the result loads like any template
state with ``load_device_state`` (aenv_vm.qemu.migration).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from aenv_store.durable import fsync_dir

from ..errors import VmError
from ..qemu.launcher import QemuProcess
from ..qemu.migration import passed_fd
from ..qemu.migration_stream import StreamError, config_section, device_state_stream


@dataclass(frozen=True)
class DeviceSave:
    size: int
    seconds: float


def durable_write(path: Path, data: bytes | bytearray | memoryview, sync: bool = True) -> None:
    """tmp → [fsync] → rename → [fsync dir]: the file is either absent or complete
    (and with ``sync`` also survives a host crash)."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)


def template_config(template_state: Path) -> bytes:
    """The configuration section of a template's device-state stream."""
    try:
        with open(template_state, "rb") as f:
            return config_section(f.read(64 << 10))
    except (OSError, StreamError) as e:
        raise VmError(f"cannot read the configuration section of {template_state}: {e}") from None


async def save_devices(vm: QemuProcess, path: Path, config: bytes, sync: bool = True) -> DeviceSave:
    """Write ``vm``'s device state (no RAM) to ``path`` durably. The VM must be stopped
    (the command would restart a running VM when done)."""
    if vm.qmp is None:
        raise VmError("VM has no QMP connection")
    t0 = time.monotonic()
    raw_path = path.with_name(path.name + ".raw")
    try:
        # written through an fd of ours: a confined QEMU cannot open the path itself
        async with passed_fd(vm, raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as name:
            await vm.qmp.execute("xen-save-devices-state", {"filename": name, "live": False})
        raw = raw_path.read_bytes()
    finally:
        raw_path.unlink(missing_ok=True)
    try:
        data = device_state_stream(raw, config)
    except StreamError as e:
        raise VmError(f"QEMU wrote an unexpected device-state stream: {e}") from None
    durable_write(path, data, sync)
    return DeviceSave(len(data), time.monotonic() - t0)
