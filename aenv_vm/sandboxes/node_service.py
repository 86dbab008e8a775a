"""``NodeSandboxService``: this node's ``SandboxManager`` behind the typed seam
(aenv_vm/service.py) the API talks to. It turns node-side handles and
records into ``SandboxInfo`` and friends, and reads what the API may see of a
running VM (resource use, console) without handing out its internals.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aenv_store.errors import StoreError

from ..errors import VmError
from ..net.policy import NetworkPolicy
from ..qemu.launcher import open_vm_file
from ..service import (ConsoleRead, CreateRequest, ExpiryListener, ForkResult, MetricSample, SandboxInfo,
                       SnapshotInfo, TokenMinter, Usage)
from ..states import NOT_RUNNING_HERE, Op, Phase
from ..templates.template import Template
from .manager import SandboxManager
from .records import SandboxRecord
from .sandbox import Sandbox


class NodeSandboxService:
    """One node's sandboxes as a ``SandboxService``. Use within the manager's event loop."""

    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager
        self._templates: dict[str, tuple[int, str | None]] = {}   # template id -> (disk MiB, envd version)

    # -- records -> info ------------------------------------------------------------------

    def _template_facts(self, rec: SandboxRecord) -> tuple[int, str | None]:
        sbx = self.manager.sandboxes.get(rec.id)
        if sbx is not None:     # a fork child's template may not be in the store yet
            return sbx.image.size >> 20, sbx.template.envd_version
        facts = self._templates.get(rec.template)
        if facts is None:
            try:
                tpl = self.manager.template(rec.template)
            except (VmError, StoreError):   # its template is gone: the record is still shown
                return 0, None
            facts = self._templates[rec.template] = (self._disk_mib(tpl), tpl.envd_version)
        return facts

    def _disk_mib(self, tpl: Template) -> int:
        if tpl.disk_mib:
            return tpl.disk_mib
        try:   # a record from before sizes were recorded: the layer says
            return self.manager.rt.store.load_manifest(tpl.disk).size >> 20
        except StoreError:
            return 0

    def _info(self, rec: SandboxRecord, from_pool: bool | None = None) -> SandboxInfo:
        disk_mib, envd_version = self._template_facts(rec)
        return SandboxInfo(sandbox_id=rec.id, template_id=rec.template, state=rec.state, started_at=rec.started_at,
                           end_at=rec.end_at, vcpus=rec.vcpus, memory_mib=rec.memory_mib, disk_mib=disk_mib,
                           auto_pause=rec.auto_pause, timeout=rec.timeout, metadata=dict(rec.metadata),
                           access_token=rec.access_token, allow_internet_access=rec.allow_internet_access,
                           network=rec.policy,
                           envd_version=envd_version, note=rec.note, from_pool=from_pool,
                           pause_memory=rec.pause_memory, cold_boot=rec.cold_boot,
                           envd_unresponsive=rec.envd_unresponsive,
                           volume_mounts=tuple({"name": m.name, "path": m.path} for m in rec.mounts),
                           annotations=dict(rec.annotations))

    def _running(self, sid: str, op: Op) -> Sandbox:
        """The running VM ``op`` reads; the state table's refusal (NotFound) otherwise."""
        self.manager.check(sid, op)
        sbx = self.manager.sandboxes.get(sid)
        if sbx is None:     # recorded running, its VM not (or no longer) in the table
            raise NOT_RUNNING_HERE.refusal(sid, Phase.RUNNING)
        return sbx

    # -- SandboxService -------------------------------------------------------------------

    async def create(self, req: CreateRequest) -> SandboxInfo:
        sbx = await self.manager.create(req.template, env_vars=req.env_vars or None, access_token=req.access_token,
                                        timeout=req.timeout, metadata=req.metadata, auto_pause=req.auto_pause,
                                        allow_internet_access=req.allow_internet_access, network=req.network,
                                        pause_memory=req.pause_memory, volume_mounts=list(req.volume_mounts),
                                        annotations=dict(req.annotations))
        return self._info(self.manager.record(sbx.id), sbx.timing.from_pool if sbx.timing else None)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._info(self.manager.record(sandbox_id))

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return [self._info(r) for r in self.manager.records()]

    async def kill(self, sandbox_id: str) -> None:
        await self.manager.kill(sandbox_id)

    async def pause(self, sandbox_id: str, memory: bool = True, require_healthy: bool = False) -> SandboxInfo:
        return self._info(await self.manager.pause(sandbox_id, memory=memory, require_healthy=require_healthy))

    async def resume(self, sandbox_id: str, timeout: float | None = None, memory: bool = True) -> SandboxInfo:
        await self.manager.resume(sandbox_id, timeout, memory=memory)
        return self._info(self.manager.record(sandbox_id))

    async def set_timeout(self, sandbox_id: str, seconds: float) -> SandboxInfo:
        return self._info(await self.manager.set_timeout(sandbox_id, seconds))

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        return self._info(await self.manager.update_network(sandbox_id, policy))

    async def annotate(self, sandbox_id: str, annotations: dict[str, str]) -> SandboxInfo:
        return self._info(await self.manager.annotate(sandbox_id, annotations))

    async def snapshot(self, sandbox_id: str, name: str | None = None, team: str | None = None) -> SnapshotInfo:
        tid, names, size = await self.manager.snapshot(sandbox_id, name, team)
        return SnapshotInfo(tid, tuple(names), sandbox_id, time.time(), team, size)

    async def list_snapshots(self) -> list[SnapshotInfo]:
        return await self.manager.list_snapshots()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.manager.delete_snapshot(snapshot_id)
        self._templates.pop(snapshot_id, None)

    async def fork(self, sandbox_id: str, count: int, timeout: float | None = None,
                   access_token: TokenMinter | None = None) -> list[ForkResult]:
        out: list[ForkResult] = []
        for child in await self.manager.fork(sandbox_id, count, timeout, access_token):
            if isinstance(child, Sandbox):
                out.append(self._info(self.manager.record(child.id)))
            elif isinstance(child, VmError):
                out.append(child)
            else:   # an OSError or the like from one child's restore
                out.append(VmError(f"{type(child).__name__}: {child}"))
        return out

    @contextlib.asynccontextmanager
    async def pause_snapshot(self, sandbox_id: str) -> AsyncIterator[SnapshotInfo]:
        async with self.manager.pause_snapshot(sandbox_id) as tpl:
            yield SnapshotInfo(tpl.id, (), sandbox_id, tpl.created)

    async def endpoint(self, sandbox_id: str, port: int) -> tuple[str, int]:
        return await self._running(sandbox_id, Op.ENDPOINT).endpoint(port)

    async def usage(self, sandbox_id: str) -> Usage:
        sbx = self._running(sandbox_id, Op.USAGE)
        return await asyncio.to_thread(_usage, sbx.vm.pid, sbx.dir / "upper")

    async def metrics(self, sandbox_id: str, start: float | None = None,
                      end: float | None = None) -> list[MetricSample]:
        self.manager.check(sandbox_id, Op.METRICS)     # NotFound for an unknown sandbox
        recorder = self.manager.metrics
        sbx = self.manager.sandboxes.get(sandbox_id)
        if sbx is not None and recorder.latest(sandbox_id) is None:
            await recorder.sample(sbx)      # just created: E2B has a sample from its start
        return recorder.series(sandbox_id, start, end)

    async def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, MetricSample]:
        out = {}
        for sid in sandbox_ids:
            s = self.manager.metrics.latest(sid)
            if s is not None:
                out[sid] = s
        return out

    async def console(self, sandbox_id: str, source: str | None, offset: int, limit: int) -> ConsoleRead:
        sbx = self._running(sandbox_id, Op.CONSOLE)
        name = f"qemu-{sbx.vm.pid}"
        ring = sbx.vm.console.ring
        if ring is None:
            return ConsoleRead(name, 0, b"")
        got = await asyncio.to_thread(ring.read, offset if source == name else 0, limit)
        return ConsoleRead(name, got.start, got.data, got.skipped)

    def on_expiry(self, listener: ExpiryListener) -> None:
        self.manager.on_expiry(listener)

    async def adopt(self, sandbox_id: str, force: bool = False) -> SandboxInfo:
        return self._info(await self.manager.adopt(sandbox_id, force))

    async def release(self, sandbox_id: str) -> None:
        await self.manager.release(sandbox_id)

    async def reclaim(self, sandbox_id: str) -> bool:
        return await self.manager.reclaim(sandbox_id)


def _usage(pid: int, upper: Path) -> Usage:
    """RSS and CPU time of a QEMU process (from /proc) and the bytes its upper layer holds."""
    rss, cpu = 0, 0.0
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        pass
    disk = 0
    for root, _dirs, files in os.walk(upper):
        for name in files:
            try:
                disk += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return Usage(rss, cpu, disk)


def read_console(path: Path, source: str, offset: int, limit: int) -> ConsoleRead:
    """Up to ``limit`` bytes of a console file from ``offset`` (of the file, not of all the
    guest wrote: the node's own reads go through the QEMU's ``ConsoleRing``); when more
    than ``limit`` was written since, the oldest part is skipped (and counted)."""
    try:
        with open(open_vm_file(path), "rb") as f:   # a confined QEMU owns the file's directory
            size = os.fstat(f.fileno()).st_size
            if size < offset:          # the file was replaced: start over
                offset = 0
            skipped = max(0, size - offset - limit)
            f.seek(offset + skipped)
            data = f.read(limit)
    except OSError:
        return ConsoleRead(source, offset, b"")
    return ConsoleRead(source, offset + skipped, data, skipped)
