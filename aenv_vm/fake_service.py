"""``FakeSandboxService``: the ``SandboxService`` protocol (service.py) in memory, no VMs.

It is what the API's semantics are tested on (tests/aenv_api/server), so it behaves as
one node's ``NodeSandboxService`` does for everything the API can observe: the same
state table (states.py) and so the same refusals with the same error classes and
messages, ids of the same form, TTL expiry that pauses or kills by ``auto_pause`` and
tells the ``on_expiry`` listeners, snapshots that are templates, forks with one result
per child, capacity (``CapacityError`` past ``max_sandboxes``; a fork's children beyond
the room one each), a paused sandbox's pause held as a hidden snapshot for a batch (and
hidden snapshots dropped once nothing uses or holds them), volumes resolved by
name, network rules kept across pause, resume and fork, and endpoint, console, usage
and metrics answers of the right types. tests/aenv_vm/test_service_contract.py runs the
same cases against it, the observed wrapper and the real node, so it cannot drift.

What a node does with a guest the fake only records: its agent answering or not
(``set_guest_responsive``: a strict or filesystem-only pause then fails with
``GuestUnresponsive``, a plain one is marked), its console (``write_console``), its
metric samples (``add_sample``; a running sandbox gets one the first time its series is
read, as on a node). Time is ``clock`` (a ``FakeClock`` the test drives, or
``time.time``); expiries happen in ``expire_due`` or, started with ``start``, every
``ttl_interval`` seconds. Fakes sharing one ``FakeRepository`` hand paused sandboxes to
each other (``release``, ``adopt``), as nodes sharing a repository do.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .errors import BadRequest, CapacityError, Conflict, GuestUnresponsive, NotFound, VmError
from .machine.admission import Admission
from .net.policy import NetworkPolicy, with_internet
from .sandboxes.fork import MAX_FORK
from .service import (ConsoleRead, CreateRequest, ExpiryListener, ForkResult, MetricSample, SandboxInfo,
                      SandboxState, SnapshotInfo, TokenMinter, Usage)
from .states import Op, Phase, check, phase_of, transition
from .volumes.mounts import resolve as resolve_mounts
from .volumes.registry import VolumeRegistry

log = logging.getLogger(__name__)

Endpoint = Callable[[str, int], tuple[str, int]]    # (sandbox id, guest port) -> (host, port)


@dataclass(frozen=True)
class FakeTemplate:
    """A template (or a snapshot, ``snapshot_of`` set) a fake creates sandboxes from."""
    template_id: str
    names: tuple[str, ...] = ()
    vcpus: int = 2
    memory_mib: int = 512
    disk_mib: int = 2048
    envd_version: str | None = "0.5.7"
    snapshot_of: str | None = None      # the sandbox a snapshot was taken of
    hidden: bool = False                # a fork's or a pause's snapshot: not listed, dropped when unused
    created: float = 0.0
    team: str | None = None             # a named snapshot's owner, as its record names it


BASE = FakeTemplate("tpl-0000000000000000", ("base",))


class FakeClock:
    """Unix time that moves only when told to."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Sandbox:
    info: SandboxInfo                   # state, cold_boot and envd_unresponsive follow ``phase``
    env_vars: dict[str, str]
    responsive: bool = True             # its guest agent answers
    generation: int = 0                 # VMs it has had: each has a console of its own
    console: bytearray = field(default_factory=bytearray)
    samples: list[MetricSample] = field(default_factory=list)

    @property
    def phase(self) -> Phase:
        return phase_of(self.info.state, self.info.cold_boot, self.info.envd_unresponsive)

    @property
    def console_source(self) -> str:
        return f"fake-{self.info.sandbox_id}-{self.generation}"


class FakeRepository:
    """Paused sandboxes released by one fake for another to adopt (a shared repository)."""

    def __init__(self) -> None:
        self.paused: dict[str, tuple[str, _Sandbox]] = {}    # sandbox id -> (the node that released it, it)


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(8)


