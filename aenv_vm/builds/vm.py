"""A build VM: a guest booted from a committed disk layer (aenv_vm/machine,
``MachinePlan.build``), on the node's networks and confinement like any sandbox,
that runs build steps through envd, commits its disk as a new layer after each
step, and is finally frozen into a template (templates/freeze.py, as the base
template is).

Networking: always QEMU's user-mode stack (in a namespace of its own when the
node isolates sandboxes, so a build's RUN steps meet the same egress rules as a
sandbox and cannot reach the host or the control plane), because a template is
frozen with user-mode devices and restores convert them (net/networks.py).

Disk commits while the VM lives: ``sync`` in the guest (its page cache reaches
the disk), QMP ``stop`` (QEMU drains and flushes its block layer), seal the
upper layer, ``cont``. The layer is then what a cold boot after a clean
``sync`` would see: the file system's journal replays on the next mount.
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass

from aenv_store.formats.ids import Digest

from ..envd_client import EnvdClient, OutputSink, ProcessRequest, stream_process
from ..errors import VmError
from ..machine.bringup import bring_up
from ..machine.machine import Machine, close, halt
from ..machine.plan import Greeting, MachinePlan
from ..qemu.launcher import Accel
from ..sandboxes.runtime import NodeRuntime
from ..templates.freeze import freeze
from ..templates.meta import TemplateMeta

GROW_ROOT = ("if [ -x /.aenv/bin/resize2fs ]; then exec /.aenv/bin/resize2fs /dev/vda; "
             "else exec resize2fs /dev/vda; fi")


@dataclass(frozen=True)
class VmShape:
    memory_mib: int
    vcpus: int
    disk_mib: int
    accel: Accel


class BuildVm:
    """One running build VM. ``boot`` starts it; ``close`` always tears it down."""

    def __init__(self, rt: NodeRuntime, machine: Machine, shape: VmShape, cmdline: str, token: str) -> None:
        self.rt = rt
        self.machine = machine
        self.name = machine.name
        self.shape = shape
        self.cmdline = cmdline
        self.token = token                  # what the VM's envd (and the frozen template's) demands
        self.envd: EnvdClient = machine.envd
        self.envd_version = machine.envd_version

    @classmethod
    async def boot(cls, rt: NodeRuntime, name: str, layer: Digest, shape: VmShape,
                   boot_timeout: float = 240.0) -> "BuildVm":
        # a secret of this build's own: nothing else reaches the VM's envd meanwhile, and
        # the frozen template's envd demands it until the node re-keys each clone
        token = secrets.token_urlsafe(32)
        plan = MachinePlan.build(name, rt.run_root / "builds" / name, layer, disk_mib=shape.disk_mib,
                                 memory_mib=shape.memory_mib, vcpus=shape.vcpus, accel=shape.accel,
                                 greeting=Greeting({"accessToken": token}, None, boot_timeout),
                                 failure="the build VM did not boot")
        machine, _ = await bring_up(rt, plan)
        return cls(rt, machine, shape, plan.shape.kernel_cmdline, token)

    def alive(self) -> bool:
        return self.machine.vm.alive()

    async def run(self, req: ProcessRequest, *, timeout: float, on_output: OutputSink | None = None) -> int:
        if not self.alive():
            raise VmError("the build VM is not running")
        return await stream_process(self.envd, req, timeout=timeout, on_output=on_output)

    async def sh(self, script: str, *, user: str = "root", timeout: float = 120.0,
                 on_output: OutputSink | None = None) -> tuple[int, bytes]:
        """A POSIX shell script as ``user``: (exit code, its output, both streams)."""
        out = bytearray()

        def sink(stream: str, data: bytes) -> None:
            out.extend(data)
            if on_output is not None:
                on_output(stream, data)
        code = await self.run(ProcessRequest("/bin/sh", ("-c", script), user=user, cwd="/"),
                              timeout=timeout, on_output=sink)
        return code, bytes(out)

    async def grow_root(self) -> None:
        """Grow the root file system to the disk (the image's ext4 was made to fit its tree)."""
        code, out = await self.sh(GROW_ROOT, timeout=300.0)
        if code != 0:
            raise VmError(f"growing the root file system to {self.shape.disk_mib} MiB failed: "
                          f"{out.decode(errors='replace').strip()[-400:]}")

    async def commit_layer(self, meta: dict[str, str]) -> Digest:
        """The disk as it is now, sealed as a committed layer (see the module doc)."""
        vm = self.machine.vm
        assert vm.qmp is not None
        code, out = await self.sh("sync", timeout=300.0)
        if code != 0:
            raise VmError(f"sync in the build VM failed: {out.decode(errors='replace')[-200:]}")
        await vm.qmp.execute("stop")
        try:
            info = await asyncio.to_thread(self.machine.image.commit, None, meta)
        finally:
            if vm.alive():
                await vm.qmp.execute("cont")
        return info.layer_id

    def template_meta(self) -> TemplateMeta:
        """The meta of a template frozen from this VM, before the build adds its keys."""
        guest = self.rt.guest
        return TemplateMeta(memory_mib=self.shape.memory_mib, vcpus=self.shape.vcpus, accel=self.shape.accel,
                            guest_key=guest.key, kernel_cmdline=self.cmdline, kernel_release=guest.kernel_release,
                            disk_mib=self.shape.disk_mib, envd_version=self.envd_version or None,
                            envd_token=self.token)

    async def freeze(self, tid: str, meta: TemplateMeta) -> None:
        """Save the running VM as template ``tid`` (disk layer, memory image, device
        state), stop it, and commit the template record with ``meta`` (``template_meta()``
        with the build's keys)."""
        # the command path once per user before freezing: bash, its libraries and the
        # profiles are then in the frozen page cache that clones share (templates/base.py)
        for user in ("root", meta.default_user or "root"):
            with contextlib.suppress(VmError):
                await self.run(ProcessRequest("/bin/bash", ("-l", "-c", "true"), user=user), timeout=60.0)
        state = await halt(self.rt, self.machine)
        await asyncio.to_thread(freeze, self.rt.store, tid, disk=self.machine.image,
                                memory=self.machine.memory_file, device_state=state, meta=meta)

    async def close(self) -> None:
        await close(self.rt, self.machine)
