"""A machine that came up (``Machine``), and the one way every machine goes: ``teardown``.

``teardown`` stops QEMU, releases the host side (network, the jail's uid, QEMU's
run dir: host.py ``release_host``), removes the NBD export, closes the disk image
and removes the machine's files. A machine to be frozen is first ``halt``-ed: its
device state saved, its QEMU stopped and its export removed, so that its disk's
upper layer, RAM file and device state are at rest for templates/freeze.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..blockimage.image import BlockImage
from ..envd_client import EnvdClient
from ..net.netns import SandboxNet
from ..qemu.launcher import QemuProcess
from ..qemu.migration import save_device_state
from .host import Host, release_host

# a machine's own files in its work dir (MachinePlan.keep_work: only these are removed)
UPPER, MEMORY, DEVICE_STATE = "upper", "memory", "device-state"


@dataclass
class Machine:
    """A running machine: its QEMU, its disk image and how its envd is reached."""
    name: str
    vm: QemuProcess
    image: BlockImage
    work: Path                      # its own files (see MachinePlan.work)
    keep_work: bool                 # ``work`` is the caller's directory
    net: SandboxNet | None          # its network namespace (None: not isolated)
    envd: EnvdClient                # with the token envd demands since the greeting
    envd_version: str | None = None     # what envd's /health reported (None: not asked, or not said)

    @property
    def guest_token(self) -> str | None:
        return self.envd.access_token

    @property
    def memory_file(self) -> Path:
        assert self.vm.spec.mem_path is not None
        return self.vm.spec.mem_path


async def teardown(host: Host, name: str, vm: QemuProcess | None, image: BlockImage | None, work: Path,
                   keep_work: bool = False) -> None:
    """Stop machine ``name``'s QEMU and give up everything it held on ``host`` (each part
    may be missing: a bring-up that failed half-way)."""
    if vm is not None:
        await vm.stop(timeout=2.0)
    await release_host(host, name)
    host.nbd.remove_export(name)
    if image is not None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(image.close)
    remove_work(work, keep_work)


async def close(host: Host, machine: Machine) -> None:
    """``teardown`` of a machine that came up."""
    await teardown(host, machine.name, machine.vm, machine.image, machine.work, machine.keep_work)


def remove_work(work: Path, keep_work: bool) -> None:
    """The machine's files go: its whole work dir, or (``keep_work``) its own files in it."""
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
        return
    for name in (UPPER, MEMORY, DEVICE_STATE):
        p = work / name
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


async def halt(host: Host, machine: Machine) -> Path:
    """Save the device state (``x-ignore-shared``: RAM stays in the machine's own
    ``share=on`` memory file), stop QEMU, remove the NBD export; returns the device
    state's file. What a freeze commits is then at rest."""
    state = machine.work / DEVICE_STATE
    await save_device_state(machine.vm, state)
    await machine.vm.stop()
    host.nbd.remove_export(machine.name)
    return state