class FakeSandboxService:
    """One node's sandboxes, in memory. Use within one event loop."""

    def __init__(self, *, templates: Iterable[FakeTemplate] = (BASE,), max_sandboxes: int | None = None,
                 default_timeout: float = 300.0, clock: Callable[[], float] = time.time,
                 volumes: VolumeRegistry | None = None, endpoint: Endpoint | None = None,
                 repository: FakeRepository | None = None, node_id: str = "fake-node",
                 ttl_interval: float = 0.1, admission: Admission | None = None,
                 restore_seconds: float = 0.0) -> None:
        """``endpoint``: where a running sandbox's guest port is reached (default: a port
        nothing listens on, as a guest port no server is bound to). ``admission``: the
        node's restore gate (aenv_vm/machine/admission.py), which every create, resume and
        fork child passes as on a node, each holding its slot ``restore_seconds``."""
        self.templates: dict[str, FakeTemplate] = {t.template_id: t for t in templates}
        self.max_sandboxes = max_sandboxes
        self.default_timeout = default_timeout
        self.clock = clock
        self.volumes = volumes
        self.endpoint_of: Endpoint = endpoint or (lambda _sid, _port: ("127.0.0.1", 1))
        self.repository = repository if repository is not None else FakeRepository()
        self.node_id = node_id
        self.ttl_interval = ttl_interval
        self.fork_failures: list[VmError | None] = []   # what the next fork children fail with (None: start)
        self.expired: list[tuple[str, str]] = []        # (sandbox id, "paused" | "killed"), as the node's watcher
        self._sandboxes: dict[str, _Sandbox] = {}
        self._listeners: list[ExpiryListener] = []
        self._ttl_task: asyncio.Task[None] | None = None
        self.admission = admission
        self.restore_seconds = restore_seconds
        self._creating = 0
        self._holds: Counter[str] = Counter()    # hidden snapshot id -> batches and creates under way from it
        self._shared: set[str] = set()          # hidden snapshots a sandbox moved away from: kept

    # -- test controls ---------------------------------------------------------------------

    def set_guest_responsive(self, sandbox_id: str, responsive: bool) -> None:
        """Whether the sandbox's guest agent answers (a boot makes it answer again)."""
        self._held(sandbox_id).responsive = responsive

    def write_console(self, sandbox_id: str, data: bytes) -> None:
        self._held(sandbox_id).console += data

    def add_sample(self, sandbox_id: str, sample: MetricSample) -> None:
        self._held(sandbox_id).samples.append(sample)

    def lose(self, sandbox_id: str, note: str) -> None:
        """What a node restart does to a running sandbox it has no pause of."""
        sbx = self._held(sandbox_id)
        self._set(sbx, Phase.LOST)
        sbx.info = dataclasses.replace(sbx.info, note=note)

    async def start(self) -> None:
        """Expire sandboxes in the background every ``ttl_interval`` seconds."""
        if self._ttl_task is None:
            self._ttl_task = asyncio.get_running_loop().create_task(self._run_ttl())

    async def close(self) -> None:
        if self._ttl_task is not None:
            self._ttl_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ttl_task
            self._ttl_task = None

    async def _run_ttl(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_interval)
            await self.expire_due()

    async def expire_due(self) -> list[tuple[str, str]]:
        """Pause (``auto_pause``) or kill every running sandbox past its deadline, telling
        the expiry listeners; what was done to which."""
        done: list[tuple[str, str]] = []
        now = self.clock()
        for sid, sbx in list(self._sandboxes.items()):
            if sbx.phase is not Phase.RUNNING or sbx.info.end_at > now:
                continue
            if sbx.info.auto_pause:
                try:
                    await self.pause(sid, memory=sbx.info.pause_memory)
                except GuestUnresponsive:   # a filesystem-only pause needs envd: keep memory, marked
                    self._pause(sid, Op.PAUSE_UNRESPONSIVE)
                action = "paused"
            else:
                await self.kill(sid)
                action = "killed"
            done.append((sid, action))
            self.expired.append((sid, action))
            for listener in list(self._listeners):
                try:
                    listener(sid, action)
                except Exception as e:  # noqa: BLE001 - a listener must not stop the expiries
                    log.warning("TTL listener failed for %s: %s", sid, e)
        return done

    # -- helpers ------------------------------------------------------------------------------

    def _held(self, sid: str) -> _Sandbox:
        sbx = self._sandboxes.get(sid)
        check(Phase.GONE if sbx is None else sbx.phase, Op.GET, sid)     # NotFound
        assert sbx is not None
        return sbx

    def _check(self, sid: str, op: Op) -> _Sandbox:
        """The sandbox ``op`` acts on; the state table's refusal raised otherwise."""
        sbx = self._sandboxes.get(sid)
        check(Phase.GONE if sbx is None else sbx.phase, op, sid, note=sbx.info.note if sbx is not None else "")
        assert sbx is not None
        return sbx

    @staticmethod
    def _set(sbx: _Sandbox, phase: Phase) -> None:
        """Move ``sbx`` to ``phase``: the fields of its info that say where it is."""
        state = {Phase.RUNNING: SandboxState.RUNNING, Phase.LOST: SandboxState.LOST}.get(phase, SandboxState.PAUSED)
        sbx.info = dataclasses.replace(sbx.info, state=state, cold_boot=phase is Phase.PAUSED_FILESYSTEM,
                                       envd_unresponsive=phase is Phase.PAUSED_UNRESPONSIVE)

    def _template(self, ref: str) -> FakeTemplate:
        for tpl in self.templates.values():
            if ref == tpl.template_id or ref in tpl.names:
                return tpl
        raise NotFound(f"unknown template {ref!r}")

    def _room(self) -> int | None:
        if self.max_sandboxes is None:
            return None
        held = sum(1 for s in self._sandboxes.values() if s.phase is not Phase.LOST)
        return self.max_sandboxes - held - self._creating

    def _full(self) -> CapacityError:
        return CapacityError(f"this node holds its maximum of {self.max_sandboxes} sandboxes")

    def _check_capacity(self) -> None:
        room = self._room()
        if room is not None and room < 1:
            raise self._full()

    async def _restore(self) -> None:
        """What stands for a node's restore: the admission gate, then the restore's time."""
        if self.admission is None:
            if self.restore_seconds:
                await asyncio.sleep(self.restore_seconds)
            return
        async with self.admission.slot():
            await asyncio.sleep(self.restore_seconds)

    # -- SandboxService --------------------------------------------------------------------

    async def create(self, req: CreateRequest) -> SandboxInfo:
        if req.timeout is not None and req.timeout < 0:
            raise BadRequest(f"timeout must be >= 0, got {req.timeout}")
        mounts = resolve_mounts(self.volumes, req.volume_mounts)     # VolumeNotFound, BadRequest
        self._check_capacity()
        tpl = self._template(req.template)
        sid = _new_id("sbx-")
        check(Phase.GONE, Op.CREATE, sid)
        self._creating += 1
        self._holds[tpl.template_id] += 1
        try:
            await self._restore()
        finally:
            self._creating -= 1
            self._release_hold(tpl.template_id)
        policy = req.network
        if req.allow_internet_access is False:
            policy = with_internet(policy, False)
        now = self.clock()
        t = self.default_timeout if req.timeout is None else req.timeout
        info = SandboxInfo(sandbox_id=sid, template_id=tpl.template_id, state=SandboxState.RUNNING, started_at=now,
                           end_at=now + t, vcpus=tpl.vcpus, memory_mib=tpl.memory_mib, disk_mib=tpl.disk_mib,
                           auto_pause=req.auto_pause, timeout=t, metadata=dict(req.metadata),
                           access_token=req.access_token(sid) if req.access_token is not None else None,
                           allow_internet_access=req.allow_internet_access, envd_version=tpl.envd_version,
                           network=policy, pause_memory=req.pause_memory,
                           volume_mounts=tuple({"name": m.name, "path": m.path} for m in mounts),
                           annotations=dict(req.annotations))
        self._sandboxes[sid] = _Sandbox(info, dict(req.env_vars))
        return dataclasses.replace(info, from_pool=False)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._held(sandbox_id).info

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return [s.info for s in self._sandboxes.values()]

    async def kill(self, sandbox_id: str) -> None:
        self._check(sandbox_id, Op.KILL)
        gone = self._sandboxes.pop(sandbox_id)
        self._drop_unused(gone.info.template_id)

    def _drop_unused(self, tid: str) -> None:
        """A hidden snapshot lives while a sandbox uses it or something holds it, as on a node."""
        tpl = self.templates.get(tid)
        if tpl is None or not tpl.hidden or tid in self._holds or tid in self._shared:
            return
        if any(s.info.template_id == tid for s in self._sandboxes.values()):
            return
        del self.templates[tid]

    def _release_hold(self, tid: str) -> None:
        self._holds[tid] -= 1
        if self._holds[tid] <= 0:
            del self._holds[tid]
            self._drop_unused(tid)

    async def pause(self, sandbox_id: str, memory: bool = True, require_healthy: bool = False) -> SandboxInfo:
        op = Op.PAUSE if memory else Op.PAUSE_FILESYSTEM
        sbx = self._check(sandbox_id, op)
        if (require_healthy or not memory) and not sbx.responsive:
            raise GuestUnresponsive(f"the guest agent (envd) of sandbox {sandbox_id} is not responding: "
                                    f"TimeoutError")
        return self._pause(sandbox_id, Op.PAUSE_UNRESPONSIVE if memory and not sbx.responsive else op)

    def _pause(self, sid: str, op: Op) -> SandboxInfo:
        sbx = self._check(sid, op)
        after = check(Phase.RUNNING, op, sid).next
        assert after is not None
        self._set(sbx, after)
        return sbx.info

    async def resume(self, sandbox_id: str, timeout: float | None = None, memory: bool = True) -> SandboxInfo:
        if timeout is not None and timeout < 0:
            raise BadRequest(f"timeout must be >= 0, got {timeout}")
        op = Op.RESUME if memory else Op.RESUME_BOOT
        self._check(sandbox_id, op)
        await self._restore()
        s = self._check(sandbox_id, op)     # again: it may have changed while it waited
        outcome = transition(s.phase, op)
        # as on a node: a sandbox whose timeout was set to 0 ("expire now") gets the default
        t = timeout if timeout is not None else s.info.timeout if s.info.timeout > 0 else self.default_timeout
        s.generation += 1
        s.console = bytearray()
        if outcome.boot:
            s.responsive = True          # a booted guest starts a fresh agent
        self._set(s, Phase.RUNNING)
        s.info = dataclasses.replace(s.info, end_at=self.clock() + t, timeout=t, note="")
        return s.info

    async def set_timeout(self, sandbox_id: str, seconds: float) -> SandboxInfo:
        if seconds < 0:
            raise BadRequest(f"timeout must be >= 0, got {seconds}")
        sbx = self._check(sandbox_id, Op.SET_TIMEOUT)
        sbx.info = dataclasses.replace(sbx.info, end_at=self.clock() + seconds, timeout=seconds)
        return sbx.info

    async def annotate(self, sandbox_id: str, annotations: dict[str, str]) -> SandboxInfo:
        sbx = self._check(sandbox_id, Op.ANNOTATE)
        sbx.info = dataclasses.replace(sbx.info, annotations={**sbx.info.annotations, **annotations})
        return sbx.info

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        sbx = self._check(sandbox_id, Op.UPDATE_NETWORK)
        sbx.info = dataclasses.replace(sbx.info, network=policy,
                                       allow_internet_access=False if not policy.internet else None)
        return sbx.info

    def _check_name_free(self, name: str) -> None:
        from aenv_store.formats.catalog import check_name

        from .templates.template import ALIAS_PREFIX
        try:
            check_name(ALIAS_PREFIX + name)
        except ValueError as e:
            raise BadRequest(f"snapshot name: {e}") from None
        with contextlib.suppress(NotFound):
            self._template(name)
            raise Conflict(f"a template or snapshot named {name!r} already exists")

    async def snapshot(self, sandbox_id: str, name: str | None = None, team: str | None = None) -> SnapshotInfo:
        if name is not None:
            self._check_name_free(name)
        sbx = self._check(sandbox_id, Op.SNAPSHOT)
        tpl = self._snapshot_of(sbx, (name,) if name else (), hidden=False, team=team)
        return SnapshotInfo(tpl.template_id, tpl.names, sandbox_id, tpl.created, team, tpl.memory_mib << 20)

    def _snapshot_of(self, sbx: _Sandbox, names: tuple[str, ...], hidden: bool,
                     team: str | None = None) -> FakeTemplate:
        tpl = FakeTemplate(_new_id("tpl-"), names, sbx.info.vcpus, sbx.info.memory_mib, sbx.info.disk_mib,
                           sbx.info.envd_version, snapshot_of=sbx.info.sandbox_id, hidden=hidden,
                           created=self.clock(), team=team)
        self.templates[tpl.template_id] = tpl
        return tpl

    async def list_snapshots(self) -> list[SnapshotInfo]:
        # a snapshot takes its memory image's size here (a real one: snapshots.py ``own_bytes``)
        return sorted((SnapshotInfo(t.template_id, t.names, t.snapshot_of, t.created, t.team, t.memory_mib << 20)
                       for t in self.templates.values()
                       if t.snapshot_of is not None and not t.hidden), key=lambda s: s.created)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        tpl = self._template(snapshot_id)
        if tpl.snapshot_of is None:
            raise BadRequest(f"{snapshot_id} is a template, not a snapshot")
        users = sorted(s.info.sandbox_id for s in self._sandboxes.values() if s.info.template_id == tpl.template_id)
        if users:
            raise Conflict(f"snapshot {snapshot_id} is in use by {len(users)} sandbox(es) "
                           f"({', '.join(users[:3])}{', ...' if len(users) > 3 else ''}): kill them first")
        del self.templates[tpl.template_id]

    async def fork(self, sandbox_id: str, count: int, timeout: float | None = None,
                   access_token: TokenMinter | None = None) -> list[ForkResult]:
        if not 1 <= count <= MAX_FORK:
            raise BadRequest(f"fork count must be 1..{MAX_FORK}, got {count}")
        if timeout is not None and timeout < 0:
            raise BadRequest(f"timeout must be >= 0, got {timeout}")
        parent = self._held(sandbox_id)
        room = self._room()
        fits = count if room is None else min(count, room)   # the rest: CapacityError each
        if fits < 1:
            raise self._full()
        self._check(sandbox_id, Op.FORK)
        tpl = self._snapshot_of(parent, (), hidden=True)
        mint = access_token or (lambda _sid: secrets.token_urlsafe(24))
        self._creating += fits
        try:    # the children restore side by side, each through the gate
            restored = await asyncio.gather(*(self._restore() for _ in range(fits)), return_exceptions=True)
        finally:
            self._creating -= fits
        out: list[ForkResult] = []
        for gate in restored:
            failure = self.fork_failures.pop(0) if self.fork_failures else None
            if isinstance(gate, BaseException):
                if not isinstance(gate, VmError):
                    raise gate
                failure = gate
            if failure is not None:
                out.append(failure)
                continue
            cid = _new_id("sbx-")
            now = self.clock()
            t = parent.info.timeout if timeout is None else timeout
            info = dataclasses.replace(
                parent.info, sandbox_id=cid, template_id=tpl.template_id, state=SandboxState.RUNNING,
                started_at=now, end_at=now + t, timeout=t, metadata={**parent.info.metadata, "forked_from": sandbox_id},
                access_token=mint(cid) if parent.info.access_token else None, note="", from_pool=None,
                cold_boot=False, envd_unresponsive=False, annotations=dict(parent.info.annotations))
            self._sandboxes[cid] = _Sandbox(info, dict(parent.env_vars))
            out.append(info)
        return out + [self._full() for _ in range(count - fits)]    # beyond the node's room

    @contextlib.asynccontextmanager
    async def pause_snapshot(self, sandbox_id: str) -> AsyncIterator[SnapshotInfo]:
        sbx = self._sandboxes.get(sandbox_id)
        if sbx is None:
            check(Phase.GONE, Op.FORK_PAUSE, sandbox_id)    # allowed: the repository is asked
            held = self.repository.paused.get(sandbox_id)
            if held is None:
                raise NotFound(f"unknown sandbox {sandbox_id!r}")
            sbx = held[1]
        check(sbx.phase, Op.FORK_PAUSE, sandbox_id, note=sbx.info.note)
        tpl = self._snapshot_of(sbx, (), hidden=True)
        self._holds[tpl.template_id] += 1
        try:
            yield SnapshotInfo(tpl.template_id, (), sandbox_id, tpl.created)
        finally:
            self._release_hold(tpl.template_id)

    async def endpoint(self, sandbox_id: str, port: int) -> tuple[str, int]:
        self._check(sandbox_id, Op.ENDPOINT)
        return self.endpoint_of(sandbox_id, port)

    async def usage(self, sandbox_id: str) -> Usage:
        sbx = self._check(sandbox_id, Op.USAGE)
        return Usage(rss_bytes=sbx.info.memory_mib << 18, cpu_seconds=0.0, disk_bytes=0)

    def _sample(self, sbx: _Sandbox) -> MetricSample:
        mem = sbx.info.memory_mib << 20
        disk = sbx.info.disk_mib << 20
        return MetricSample(timestamp=self.clock(), cpu_count=sbx.info.vcpus, cpu_used_pct=1.0, mem_used=mem // 4,
                            mem_total=mem, mem_cache=mem // 16, disk_used=disk // 8, disk_total=disk)

    async def metrics(self, sandbox_id: str, start: float | None = None,
                      end: float | None = None) -> list[MetricSample]:
        sbx = self._check(sandbox_id, Op.METRICS)
        if sbx.phase is Phase.RUNNING and not sbx.samples:
            sbx.samples.append(self._sample(sbx))    # just created: E2B has a sample from its start
        return [s for s in sbx.samples
                if (start is None or s.timestamp >= start) and (end is None or s.timestamp <= end)]

    async def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, MetricSample]:
        out: dict[str, MetricSample] = {}
        for sid in sandbox_ids:
            sbx = self._sandboxes.get(sid)
            if sbx is not None and sbx.samples:
                out[sid] = sbx.samples[-1]
        return out

    async def console(self, sandbox_id: str, source: str | None, offset: int, limit: int) -> ConsoleRead:
        sbx = self._check(sandbox_id, Op.CONSOLE)
        name = sbx.console_source
        if source != name or offset > len(sbx.console):
            offset = 0
        skipped = max(0, len(sbx.console) - offset - limit)
        start = offset + skipped
        return ConsoleRead(name, start, bytes(sbx.console[start:start + limit]), skipped)

    def on_expiry(self, listener: ExpiryListener) -> None:
        self._listeners.append(listener)

    async def adopt(self, sandbox_id: str, force: bool = False) -> SandboxInfo:
        held_here = self._sandboxes.get(sandbox_id)
        check(Phase.GONE if held_here is None else held_here.phase, Op.ADOPT, sandbox_id)   # Conflict: held here
        held = self.repository.paused.get(sandbox_id)
        if held is None:
            raise NotFound(f"the repository has no paused sandbox {sandbox_id!r}")
        self._check_capacity()
        holder, moved = held
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
        sbx = dataclasses.replace(moved, info=dataclasses.replace(
            moved.info, note=f"adopted from node {holder} at {when}"))
        self._sandboxes[sandbox_id] = sbx
        return sbx.info

    async def reclaim(self, sandbox_id: str) -> bool:
        """The fake's repository holds paused sandboxes only: a running one here is this
        node's unless another node adopted a pause of it since."""
        self._check(sandbox_id, Op.GET)
        held = self.repository.paused.get(sandbox_id)
        if held is not None and held[0] != self.node_id:
            del self._sandboxes[sandbox_id]
            return False
        return True

    async def release(self, sandbox_id: str) -> None:
        sbx = self._check(sandbox_id, Op.RELEASE)
        if sbx.info.volume_mounts:
            raise Conflict(f"sandbox {sandbox_id} has volumes mounted; volumes are directories of this node "
                           f"(docs/volumes.md), so it cannot move to another node")
        self.repository.paused[sandbox_id] = (self.node_id, sbx)
        del self._sandboxes[sandbox_id]
        if self.templates.get(sbx.info.template_id, BASE).hidden:   # used beyond this node now: kept
            self._shared.add(sbx.info.template_id)
