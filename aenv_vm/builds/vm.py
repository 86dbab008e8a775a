"""A build VM: a guest cold-booted from a committed disk layer, on the node's
networks and confinement like any sandbox, that runs build steps through envd,
commits its disk as a new layer after each step, and is finally frozen into a
template (the same artifacts templates/base.py commits for ``base``).

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
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from envd import ENVD_PORT

from aenv_store.formats.ids import Digest

from ..blockimage.image import BlockImage
from ..envd_client import EnvdClient, OutputSink, ProcessRequest, stream_process
from ..errors import VmError
from ..guest import kernel_cmdline
from ..net.policy import NetworkPolicy
from ..qemu.launcher import Accel, NbdDisk, QemuProcess, VmSpec
from ..qemu.migration import save_device_state
from ..sandboxes.runtime import NodeRuntime
from ..templates.template import DEVICE_STATE, MEMORY_IMAGE, stage_file, template_record

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

    def __init__(self, rt: NodeRuntime, name: str, shape: VmShape, image: BlockImage, cmdline: str) -> None:
        self.rt = rt
        self.name = name
        self.shape = shape
        self.image = image
        self.cmdline = cmdline
        self.work = rt.run_root / "builds" / name
        self.vm: QemuProcess | None = None
        self.envd = EnvdClient("127.0.0.1", 0)
        self.envd_version: str | None = None

    @classmethod
    async def boot(cls, rt: NodeRuntime, name: str, layer: Digest, shape: VmShape,
                   boot_timeout: float = 240.0) -> "BuildVm":
        work = rt.run_root / "builds" / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        image = await asyncio.to_thread(BlockImage.open, rt.store, layer, name, upper_dir=work / "upper",
                                        size=shape.disk_mib << 20, min_free_disk=rt.min_free_disk)
        # Under TCG no ASLR in the guest (docs/guest.md: the translations of a pooled
        # clone's warm-up then serve the user's commands); KVM keeps it.
        cmdline = kernel_cmdline(extra="norandmaps" if shape.accel == "tcg" else "")
        self = cls(rt, name, shape, image, cmdline)
        try:
            await self._start(boot_timeout)
        except BaseException:
            await self.close()
            raise
        return self

    async def _start(self, boot_timeout: float) -> None:
        rt, name = self.rt, self.name
        rt.nbd.add_export(self.image)
        jail = rt.confinement.jail(name)
        uid = jail.uid if jail is not None else None
        vm_dir = rt.vm_dir(name)
        shutil.rmtree(vm_dir, ignore_errors=True)
        vm_dir.mkdir(parents=True)
        await rt.nbd.listen(name, vm_dir / "nbd.sock", owner=uid)
        network = await rt.networks.attach(name, NetworkPolicy(), owner=uid, user_mode=True)
        spec = VmSpec(name=name, kernel=rt.guest.kernel, initrd=rt.guest.initrd, kernel_cmdline=self.cmdline,
                      run_dir=vm_dir, memory_mib=self.shape.memory_mib, vcpus=self.shape.vcpus,
                      accel=self.shape.accel, mem_path=self.work / "memory",
                      disk=NbdDisk(rt.nbd.socket_of(name), name), tcg_tb_mib=rt.tcg_tb_mib, jail=jail,
                      **network)  # type: ignore[arg-type]
        self.vm = await QemuProcess.start(spec)
        net = rt.networks.get(name)
        host = "127.0.0.1" if net is None else net.ns_ip
        assert spec.host_port is not None
        self.envd = EnvdClient(host, spec.host_port)
        try:
            self.envd_version = await self.envd.wait_healthy(timeout=boot_timeout, alive=self.vm.alive)
        except VmError as e:
            raise VmError(f"the build VM did not boot: {e}\n{self.vm.log_tail()}") from None
        # a secret of this build's own: nothing else reaches the VM's envd meanwhile, and
        # the frozen template's envd demands it until the node re-keys each clone
        self.token = secrets.token_urlsafe(32)
        await self.envd.init({"accessToken": self.token})
        self.envd = self.envd.with_token(self.token)

    def alive(self) -> bool:
        return self.vm is not None and self.vm.alive()

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
        assert self.vm is not None and self.vm.qmp is not None
        code, out = await self.sh("sync", timeout=300.0)
        if code != 0:
            raise VmError(f"sync in the build VM failed: {out.decode(errors='replace')[-200:]}")
        await self.vm.qmp.execute("stop")
        try:
            info = await asyncio.to_thread(self.image.commit, None, meta)
        finally:
            if self.vm.alive():
                await self.vm.qmp.execute("cont")
        return info.layer_id

    async def freeze(self, tid: str, meta: dict[str, str]) -> None:
        """Save the running VM as template ``tid`` (disk layer, memory image, device
        state), stop it, and commit the template record with ``meta`` added."""
        assert self.vm is not None
        # the command path once per user before freezing: bash, its libraries and the
        # profiles are then in the frozen page cache that clones share (templates/base.py)
        for user in ("root", meta.get("default_user", "root")):
            with contextlib.suppress(VmError):
                await self.run(ProcessRequest("/bin/bash", ("-l", "-c", "true"), user=user), timeout=60.0)
        state = self.work / "device-state"
        await save_device_state(self.vm, state)
        await self.vm.stop()
        self.rt.nbd.remove_export(self.name)
        guest = self.rt.guest

        def commit() -> None:
            disk = self.image.commit(meta={"template": tid})
            with self.rt.store.workspace() as ws:
                mem = stage_file(ws, self.work / "memory", MEMORY_IMAGE, {"template": tid})
                dstate = stage_file(ws, state, DEVICE_STATE, {"template": tid})
                full = {"memory_mib": str(self.shape.memory_mib), "vcpus": str(self.shape.vcpus),
                        "accel": self.shape.accel, "disk_mib": str(self.shape.disk_mib), "guest_key": guest.key,
                        "kernel_release": guest.kernel_release, "kernel_cmdline": self.cmdline,
                        "envd_token": self.token, **meta}
                if self.envd_version:
                    full["envd_version"] = self.envd_version
                ws.commit(template_record(tid, disk.layer_id, mem, dstate, full, time.time()))
        await asyncio.to_thread(commit)

    async def close(self) -> None:
        if self.vm is not None:
            await self.vm.stop(timeout=2.0)
        await self.rt.release_host(self.name)
        self.rt.nbd.remove_export(self.name)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.image.close)
        shutil.rmtree(self.work, ignore_errors=True)
