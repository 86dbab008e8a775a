"""The node agent: what ``aenv server`` runs when ``[cluster] redis_url`` is set.

It registers the node (its advertised URL, capacity, the templates its cache holds and
the deployment's API key digest), heartbeats its lease, and keeps the bindings of the
sandboxes its node holds in Redis as they change: it is their one writer (docs/cluster.md,
"Who writes a binding"). The hook into the server is one wrapper, ``ObservedService``:
a ``SandboxService`` that passes every call to the node's own service and tells a
``SandboxListener`` what changed. With ``redis_url = ""`` the server never builds it, so
the single-node path is untouched.

Redis being unreachable never fails a sandbox operation: the agent logs it, marks
itself out of sync, and the next heartbeat that reaches Redis reconciles every
binding from the node's own list (as a restart does).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from aenv_vm.errors import NotFound, VmError
from aenv_vm.net.policy import NetworkPolicy
from aenv_vm.service import (ConsoleRead, CreateRequest, ExpiryListener, ForkResult, MetricSample, SandboxInfo,
                             SandboxService, SandboxState, SnapshotInfo, TokenMinter, Usage)

from aenv_wire.team_keys import DEFAULT_TEAM_ID, TEAM_ANNOTATION

from .config import ClusterConfig
from .coord import Capacity, CoordError, Coordinator
from .fence import Fence
from .peering import FleetPeering, PeerSync
from .trust import FleetTrust, RedisTrustError, refuse_open_redis

log = logging.getLogger(__name__)

LOAD_POLL = 0.25     # seconds between looks at the restore load (an early heartbeat when it changed)


def info_record(info: SandboxInfo) -> dict[str, Any]:
    """What Redis keeps of a sandbox: enough for a gateway to show it (E2B's
    ListedSandbox) while its node is down or after it was released."""
    return {"sandboxID": info.sandbox_id, "templateID": info.template_id, "state": info.state.value,
            "startedAt": info.started_at, "endAt": info.end_at, "cpuCount": info.vcpus,
            "memoryMB": info.memory_mib, "diskSizeMB": info.disk_mib, "autoPause": info.auto_pause,
            "timeout": info.timeout, "metadata": dict(info.metadata), "envdVersion": info.envd_version,
            "note": info.note, "teamID": team_of_info(info),
            # the volumes mounted in it live on this node: its fork children stay here too
            "volumes": sorted(m.get("name", "") for m in info.volume_mounts)}


def team_of_info(info: SandboxInfo) -> str:
    """The team that owns the sandbox (the node's API annotates it; none: the default team)."""
    return info.annotations.get(TEAM_ANNOTATION) or DEFAULT_TEAM_ID


class SandboxListener(Protocol):
    """What the node's sandbox service tells the fleet (ObservedService calls it)."""

    async def bound(self, info: SandboxInfo, requested_template: str | None = None,
                    paused_now: bool = False) -> None:
        """The sandbox is on this node as ``info`` says (made, changed, or adopted here)."""
        ...

    async def released(self, sandbox_id: str) -> None:
        """The sandbox left this node paused, its pause kept in the repository for another node."""
        ...

    async def gone(self, sandbox_id: str) -> None:
        """The sandbox was killed here."""
        ...

    def check_serving(self) -> None:
        """Before anything that starts a sandbox here: NodeFenced while the node may not
        (it lost its fleet lease: fence.py)."""
        ...


class ObservedService:
    """A ``SandboxService`` that is the node's own, plus a listener told of every change
    of a sandbox: each of the protocol's methods is spelled out (a method added to the
    protocol must be added here: tests/aenv_fleet/test_agent_units.py checks)."""

    def __init__(self, inner: SandboxService, listener: SandboxListener) -> None:
        self.inner = inner
        self.listener = listener
        self._expiry: list[ExpiryListener] = []
        self._tasks: set[asyncio.Task[None]] = set()
        inner.on_expiry(self._expired)

    def _expired(self, sid: str, action: str) -> None:
        for fn in self._expiry:
            fn(sid, action)
        task = asyncio.ensure_future(self._after_expiry(sid, action))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _after_expiry(self, sid: str, action: str) -> None:
        if action == "killed":
            await self.listener.gone(sid)
            return
        with contextlib.suppress(Exception):
            await self.listener.bound(await self.inner.get(sid), paused_now=True)

    async def _bound_now(self, sandbox_id: str) -> None:
        """Tell the listener a running sandbox's record after an operation that briefly
        paused it (snapshot, fork): it ran on."""
        with contextlib.suppress(Exception):
            await self.listener.bound(await self.inner.get(sandbox_id))

    # --- changes: passed on, then told ------------------------------------------------------

    def on_expiry(self, listener: ExpiryListener) -> None:
        self._expiry.append(listener)

    async def create(self, req: CreateRequest) -> SandboxInfo:
        self.listener.check_serving()
        info = await self.inner.create(req)
        await self.listener.bound(info, req.template)
        return info

    async def kill(self, sandbox_id: str) -> None:
        await self.inner.kill(sandbox_id)
        await self.listener.gone(sandbox_id)

    async def pause(self, sandbox_id: str, memory: bool = True, require_healthy: bool = False) -> SandboxInfo:
        info = await self.inner.pause(sandbox_id, memory, require_healthy)
        await self.listener.bound(info, paused_now=True)
        return info

    async def resume(self, sandbox_id: str, timeout: float | None = None, memory: bool = True) -> SandboxInfo:
        self.listener.check_serving()
        info = await self.inner.resume(sandbox_id, timeout, memory)
        await self.listener.bound(info)
        return info

    async def set_timeout(self, sandbox_id: str, seconds: float) -> SandboxInfo:
        info = await self.inner.set_timeout(sandbox_id, seconds)
        await self.listener.bound(info)
        return info

    async def annotate(self, sandbox_id: str, annotations: dict[str, str]) -> SandboxInfo:
        info = await self.inner.annotate(sandbox_id, annotations)
        await self.listener.bound(info)
        return info

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        info = await self.inner.update_network(sandbox_id, policy)
        await self.listener.bound(info)
        return info

    async def snapshot(self, sandbox_id: str, name: str | None = None, team: str | None = None) -> SnapshotInfo:
        snap = await self.inner.snapshot(sandbox_id, name, team)
        await self._bound_now(sandbox_id)
        return snap

    async def fork(self, sandbox_id: str, count: int, timeout: float | None = None,
                   access_token: TokenMinter | None = None) -> list[ForkResult]:
        self.listener.check_serving()
        results = await self.inner.fork(sandbox_id, count, timeout, access_token)
        for r in results:
            if isinstance(r, SandboxInfo):
                await self.listener.bound(r)
        await self._bound_now(sandbox_id)
        return results

    async def adopt(self, sandbox_id: str, force: bool = False) -> SandboxInfo:
        self.listener.check_serving()
        info = await self.inner.adopt(sandbox_id, force)
        await self.listener.bound(info)
        return info

    async def release(self, sandbox_id: str) -> None:
        await self.inner.release(sandbox_id)
        await self.listener.released(sandbox_id)

    async def reclaim(self, sandbox_id: str) -> bool:
        held = await self.inner.reclaim(sandbox_id)
        if not held:
            await self.listener.gone(sandbox_id)
        return held

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.inner.delete_snapshot(snapshot_id)     # changes no sandbox

    def pause_snapshot(self, sandbox_id: str) -> AbstractAsyncContextManager[SnapshotInfo]:
        return self.inner.pause_snapshot(sandbox_id)     # changes no sandbox (its batch: ``create``)

    # --- reads: passed on -------------------------------------------------------------------

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self.inner.get(sandbox_id)

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return await self.inner.list_sandboxes()

    async def list_snapshots(self) -> list[SnapshotInfo]:
        return await self.inner.list_snapshots()

    async def endpoint(self, sandbox_id: str, port: int) -> tuple[str, int]:
        return await self.inner.endpoint(sandbox_id, port)

    async def usage(self, sandbox_id: str) -> Usage:
        return await self.inner.usage(sandbox_id)

    async def metrics(self, sandbox_id: str, start: float | None = None,
                      end: float | None = None) -> list[MetricSample]:
        return await self.inner.metrics(sandbox_id, start, end)

    async def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, MetricSample]:
        return await self.inner.latest_metrics(sandbox_ids)

    async def console(self, sandbox_id: str, source: str | None, offset: int, limit: int) -> ConsoleRead:
        return await self.inner.console(sandbox_id, source, offset, limit)


