"""SandboxManager: the facade of one node's sandbox lifecycle.

The states and the module that moves a sandbox between them::

    (template) --create--> running --pause--> paused --resume--> running
                    |   restore.py    pause.py         resume.py
                    +-- pool.py (warm clones)
    running --snapshot--> (a new template)   snapshots.py
    running --fork------> N running children fork.py (+ a hidden snapshot)
    paused  --pause_snapshot--> a hidden snapshot of its pause   pausefork.py
    running/paused --kill--> gone; running --TTL--> paused or gone (ttl.py)
    (server restart) running -> paused | lost   recovery.py

Which operation a sandbox allows in which state, and where it leads, is the pure
table of aenv_vm/states.py: every method here asks it (``check``) before it acts,
and writes the record fields of the state it leads to.

The manager holds the per-node state those modules share and that only it
changes: the table of running sandboxes (the others get it read-only), the
sandbox records (records.py, LMDB), one lock per sandbox (operations on one
sandbox never interleave) and the capacity count. It sequences each
operation; the work is in the modules, each given the ``NodeRuntime``
(runtime.py) instead of a back-pointer to the manager.

Methods return node-side handles (``Sandbox``: its QEMU, disk image, where
it is reached), for the node's own tools, tests and benchmarks; the API sees
this node through ``NodeSandboxService`` (node_service.py) instead.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Sequence

from aenv_store.store import Store

from ..blockimage.nbd_server import NbdServer
from ..confine.policy import Confinement
from ..errors import BadRequest, CapacityError, Conflict, GuestUnresponsive, NotFound, VmError
from ..guest import GuestImage
from ..ksm import KsmSettings, enable as ksm_enable
from ..machine.admission import Admission
from ..machine.cpushare import STARTING_WEIGHT
from ..net.policy import NetworkPolicy, with_internet
from ..net.bounds import EgressLimits
from ..net.infra import InfraHost
from ..net.networks import NodeNetworks
from ..qemu.console import CONSOLE_BYTES
from ..service import ExpiryListener, SnapshotInfo, TokenMinter
from ..states import NOT_RUNNING, Op, Outcome, Phase, check, phase_of
from ..templates.local import LocalTemplates
from ..templates.template import Template, find_template
from .capture import Capturer
from .coldboot import cold_boot, prepare_pause
from .lazymem import start_lazy_memory, stop_lazy_memory
from .fork import MAX_FORK, Child, Forks
from .metrics import MetricsRecorder
from .handover import Moves, await_fence, check_releasable, mark_shared, node_identity, read_committed, reclaim
from .pause import PausedSandboxes, PauseTiming
from .pausefork import committed_source, held_source, make_pause_snapshot
from .pool import REFILL_DELAY, WarmPool
from .records import RecordStore, SandboxRecord, SandboxState
from .recovery import recover
from .restore import restore_from_template, teardown_sandbox
from .resume import ResumeTiming, resume
from .runtime import NodeRuntime
from .sandbox import CreateTiming, Sandbox
from .snapshots import NamedSnapshots
from .ttl import TtlWatcher
from ..volumes.mounts import MountError, SandboxVolumes, VolumeMount
from ..volumes.registry import VolumeRegistry

log = logging.getLogger(__name__)

HELD_STATES = (SandboxState.RUNNING, SandboxState.PAUSED)   # what counts against max_sandboxes


def record_phase(rec: SandboxRecord | None) -> Phase:
    """A record's place in the state table (``GONE``: no record)."""
    if rec is None:
        return Phase.GONE
    return phase_of(rec.state, rec.cold_boot, rec.envd_unresponsive)