# the node's restore gate now: (slots, restores holding a slot or queued for one)
RestoreLoad = Callable[[], tuple[int, int]]


@dataclass(frozen=True)
class HostFacts:
    vcpus: int
    mem_total_mib: int
    mem_avail_mib: int
    disk_free_mib: int


def host_facts(data_dir: Path) -> HostFacts:
    mem: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            mem[name] = int(rest.split()[0]) // 1024 if rest.split() else 0
    disk = shutil.disk_usage(data_dir)
    return HostFacts(os.cpu_count() or 1, mem.get("MemTotal", 0), mem.get("MemAvailable", 0), disk.free >> 20)


class NodeAgent:
    """Registration, heartbeat, bindings and reconciliation of one node."""

    def __init__(self, config: ClusterConfig, api_key: str, max_sandboxes: int, sandbox_mem_mib: int,
                 data_dir: Path, version: str = "", coord: Coordinator | None = None,
                 p2p: PeerSync | None = None, restore_load: RestoreLoad | None = None,
                 trust: FleetTrust | None = None, fence_keeper: bool | None = None) -> None:
        """``restore_load``: the node's restore gate as (slots, restores running or queued),
        reported at each heartbeat so placement can spread a burst by queue length.
        ``trust``: the fleet's secrets ([cluster], trust.py); with it the agent makes its
        own ``coord`` and refuses a Redis that takes commands without a password.
        ``fence_keeper``: run the fence keeper process (fence.py; default: on a real node,
        the one with ``trust``)."""
        self.config = config
        self.node_id = config.node_id or socket.gethostname()
        if coord is None:
            if trust is None:
                raise ValueError("NodeAgent needs the fleet's trust or a coordinator")
            coord = Coordinator(config.redis_url, trust.keys, trust.redis)
        self.coord = coord
        self.trust = trust
        self._verified = trust is None      # Redis checked to ask for a password (trust.py)
        self.api_key = api_key
        self.max_sandboxes = max_sandboxes
        self.sandbox_mem_mib = sandbox_mem_mib
        self.data_dir = data_dir
        self.version = version
        self.restore_load = restore_load
        self.service: SandboxService | None = None     # the node's own (what ObservedService wraps)
        self._templates: set[str] = set()
        self._dirty = True              # bindings must be reconciled with the node's own list
        self._releases: set[str] = set()   # released here while Redis did not take it: RELEASE at reconcile
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._reported_restoring = 0    # the restore load the last heartbeat told Redis
        # the host's facts are read on a thread of the agent's own: the default executor may
        # be busy with commits for seconds, and a heartbeat queued behind them lets the
        # lease lapse (the node would fence itself while it is merely busy)
        self._facts_thread = ThreadPoolExecutor(1, thread_name_prefix="aenv-agent-facts")
        self._facts: HostFacts | None = None
        self._facts_read: asyncio.Future[HostFacts] | None = None     # the read in flight, if one is
        # with [p2p] enabled: publish this node's ticket, peer with the other live nodes
        self.peering = FleetPeering(self.coord, self.node_id, p2p) if p2p is not None else None
        self.fence = Fence(config, lambda: self.service,
                           keeper=trust is not None if fence_keeper is None else fence_keeper)

    def observe(self, service: SandboxService) -> ObservedService:
        observed = ObservedService(service, self)
        self.service = service
        return observed

    # --- SandboxListener -----------------------------------------------------------------

    async def bound(self, info: SandboxInfo, requested_template: str | None = None,
                    paused_now: bool = False) -> None:
        self._releases.discard(info.sandbox_id)
        if not self._verified:      # Redis not checked yet: the first reconcile writes it
            self._dirty = True
            return
        try:
            await self.coord.bind(info.sandbox_id, self.node_id, info.state.value, info_record(info),
                                  paused_at=time.time() if paused_now and info.state == SandboxState.PAUSED else None,
                                  note=info.note)
            new = {t for t in (requested_template, info.template_id) if t} - self._templates
            if new:
                await self.coord.add_templates(self.node_id, sorted(new))
                self._templates |= new
        except CoordError as e:
            log.warning("cluster: binding of %s not recorded (%s); reconciling at the next heartbeat",
                        info.sandbox_id, e)
            self._dirty = True

    async def released(self, sandbox_id: str) -> None:
        if not self._verified:
            self._releases.add(sandbox_id)
            self._dirty = True
            return
        try:
            await self.coord.release(sandbox_id, self.node_id)
        except CoordError as e:
            log.warning("cluster: release of %s not recorded (%s); reconciling at the next heartbeat",
                        sandbox_id, e)
            self._releases.add(sandbox_id)
            self._dirty = True

    def check_serving(self) -> None:
        self.fence.check_serving()

    async def gone(self, sandbox_id: str) -> None:
        self._releases.discard(sandbox_id)
        if not self._verified:
            self._dirty = True
            return
        try:
            await self.coord.unbind(sandbox_id, self.node_id)
        except CoordError as e:
            log.warning("cluster: removal of %s not recorded (%s); reconciling at the next heartbeat", sandbox_id, e)
            self._dirty = True

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, templates: list[str]) -> None:
        """After the node's API listens: register, reconcile, then heartbeat every
        ``heartbeat_seconds``. A Redis that is down at start is retried by the loop."""
        self._templates |= {t for t in templates if t}
        await self._verify()        # RedisTrustError: the node does not start
        self.fence.start()
        try:
            if not self._verified:
                raise CoordError(f"redis {self.coord.url}: not reachable to check its authentication")
            await self.coord.add_api_key(self.api_key)
            await self.coord.add_templates(self.node_id, sorted(self._templates))
            await self.tick()
        except CoordError as e:
            log.warning("cluster: redis unreachable at start (%s); retrying every %.1f s", e,
                        self.config.heartbeat_seconds)
        self._task = asyncio.ensure_future(self._loop())

    async def _verify(self) -> None:
        """Check, once, that the fleet's Redis refuses anonymous commands (a Redis down at
        start is checked when it first answers, before anything is written to it)."""
        if not self._verified and self.trust is not None:
            self._verified = await refuse_open_redis(self.trust, self.coord.redis)

    async def _next_beat(self) -> None:
        """Until the next heartbeat is due, or sooner once the node's restore load differs
        from what the last one told (looked at every ``LOAD_POLL`` s): placement weighs that
        load, and a figure up to a heartbeat old steers creates away from a node whose
        restores have ended (sequential creates then piled onto the others)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + self.config.heartbeat_seconds
        while (left := due - loop.time()) > 0:
            await asyncio.sleep(min(LOAD_POLL, left))
            if self.restore_load is not None and self.restore_load()[1] != self._reported_restoring:
                return

    async def _loop(self) -> None:
        while True:
            await self._next_beat()
            try:
                if not self._verified:
                    await self._verify()
                    if not self._verified:
                        continue
                    await self.coord.add_api_key(self.api_key)
                    await self.coord.add_templates(self.node_id, sorted(self._templates))
                await self.tick()
            except RedisTrustError as e:
                log.error("cluster: %s; this node does not join the fleet", e)
                return
            except CoordError as e:
                log.warning("cluster: heartbeat failed: %s", e)
                self._dirty = True
            except Exception:   # the loop must outlive any one failure
                log.exception("cluster: heartbeat failed")
                self._dirty = True

    async def capacity(self) -> Capacity:
        assert self.service is not None
        infos = await self.service.list_sandboxes()
        facts = await self._host_facts()
        slots, restoring = self.restore_load() if self.restore_load is not None else (0, 0)
        self._reported_restoring = restoring
        return Capacity(url=self.config.advertise_url, max_sandboxes=self.max_sandboxes, vcpus=facts.vcpus,
                        mem_total_mib=facts.mem_total_mib, mem_avail_mib=facts.mem_avail_mib,
                        disk_free_mib=facts.disk_free_mib, sandbox_mem_mib=self.sandbox_mem_mib,
                        running=sum(i.state == SandboxState.RUNNING for i in infos),
                        paused=sum(i.state == SandboxState.PAUSED for i in infos), version=self.version,
                        p2p=self.peering.ticket if self.peering is not None else "",
                        restore_slots=slots, restoring=restoring)

    async def _host_facts(self) -> HostFacts:
        """The host's memory and disk now; the last ones read when the read takes longer
        than half a heartbeat (a disk under load answering statvfs late): the lease matters
        more than a fresh figure."""
        if self._facts_read is None or self._facts_read.done():     # a read stuck in statvfs is not queued again
            self._facts_read = asyncio.get_running_loop().run_in_executor(self._facts_thread, host_facts,
                                                                          self.data_dir)
        read = self._facts_read
        if self._facts is None:
            self._facts = await read
            return self._facts
        try:
            self._facts = await asyncio.wait_for(asyncio.shield(read), self.config.heartbeat_seconds / 2)
        except asyncio.TimeoutError:
            log.warning("cluster: the host's facts took over %.1f s to read; the last ones are reported",
                        self.config.heartbeat_seconds / 2)
        return self._facts

    async def tick(self) -> None:
        """One heartbeat; then, when the node is out of sync with Redis, a reconcile. The
        lease is renewed first: a reconcile makes a round trip per binding, and a node
        with many of them must not let its lease lapse while it writes them."""
        cap = await self.capacity()
        started = time.monotonic()
        await self.heartbeat(cap)
        await self.fence.renewed(started)
        if self._dirty:
            await self.reconcile()

    async def heartbeat(self, cap: Capacity) -> None:
        """Renew the lease with ``cap`` (its ``p2p`` is the ticket published), then
        re-check who this node's fleet P2P peers are."""
        await self.coord.heartbeat(self.node_id, cap, self.config.lease_seconds)
        if self.peering is not None:
            await self.peering.sync()

    async def reconcile(self) -> None:
        """Make Redis agree with what this node holds: bind what it has (unless the
        fleet moved it elsewhere: then a paused copy here is released), record the
        releases Redis missed, drop bindings to this node of sandboxes it no longer has."""
        assert self.service is not None
        async with self._lock:
            local = {i.sandbox_id: i for i in await self.service.list_sandboxes()}
            bindings = {b.sandbox_id: b for b in await self.coord.bindings(sorted(local))}
            for sid, info in local.items():
                b = bindings.get(sid)
                if b is not None and b.node_id != self.node_id and (b.node_id or sid in await self._released()):
                    if info.state == SandboxState.PAUSED:
                        await self._release_stale(sid, b.node_id or "the repository")
                    else:
                        log.warning("cluster: %s runs here but the fleet binds it to %r; left as it is",
                                    sid, b.node_id)
                    continue
                await self.coord.bind(sid, self.node_id, info.state.value, info_record(info), note=info.note)
            for sid in await self.coord.node_sandbox_ids(self.node_id):
                if sid in local:
                    continue
                if sid in self._releases:      # it left paused, kept in the repository
                    await self.coord.release(sid, self.node_id)
                else:
                    await self.coord.unbind(sid, self.node_id)
            self._releases.clear()
            self._dirty = False

    async def _released(self) -> set[str]:
        return set(await self.coord.released_ids())

    async def _release_stale(self, sid: str, where: str) -> None:
        """The fleet moved ``sid`` while this node was away: forget the paused copy here,
        through the node's own service (the repository keeps everything; the binding is
        the new holder's, so Redis is not written)."""
        assert self.service is not None
        try:
            await self.service.release(sid)
        except NotFound:
            return
        except VmError as e:
            log.warning("cluster: release of %s (moved to %s) failed: %s", sid, where, e)
            return
        log.info("cluster: released %s here: the fleet moved it to %s", sid, where)

    async def close(self) -> None:
        """The node stops on purpose: its lease ends now (gateways route around it at
        once; its paused sandboxes become adoptable by other nodes)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.fence.close()
        if self._verified:      # never written to a Redis that was refused
            with contextlib.suppress(CoordError):
                await self.reconcile()
                await self.coord.stop_node(self.node_id)
        await self.coord.close()
        self._facts_thread.shutdown(wait=False)