class SandboxManager:
    """Creates, tracks, pauses, resumes, forks and kills this node's sandboxes.
    Use within one event loop."""

    def __init__(self, store: Store, guest: GuestImage, run_root: Path, *, pool_size: int = 0,
                 ready_timeout: float = 60.0, tcg_tb_mib: int | None = None, default_timeout: float = 300.0,
                 ksm: KsmSettings | None = None, network: str = "user", standby: int = 4,
                 max_sandboxes: int | None = None, readahead: int = 4 << 20, isolation: str = "auto",
                 confine: Confinement | str = "auto", min_free_disk: int | None = None,
                 volumes: VolumeRegistry | None = None, lazy_memory: bool = True,
                 admission: Admission | None = None, egress_limits: EgressLimits = EgressLimits(),
                 console_bytes: int = CONSOLE_BYTES, infrastructure: Sequence[InfraHost] = (),
                 fence_wait: float = 0.0, fork_starting_weight: float = STARTING_WEIGHT) -> None:
        """``confine``: how its QEMUs are confined (aenv_vm/confine): a level ("auto",
        "required", "off") for a policy of the manager's own, or a shared ``Confinement``
        (started and closed by its owner). ``min_free_disk``: the free space guests' disk
        writes leave on the run root's filesystem (None: the node cache's floor).
        ``lazy_memory``: restore templates whose memory image is not on this node from a
        FUSE file that fetches pages on demand (lazymem.py; falls back to fetching the
        image whole where the host has no FUSE or the node is not root). ``admission``: the
        gate every restore passes (aenv_vm/machine/admission.py; None: restores start at once).
        ``egress_limits``: what one sandbox may ask of the node's DNS forwarder and egress
        proxy (aenv_vm/net/bounds.py). ``console_bytes``: the most of each QEMU's serial
        console the node keeps (aenv_vm/qemu/console.py). ``infrastructure``: addresses no
        sandbox reaches whatever its rules say (aenv_vm/net/infra.py). ``fence_wait``: how long
        a forced adopt waits for the old holder's self-fence (handover.await_fence; a fleet
        sets it from its lease). ``fork_starting_weight``: the CPU weight of a fork's children
        still starting, together, in running sandboxes (aenv_vm/machine/cpushare.py)."""
        self.ksm = ksm   # None: QEMU's default (only guest RAM is mergeable, if ksmd runs)
        self._own_confinement = not isinstance(confine, Confinement)
        confinement = confine if isinstance(confine, Confinement) else Confinement(confine)
        self.rt = NodeRuntime(store=store, guest=guest, run_root=run_root, nbd=NbdServer(run_root / "nbd.sock"),
                              networks=NodeNetworks(network, run_root, isolation, egress_limits, infrastructure),   # "user" or "tap" (root)
                              templates=LocalTemplates(store, guest.key, run_root / "templates"),
                              confinement=confinement,
                              ready_timeout=ready_timeout, tcg_tb_mib=tcg_tb_mib, console_bytes=console_bytes, merge_memory=ksm is not None,
                              fixed_layout=ksm is not None and ksm.fixed_layout, readahead=readahead,
                              min_free_disk=min_free_disk if min_free_disk is not None else
                              store.cache.config.min_free_disk if store.cache is not None else 0,
                              node_id=node_identity(run_root), admission=admission, fence_wait=fence_wait,
                              fork_starting_weight=fork_starting_weight)
        self.lazy_memory = lazy_memory
        self.default_timeout = default_timeout
        self.volumes = SandboxVolumes(volumes, self.rt.min_free_disk)   # volume channels of running sandboxes
        self.max_sandboxes = max_sandboxes
        self._running: dict[str, Sandbox] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._creating = 0
        self._records: RecordStore | None = None
        self._started = False
        capturer = Capturer(self.rt.templates)
        self.pool = WarmPool(self.rt, pool_size)
        self.snapshots = NamedSnapshots(self.rt, capturer)
        self._capturer = capturer
        self._paused: PausedSandboxes | None = None
        self._forks: Forks | None = None
        self._moves: Moves | None = None
        self._ttl: TtlWatcher | None = None
        self._ttl_task: asyncio.Task[None] | None = None
        self.metrics = MetricsRecorder(MappingProxyType(self._running), self._busy)
        self._metrics_task: asyncio.Task[None] | None = None
        self._standby = standby
        # called after a TTL expiry paused or killed a sandbox: (sandbox id, "paused" | "killed")
        self.expiry_listeners: list[ExpiryListener] = []
        self.last_pause: PauseTiming | None = None
        self.last_resume: ResumeTiming | None = None
        self.last_fork_snapshot: float | None = None      # seconds the fork's snapshot took (until restorable)

    # ------------------------------------------------------------ start / stop
    async def start(self) -> list[SandboxRecord]:
        """Start the node's NBD server and networks, open the records and recover what a
        previous run left (recovery.py); returns the records recovery changed."""
        run_root = self.rt.run_root
        run_root.mkdir(parents=True, exist_ok=True)
        self.rt.sandboxes_root.mkdir(exist_ok=True)
        await asyncio.to_thread(self.rt.confinement.start)   # ConfinementError: "required" cannot be met
        await self.rt.networks.start()
        await self.rt.nbd.start()
        if self.lazy_memory:
            await asyncio.to_thread(start_lazy_memory, self.rt)
        if self.ksm is not None and (why := await asyncio.to_thread(ksm_enable, self.ksm)) is not None:
            log.warning("KSM not enabled: %s", why)
        records = self._records = RecordStore(run_root / "records")
        view = MappingProxyType(self._running)
        self._paused = PausedSandboxes(self.rt, records, self._capturer, view, self._standby, self.lock)
        self._forks = Forks(self.rt, self.snapshots, records, view)
        self._moves = Moves(self.rt, records)
        self._started = True
        changed = await recover(self.rt, records, self._paused)
        await asyncio.to_thread(self._forks.sweep)      # hidden snapshots a crash left unused
        for rec in records.all():       # a paused sandbox's volumes stay in use (cannot be deleted)
            self.volumes.mark(rec.id, rec.mounts)
        self._ttl = TtlWatcher(records, lambda sid: sid in self._running, self._expire)
        self._ttl_task = asyncio.get_running_loop().create_task(self._ttl.run())
        self._metrics_task = asyncio.get_running_loop().create_task(self.metrics.run())
        return changed

    async def __aenter__(self) -> "SandboxManager":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Kill every sandbox (pooled too), stop the NBD server, remove local run state.
        Paused sandboxes are kept (their records and files live outside ``sandboxes/``)."""
        if self._ttl is not None and self._ttl_task is not None:
            self._ttl.stop()          # lets a pause or kill in progress finish
            with contextlib.suppress(Exception):
                await self._ttl_task
            self._ttl_task = None
        if self._metrics_task is not None:
            self.metrics.stop()
            with contextlib.suppress(Exception):
                await self._metrics_task
            self._metrics_task = None
        await self.volumes.close()
        if self._forks is not None:
            await self._forks.close()
        if self._paused is not None:
            await self._paused.close()
        await self.pool.close()
        if self._started:
            for sid in list(self._running):
                await self.kill(sid)
            await self.rt.nbd.close()
            self._started = False
        shutil.rmtree(self.rt.sandboxes_root, ignore_errors=True)
        shutil.rmtree(self.rt.vm_root, ignore_errors=True)
        await self.rt.networks.close()
        await asyncio.to_thread(stop_lazy_memory, self.rt)
        if self._own_confinement:
            self.rt.confinement.close()
        if self._records is not None:
            self._records.close()
            self._records = None

    # ------------------------------------------------------------ parts
    @property
    def records_store(self) -> RecordStore:
        if self._records is None:
            raise Conflict("SandboxManager.start() was not called")
        return self._records

    @property
    def paused(self) -> PausedSandboxes:
        if self._paused is None:
            raise Conflict("SandboxManager.start() was not called")
        return self._paused

    @property
    def forks(self) -> Forks:
        if self._forks is None:
            raise Conflict("SandboxManager.start() was not called")
        return self._forks

    @property
    def run_root(self) -> Path:
        return self.rt.run_root

    @property
    def confinement(self) -> Confinement:
        return self.rt.confinement

    @property
    def sandboxes(self) -> Mapping[str, Sandbox]:
        """The running sandboxes (read only)."""
        return MappingProxyType(self._running)

    @property
    def standby_limit(self) -> int:
        return self.paused.standby_limit

    @standby_limit.setter
    def standby_limit(self, n: int) -> None:
        self.paused.standby_limit = n

    @property
    def last_fork_timing(self) -> dict[str, float] | None:
        return self.forks.last_timing

    def lock(self, sid: str) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    def _busy(self, sid: str) -> bool:
        held = self._locks.get(sid)
        return held is not None and held.locked()

    def template(self, ref: str) -> Template:
        """A template (id, alias, snapshot id or name) this node can restore from."""
        return self.rt.templates.resolve(ref)

    def record(self, sid: str) -> SandboxRecord:
        """The sandbox's record: state (running/paused/lost), metadata, started/end times."""
        rec = self.records_store.get(sid)
        check(record_phase(rec), Op.GET, sid)     # NotFound
        assert rec is not None
        return rec

    def phase(self, sid: str) -> Phase:
        """Where ``sid`` is in the state table (``GONE``: no record here)."""
        return record_phase(self.records_store.get(sid))

    def check(self, sid: str, op: Op) -> Outcome:
        """What ``op`` does to ``sid`` now; its refusal raised (aenv_vm/states.py)."""
        rec = self.records_store.get(sid)
        return check(record_phase(rec), op, sid, note=rec.note if rec is not None else "")

    def records(self) -> list[SandboxRecord]:
        return self.records_store.all()

    def get(self, sid: str) -> Sandbox:
        """A running sandbox."""
        try:
            return self._running[sid]
        except KeyError:
            raise NotFound(f"unknown sandbox {sid!r}") from None

    def _running_for(self, sid: str, op: Op) -> Sandbox:
        """The running sandbox ``op`` acts on; the table's refusal otherwise."""
        self.check(sid, op)
        sbx = self._running.get(sid)
        if sbx is None:     # recorded running, its VM not (or no longer) in the table
            raise NOT_RUNNING.refusal(sid, Phase.RUNNING)
        return sbx

    def _room(self) -> int | None:
        """How many more sandboxes this node may hold now (None: no bound)."""
        if self.max_sandboxes is None:
            return None
        held = sum(1 for r in self.records_store.all() if r.state in HELD_STATES)
        return self.max_sandboxes - held - self._creating

    def _full(self) -> CapacityError:
        return CapacityError(f"this node holds its maximum of {self.max_sandboxes} sandboxes")

    def _check_capacity(self) -> None:
        room = self._room()
        if room is not None and room < 1:
            raise self._full()

    async def wait_committed(self, sid: str) -> None:
        """Wait for the background commit of ``sid``'s last pause (tests, benchmarks)."""
        await self.paused.committed(sid)

    # ------------------------------------------------------------ create / kill
    async def create(self, template: str, *, env_vars: dict[str, str] | None = None,
                     access_token: str | TokenMinter | None = None, timeout: float | None = None,
                     metadata: dict[str, str] | None = None, auto_pause: bool = True,
                     allow_internet_access: bool | None = None, network: NetworkPolicy | None = None,
                     pause_memory: bool = True, volume_mounts: list | None = None,
                     annotations: dict[str, str] | None = None) -> Sandbox:
        """A new sandbox from ``template`` (id, alias or snapshot), envd initialised.
        ``pause_memory``: what its TTL auto-pause keeps (False: the filesystem only).
        ``access_token``: envd's token, or a function of the new sandbox's id giving it.
        ``allow_internet_access``: False = the guest may not open outbound connections
        (None, not set: it may); ``network``: finer egress rules (net/policy.py).
        ``volume_mounts``: ``[{name, path}]``, volumes mounted before this returns;
        ``annotations``: the caller's own fields, kept in the record (records.py)."""
        if not self._started:
            raise Conflict("SandboxManager.start() was not called")
        if timeout is not None and timeout < 0:
            raise BadRequest(f"timeout must be >= 0, got {timeout}")
        mounts = self.volumes.resolve(volume_mounts or [])     # VolumeNotFound, BadRequest
        self._check_capacity()
        tpl = self.template(template)
        self._creating += 1
        # a hidden snapshot (a fork's, a pause's) is kept until this sandbox is recorded
        self.forks.hold(tpl.id)
        try:
            # Its place is taken: let the creates that arrived with this one get theirs, or
            # their refusal (429 at once), before this one's setup work runs on the loop.
            await asyncio.sleep(0)
            policy = network or NetworkPolicy()
            if allow_internet_access is False:
                policy = with_internet(policy, False)
            sbx = await self._create(tpl, env_vars, access_token, timeout, metadata, auto_pause,
                                     allow_internet_access, policy, annotations, pause_memory)
            stale = [p for p in sbx.template.volume_paths if p not in {m.path for m in mounts}]
            if mounts or stale:
                try:
                    await self.volumes.unmount(sbx.envd_host, sbx.envd_port, sbx.guest_token, stale)
                    await self._mount(sbx, mounts)
                except BaseException:
                    await self.kill(sbx.id)
                    raise
            return sbx
        finally:
            self._creating -= 1
            self.forks.release(tpl.id, tpl.hidden_fork_node is not None)

    async def _mount(self, sbx: Sandbox, mounts: list[VolumeMount]) -> None:
        """Mount (or re-attach) ``mounts`` in ``sbx`` and keep them in its record."""
        self.records_store.put(self.record(sbx.id).replace(volume_mounts=[m.to_json() for m in mounts]))
        await self.volumes.attach(sbx.id, sbx.envd_host, sbx.envd_port, sbx.guest_token, mounts,
                                  timeout=self.rt.ready_timeout)

    async def _remount(self, sbx: Sandbox, rec: SandboxRecord) -> None:
        """After a resume or cold boot: the guest waits for its channels again."""
        if rec.volume_mounts:
            try:
                await self._mount(sbx, rec.mounts)
            except (MountError, VmError, OSError) as e:
                log.error("sandbox %s: volumes not mounted again: %s", sbx.id, e)
                self.records_store.put(self.record(sbx.id).replace(note=f"volumes not mounted: {e}"[:300]))

    async def _create(self, tpl: Template, env_vars: dict[str, str] | None, access_token: str | TokenMinter | None,
                      timeout: float | None, metadata: dict[str, str] | None, auto_pause: bool,
                      allow_internet_access: bool | None, policy: NetworkPolicy,
                      annotations: dict[str, str] | None, pause_memory: bool) -> Sandbox:
        t0 = time.monotonic()
        if tpl.hidden_fork_node is not None and tpl.hidden_fork_node != self.rt.node_id:
            await asyncio.to_thread(mark_shared, self.rt.store, tpl.id)   # a hidden snapshot's user beyond its node
        sbx = await self.pool.take(tpl, policy)
        from_pool = sbx is not None
        if sbx is None:
            sbx = await restore_from_template(self.rt, tpl, policy=policy)
        self.pool.schedule_refill(tpl, REFILL_DELAY)
        token = access_token(sbx.id) if callable(access_token) else access_token
        try:
            ti = time.monotonic()
            await self.rt.networks.apply(sbx.id, policy)   # pooled: made with the default policy
            # The clock was set with the identity at restore and has run since: /init is
            # needed for env vars and to re-key envd from the clone's own secret to the
            # sandbox's token (or none: an unsecured sandbox); skipped only when there is
            # nothing to change.
            body: dict = {}
            if env_vars:
                body["envVars"] = env_vars
            if token or sbx.guest_token:  # a clone's secret is replaced (or cleared), never inherited
                body["accessToken"] = token or ""
            if body:
                await sbx.envd.with_token(sbx.guest_token).init(body)
                sbx.guest_token = token or None
        except BaseException:
            await teardown_sandbox(self.rt, sbx)
            raise
        done = time.monotonic()
        base = sbx.timing if not from_pool and sbx.timing is not None else CreateTiming(0, 0, 0, 0, 0, 0, False)
        sbx.timing = CreateTiming(base.qemu_start, base.state_load, base.first_answer, base.identity,
                                  done - ti, done - t0, from_pool)
        sbx.created = time.time()
        self._running[sbx.id] = sbx
        await self._put_records([self._new_record(
            sbx, timeout=timeout, metadata=metadata, auto_pause=auto_pause, env_vars=env_vars, access_token=token,
            allow_internet_access=allow_internet_access, policy=policy, annotations=annotations,
            pause_memory=pause_memory)])
        return sbx

    def _new_record(self, sbx: Sandbox, *, timeout: float | None, metadata: dict[str, str] | None,
                    auto_pause: bool, env_vars: dict[str, str] | None, access_token: str | None,
                    allow_internet_access: bool | None, policy: NetworkPolicy,
                    annotations: dict[str, str] | None = None, pause_memory: bool = True) -> SandboxRecord:
        now = time.time()
        t = self.default_timeout if timeout is None else timeout
        return SandboxRecord(
            id=sbx.id, template=sbx.template.id, state=SandboxState.RUNNING, started_at=now, end_at=now + t,
            auto_pause=auto_pause, metadata=dict(metadata or {}), env_vars=dict(env_vars or {}),
            access_token=access_token, allow_internet_access=allow_internet_access, network=policy.to_json(),
            memory_mib=sbx.template.memory_mib, vcpus=sbx.template.vcpus, envd_port=sbx.envd_port, timeout=t,
            annotations=dict(annotations or {}), pause_memory=pause_memory)

    async def _put_records(self, recs: list[SandboxRecord]) -> None:
        """Write new sandboxes' records in one transaction, on a worker thread: the write
        is synced to disk (records.py), which under a burst of restores on a busy disk
        takes tens of milliseconds, too long to hold the event loop. The caller still
        counts them in ``_creating`` until this returns (capacity stays exact)."""
        await asyncio.to_thread(self.records_store.put_many, recs)

    async def fill_pool(self, template: str) -> None:
        """Fill the pool of ``template`` now (e.g. at server start) and wait for it."""
        await self.pool.fill(self.template(template))

    def pooled(self, template: str) -> list[Sandbox]:
        """Sandboxes waiting in ``template``'s pool (not handed out)."""
        return self.pool.pooled(self.template(template).id)

    async def kill(self, sid: str) -> None:
        """Kill a running sandbox, or delete a paused or lost one."""
        async with self.lock(sid):
            if sid not in self._running:
                self.check(sid, Op.KILL)        # NotFound for an id this node does not hold
            sbx = self._running.pop(sid, None)
            rec = self.records_store.get(sid)
            await self.volumes.detach(sid)
            if rec is not None:
                self.volumes.release(sid, rec.mounts)
            if sbx is None:
                await self.paused.forget(sid)
            else:
                await teardown_sandbox(self.rt, sbx)
                self.paused.drop_files(sid)
            # synced to disk (records.py): not on the event loop
            await asyncio.to_thread(self.records_store.delete, sid)
            self.metrics.forget(sid)
            if rec is not None:
                self.forks.drop_unused(rec.template)
        self._locks.pop(sid, None)

    # ------------------------------------------------------------ network
    async def update_network(self, sid: str, policy: NetworkPolicy,
                             allow_internet_access: bool | None = None) -> SandboxRecord:
        """Replace a running sandbox's egress rules at once; its record keeps them (pause,
        resume, fork, snapshot). ``allow_internet_access`` False also denies 0.0.0.0/0."""
        if allow_internet_access is False:
            policy = with_internet(policy, False)
        async with self.lock(sid):
            self._running_for(sid, Op.UPDATE_NETWORK)
            await self.rt.networks.apply(sid, policy)
            rec = self.record(sid).replace(network=policy.to_json(), allow_internet_access=(
                allow_internet_access if allow_internet_access is not None else
                (False if not policy.internet else None)))
            self.records_store.put(rec)
            return rec

    async def annotate(self, sid: str, annotations: dict[str, str]) -> SandboxRecord:
        """Set these annotations of a running sandbox (the layer above's fields: the API's
        token generation), durably; under its lock so that no pause commits the record
        meanwhile without them."""
        async with self.lock(sid):
            self._running_for(sid, Op.ANNOTATE)
            rec = self.record(sid)
            rec = rec.replace(annotations={**rec.annotations, **annotations})
            self.records_store.put(rec)
            return rec

    # ------------------------------------------------------------ timeouts
    async def set_timeout(self, sid: str, seconds: float) -> SandboxRecord:
        if seconds < 0:
            raise BadRequest(f"timeout must be >= 0, got {seconds}")
        self.check(sid, Op.SET_TIMEOUT)
        rec = self.record(sid).replace(end_at=time.time() + seconds, timeout=seconds)
        self.records_store.put(rec)
        return rec

    async def _expire(self, rec: SandboxRecord) -> str:
        """A TTL expiry: pause (or kill, for ``auto_pause=False``), then tell the listeners."""
        if rec.auto_pause:
            try:
                await self.pause(rec.id, memory=rec.pause_memory)
            except GuestUnresponsive:   # a filesystem-only pause needs envd: keep memory, marked
                await self.pause(rec.id, unresponsive=True)
            action = "paused"
        else:
            await self.kill(rec.id)
            action = "killed"
        for listener in list(self.expiry_listeners):
            try:
                listener(rec.id, action)
            except Exception as e:  # noqa: BLE001 - a listener must not stop the watcher
                log.warning("TTL listener failed for %s: %s", rec.id, e)
        return action

    # ------------------------------------------------------------ pause / resume
    async def pause(self, sid: str, *, memory: bool = True, require_healthy: bool = False,
                    unresponsive: bool = False) -> SandboxRecord:
        """Pause a running sandbox. ``memory=False``: filesystem only (the guest syncs, the
        next resume boots from the disk: coldboot.py); ``require_healthy`` or ``memory=False``:
        GuestUnresponsive (and nothing done) when envd does not answer. A memory pause
        of a guest whose envd missed its last samples (or ``unresponsive``) is marked:
        it resumes only by cold boot. Conflict for a sandbox already paused (E2B's 409)."""
        op = Op.PAUSE_FILESYSTEM if not memory else Op.PAUSE_UNRESPONSIVE if unresponsive else Op.PAUSE
        async with self.lock(sid):
            sbx = self._running_for(sid, op)
            rec = self.record(sid)
            await self.forks.wait_committed(sbx)
            await self.metrics.quiesce(sid)
            if require_healthy or not memory:
                await prepare_pause(sbx, sync=not memory)
            await self.volumes.detach(sid)    # guest requests in flight wait for the resume
            if op is Op.PAUSE and self.metrics.unresponsive(sid):
                op = Op.PAUSE_UNRESPONSIVE
            after = check(Phase.RUNNING, op, sid).next
            rec = rec.replace(cold_boot=after is Phase.PAUSED_FILESYSTEM,
                              envd_unresponsive=after is Phase.PAUSED_UNRESPONSIVE)
            try:
                paused = await self.paused.pause(sbx, rec)
            except Exception:
                if sid in self._running:      # still running: its volumes too
                    await self._remount(sbx, rec)
                raise
            self.last_pause = paused.timing
            self._running.pop(sid, None)
            # The record says paused: finish even if the caller is cancelled now, or the
            # QEMU and the disk image would belong to nobody.
            await asyncio.shield(self.paused.finish(sbx, paused))
            return paused.record

    async def resume(self, sid: str, timeout: float | None = None, *, memory: bool = True) -> Sandbox:
        """Run a paused sandbox again: from its memory (``memory``), or booted from its disk
        (``memory=False``, and always after a filesystem-only pause: coldboot.py).
        UnresponsiveSnapshot for a memory resume of a pause marked envd-unresponsive;
        Conflict for a sandbox already running (E2B's 409)."""
        if timeout is not None and timeout < 0:
            raise BadRequest(f"timeout must be >= 0, got {timeout}")
        async with self.lock(sid):
            outcome = self.check(sid, Op.RESUME if memory else Op.RESUME_BOOT)
            rec = self.record(sid)
            if outcome.boot:
                sbx, _ = await cold_boot(self.rt, self.paused, rec)
            else:
                if self.rt.admission is not None:
                    # refused before the resume marks the pause running or takes its standby
                    self.rt.admission.check()
                sbx, self.last_resume = await resume(self.rt, self.paused, rec)
            self._running[sid] = sbx
            rec = self.records_store.get(sid) or rec     # the resume may have committed a pending pause
            # Without a timeout the sandbox runs for its own again; one whose timeout was
            # set to 0 (``set_timeout(0)``: "expire now", which is what paused it) gets the
            # default instead of being paused again by the TTL the moment it runs.
            t = timeout if timeout is not None else rec.timeout if rec.timeout > 0 else self.default_timeout
            self.records_store.put(rec.replace(state=SandboxState.RUNNING, envd_port=sbx.envd_port,
                                               end_at=time.time() + t, timeout=t, note="", cold_boot=False,
                                               envd_unresponsive=False))
            await self._remount(sbx, rec)
            return sbx

    # ------------------------------------------------------------ moves between nodes (handover.py)
    async def adopt(self, sid: str, force: bool = False) -> SandboxRecord:
        """Take over a sandbox another node paused into the shared repository (resumed here
        next). ``force``: its holder's lease ran out; if the record says it runs there, the
        holder's self-fence is waited for first (handover.await_fence)."""
        async with self.lock(sid):
            self.check(sid, Op.ADOPT)           # Conflict: this node holds it already
            self._check_capacity()
            assert self._moves is not None
            cp = await asyncio.to_thread(read_committed, self.rt, sid)
            if force and cp is not None and cp.running_on not in (None, self.rt.node_id):
                cp, force = await await_fence(self.rt, sid, cp)
            return await asyncio.to_thread(self._moves.adopt, sid, force, cp)

    async def reclaim(self, sid: str) -> bool:
        """A running sandbox after a lapse of the node's lease (handover.reclaim): True if
        it is still this node's; else its copy here is killed (a stale copy's kill leaves
        the pause record to its new holder) and False."""
        async with self.lock(sid):
            self.check(sid, Op.GET)
            if sid not in self._running:
                return True
            if await asyncio.to_thread(reclaim, self.rt, sid):
                return True
        log.warning("sandbox %s: another node took it over while this node's lease had lapsed: its copy here "
                    "is stopped", sid)
        await self.kill(sid)
        return False

    async def release(self, sid: str) -> None:
        """Forget a paused sandbox here, its pause kept in the repository for another node."""
        async with self.lock(sid):
            self.check(sid, Op.RELEASE)
            check_releasable(self.record(sid), sid in self._running)   # and whether it can move
            await self.paused.settle(sid)
            assert self._moves is not None
            await asyncio.to_thread(self._moves.forget, sid)
            self.metrics.forget(sid)
        self._locks.pop(sid, None)

    # ------------------------------------------------------------ snapshots / fork
    async def snapshot(self, sid: str, name: str | None = None,
                       team: str | None = None) -> tuple[str, list[str], int | None]:
        """A named snapshot of a running sandbox, usable as a template, its record naming
        ``team`` as its owner: its id, names and bytes (snapshots.py ``own_bytes``). The VM
        is stopped only for the capture and the disk seal."""
        if name is not None:
            self.snapshots.check_name_free(name)
        async with self.lock(sid):
            sbx = self._running_for(sid, Op.SNAPSHOT)
            await self.forks.wait_committed(sbx)
            await self.metrics.quiesce(sid)
            local = await self.snapshots.take_local(sbx, self.records_store.get(sid), hidden=False, team=team)
        try:
            await asyncio.to_thread(self.snapshots.commit, local, name)
        except BaseException:
            shutil.rmtree(local.dir, ignore_errors=True)
            raise
        return local.tid, ([name] if name else []), local.meta.snapshot_bytes

    async def fork(self, sid: str, count: int, timeout: float | None = None,
                   access_token: TokenMinter | None = None) -> list[Sandbox | Exception]:
        """``count`` children of a running sandbox, started concurrently from one snapshot
        (fork.py). A secured parent's children get ``access_token(child id)`` (default:
        random). One result per child: the child, or why it failed."""
        if not 1 <= count <= MAX_FORK:
            raise BadRequest(f"fork count must be 1..{MAX_FORK}, got {count}")
        if timeout is not None and timeout < 0:
            raise BadRequest(f"timeout must be >= 0, got {timeout}")
        parent = self.record(sid)
        room = self._room()
        fits = count if room is None else min(count, room)   # the rest: CapacityError each
        if fits < 1:
            raise self._full()
        self._creating += fits
        try:
            t0 = time.monotonic()
            async with self.lock(sid):
                sbx = self._running_for(sid, Op.FORK)
                await self.forks.wait_committed(sbx)
                await self.metrics.quiesce(sid)
                local = await self.snapshots.take_local(sbx, parent, hidden=True)
            self.last_fork_snapshot = time.monotonic() - t0
            children = await self.forks.restore_children(local, parent, fits, access_token, sbx.vm)
            born = [c for c in children if isinstance(c, Child)]
            for kid in born:
                self._running[kid.sandbox.id] = kid.sandbox
            await self._put_records([self._new_record(
                kid.sandbox, timeout=parent.timeout if timeout is None else timeout,
                metadata={**parent.metadata, "forked_from": sid}, auto_pause=parent.auto_pause,
                env_vars=parent.env_vars, access_token=kid.access_token,
                allow_internet_access=parent.allow_internet_access, policy=parent.policy,
                annotations=parent.annotations, pause_memory=parent.pause_memory) for kid in born])
        finally:
            self._creating -= fits
        out: list[Sandbox | Exception] = []
        for child in children:
            if not isinstance(child, Child):
                out.append(child)
                continue
            k = child.sandbox
            if parent.volume_mounts:     # each child dials its own channels to the same volumes
                try:
                    await self._mount(k, parent.mounts)
                except (MountError, VmError, OSError) as e:
                    await self.kill(k.id)
                    out.append(e)
                    continue
            out.append(k)
        return out + [self._full() for _ in range(count - fits)]    # beyond the node's room

    @contextlib.asynccontextmanager
    async def pause_snapshot(self, sid: str) -> AsyncIterator[Template]:
        """Paused sandbox ``sid``'s last pause as a hidden snapshot, held for the block:
        ``create`` from its id starts sandboxes from that pause; the paused sandbox is left
        as it is (pausefork.py). One this node does not hold is looked for in the shared
        repository. NotFound, Conflict, UnresponsiveSnapshot: the state table's
        (``Op.FORK_PAUSE``)."""
        if not self._started:
            raise Conflict("SandboxManager.start() was not called")
        tid = f"tpl-{secrets.token_hex(6)}"
        self.forks.hold(tid)
        try:
            if self.records_store.get(sid) is None:
                self.check(sid, Op.FORK_PAUSE)      # allowed: the repository is asked
                source = await asyncio.to_thread(committed_source, self.rt, sid)
                tpl = await asyncio.to_thread(make_pause_snapshot, self.rt, tid, source)
            else:
                async with self.lock(sid):          # no resume, kill or commit of it meanwhile
                    self.check(sid, Op.FORK_PAUSE)
                    await self.paused.committed(sid)
                    rec = self.record(sid)
                    if rec.snapshot is not None and not rec.snapshot.committed:
                        await self.paused.commit_pending(rec)   # an earlier commit failed
                        rec = self.record(sid)
                    source = await asyncio.to_thread(held_source, self.rt, rec)
                    tpl = await asyncio.to_thread(make_pause_snapshot, self.rt, tid, source)
            yield tpl
        finally:
            self.forks.release(tid)     # dropped now unless a sandbox was made from it

    async def list_snapshots(self) -> list[SnapshotInfo]:
        return await asyncio.to_thread(self.snapshots.listed)

    def template_users(self, tid: str) -> list[str]:
        """The sandboxes (running or paused) restored from template record ``tid``."""
        return sorted(r.id for r in self.records_store.all() if r.template == tid)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        def work() -> None:
            tid = find_template(self.rt.store, snapshot_id).id
            self.snapshots.delete(tid, self.template_users(tid))
        await asyncio.to_thread(work)

    # ------------------------------------------------------------ observers
    def on_expiry(self, listener: ExpiryListener) -> None:
        """Call ``listener(sandbox id, "paused" | "killed")`` after each TTL expiry."""
        self.expiry_listeners.append(listener)
