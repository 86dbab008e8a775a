"""Fork: ``count`` children of a running sandbox, restored concurrently from one snapshot.

The parent is stopped only for a hidden snapshot's capture and disk seal
(snapshots.py). The children restore from the snapshot's local files
(restore.py, machine restores), each with its own id, identity, access token
and upper disk layer, and with ``/init`` as the first request. The snapshot is
committed to the store in the background once they answer (so that the commit
does not compete with them for the CPU); its ids are needed only from a
child's first pause or snapshot on, which wait for that commit
(``wait_committed``). The hidden snapshot lives while a child (running or
paused) uses it.

The commit (hashing and compressing the memory image: CPU seconds) waits until the
host's CPUs have room (``cpu_busy``), so that it does not slow the children's first
commands, which is what a fork is for; at most ``COMMIT_DEFER_MAX`` seconds, and not at
all once something needs it (``wait_committed``: a child's pause or snapshot).

``Forks`` also keeps the node's other hidden snapshots, a paused sandbox's pause
named for a batch (pausefork.py), alive the same way: while a sandbox uses it, or
something holds it (``hold``: the batch being made, a create from it under way).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from aenv_store.errors import StoreError

from ..errors import SnapshotError, VmError
from ..machine.cpushare import StartingGroup
from ..machine.plan import identity
from ..qemu.launcher import QemuProcess
from ..service import TokenMinter
from ..templates.meta import HIDDEN_PAUSE
from ..templates.template import find_template
from .records import RecordStore, SandboxRecord
from .restore import RestorePlan, greeting, new_sandbox_id, restore, teardown_sandbox
from .runtime import NodeRuntime
from .sandbox import CreateTiming, Sandbox
from .snapshots import LocalSnapshot, NamedSnapshots

# children per fork request: E2B's bound; the admission gate (aenv_vm/machine/admission.py) paces
# their restores, and a child beyond the node's room or queue fails alone (429 each)
MAX_FORK = 100
# how long a fork's commit waits for idle CPU at most (a fleet's children beyond the
# parent's node start from the committed snapshot: they wait as long, polling for it)
COMMIT_DEFER_MAX = 5.0
COMMIT_IDLE = 0.5           # the host counts as having room with this share of its CPU time idle ...
COMMIT_IDLE_OVER = 0.5      # ... over this many seconds
log = logging.getLogger(__name__)


def cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of the host's CPUs since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])   # idle + iowait; guest time is in user


async def wait_for_idle_cpu(until: asyncio.Event, deadline: float) -> None:
    """Return once the host's CPUs were idle ``COMMIT_IDLE`` of the last ``COMMIT_IDLE_OVER``
    seconds, ``until`` is set, or ``deadline`` (monotonic) has passed."""
    idle0, total0 = cpu_times()
    while time.monotonic() < deadline and not until.is_set():
        try:
            await asyncio.wait_for(until.wait(), COMMIT_IDLE_OVER)
            return
        except asyncio.TimeoutError:
            pass
        idle1, total1 = cpu_times()
        if total1 > total0 and (idle1 - idle0) / (total1 - total0) >= COMMIT_IDLE:
            return
        idle0, total0 = idle1, total1


@dataclass(frozen=True)
class Child:
    sandbox: Sandbox
    access_token: str | None


class Forks:
    """Fork snapshots of one node whose commit is still running, and their clean-up."""

    def __init__(self, rt: NodeRuntime, snapshots: NamedSnapshots, records: RecordStore,
                 running: Mapping[str, Sandbox]) -> None:
        self.rt = rt
        self.snapshots = snapshots
        self.records = records
        self.running = running                  # the manager's table (read only here)
        self._commits: dict[str, asyncio.Task[None]] = {}   # fork snapshot id → its background commit
        self._needed: dict[str, asyncio.Event] = {}         # fork snapshot id → set: commit now
        self._holds: Counter[str] = Counter()   # template id → creates (or a batch) under way from it
        self.last_snapshot: float | None = None             # seconds the fork's snapshot took (until restorable)
        self.last_timing: dict[str, float] | None = None

    async def restore_children(self, local: LocalSnapshot, parent: SandboxRecord, count: int,
                               access_token: TokenMinter | None,
                               parent_vm: QemuProcess | None = None) -> list[Child | Exception]:
        """Restore ``count`` children from ``local`` (taken ``snapshot_seconds`` ago).
        A secured parent's children get ``access_token(child id)`` (default: random).
        ``parent_vm``: the parent's QEMU, which shares the CPU with its starting children
        (machine/cpushare.py)."""
        t1 = time.monotonic()
        tid = local.tid
        mem, state = local.dir / "memory", local.dir / "device-state"
        policy = parent.policy
        starting = StartingGroup(self.rt.fork_starting_weight)   # their CPU weight while they start
        if parent_vm is not None:
            starting.running(parent_vm)
        plans = []
        tokens: dict[str, str | None] = {}
        for _ in range(count):
            sid = new_sandbox_id()
            token = ((access_token or (lambda _sid: secrets.token_urlsafe(24)))(sid)
                     if parent.access_token else None)
            tokens[sid] = token
            body = identity(sid)
            if token is not None:
                body["accessToken"] = token
            plans.append(RestorePlan(sid, local.provisional, mem, state, local.layer,
                                     greeting(self.rt, body, local.token, probe_health=False), policy=policy,
                                     starting=starting))
        tasks = [asyncio.ensure_future(restore(self.rt, p)) for p in plans]
        answered: list[float] = []      # when each child's /init answered (or it failed)
        for task in tasks:
            task.add_done_callback(lambda _t: answered.append(time.monotonic()))
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            starting.close()
            # nobody else knows these children yet: stop them (and anything still starting)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    await teardown_sandbox(self.rt, task.result()[0])
            self._discard(local)
            raise
        starting.close()
        out: list[Child | Exception] = []
        for r in results:
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r
                out.append(r)
                continue
            sbx, t = r
            sbx.timing = CreateTiming(t.qemu_start, t.state_load, t.first_answer, t.init, 0.0, t.total, False)
            out.append(Child(sbx, tokens[sbx.id]))
        self.last_timing = {**local.timing, "children answering": max(answered) - t1}
        if any(isinstance(c, Child) for c in out):
            self._commits[tid] = asyncio.get_running_loop().create_task(self._commit(local))
        else:   # every child failed: nothing uses the snapshot
            self._discard(local)
        return out

    def _discard(self, local: LocalSnapshot) -> None:
        shutil.rmtree(local.dir, ignore_errors=True)
        self.rt.templates.forget(local.tid)

    async def _commit(self, local: LocalSnapshot) -> None:
        """A fork's hidden snapshot to the store (background); then its children carry
        the committed template. On failure the task keeps the error: their pauses fail
        with it (there is no memory image in the store to take a delta over)."""
        needed = self._needed.setdefault(local.tid, asyncio.Event())
        await wait_for_idle_cpu(needed, time.monotonic() + COMMIT_DEFER_MAX)
        tc = time.monotonic()
        try:
            await asyncio.to_thread(self.snapshots.commit, local, None)
            tpl = self.rt.templates.resolve(local.tid)
        except Exception as e:
            log.error("fork snapshot %s could not be committed: %s", local.tid, e)
            raise
        for sbx in self.running.values():
            if sbx.template.id == local.tid:
                sbx.template = tpl
        self._commits.pop(local.tid, None)
        self._needed.pop(local.tid, None)
        if self.last_timing is not None:
            self.last_timing["commit (background)"] = time.monotonic() - tc
        self.drop_unused(local.tid)   # its children may all be gone already

    async def wait_committed(self, sbx: Sandbox) -> None:
        """Wait until the template ``sbx`` runs on is in the store (a fork child's, right
        after the fork); ``sbx.template`` is then the committed one."""
        pending = self._commits.get(sbx.template.id)
        if pending is not None:
            self._needed.setdefault(sbx.template.id, asyncio.Event()).set()
            try:
                await asyncio.shield(pending)
            except Exception as e:
                raise SnapshotError(f"sandbox {sbx.id}: its fork snapshot {sbx.template.id} was not committed "
                                    f"to the store ({e}): it cannot be paused or snapshotted") from None

    def hold(self, tid: str) -> None:
        """Keep template ``tid`` while something not yet recorded is made from it."""
        self._holds[tid] += 1

    def release(self, tid: str, hidden: bool = True) -> None:
        """Undo one ``hold``; a hidden snapshot nothing uses any more is dropped (``hidden``
        False: ``tid`` is known not to be one, nothing to look up)."""
        self._holds[tid] -= 1
        if self._holds[tid] <= 0:
            del self._holds[tid]
            if hidden:
                self.drop_unused(tid)

    def drop_unused(self, tid: str) -> None:
        """A hidden snapshot (a fork's, a pause's) lives while a sandbox (running or paused)
        uses it or something holds it."""
        if tid in self._commits or tid in self._holds or not self.snapshots.is_hidden_fork(tid):
            return
        if any(r.template == tid for r in self.records.all()) or any(
                s.template.id == tid for s in self.running.values()):
            return
        self.snapshots.drop(tid)

    def sweep(self) -> None:
        """At start: drop the pauses' hidden snapshots this node made that nothing uses
        any more (a batch cut short by a crash), found by their local directories (worker
        thread). A fork's needs none: its children are recorded before its commit."""
        root = self.rt.templates.root
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            try:
                meta = find_template(self.rt.store, d.name).meta
            except (VmError, StoreError):   # not a template's (any more), or the store cannot tell
                continue
            if meta.hidden == HIDDEN_PAUSE and meta.fork_node == self.rt.node_id:
                self.drop_unused(d.name)

    async def close(self) -> None:
        for needed in self._needed.values():   # no reason to wait for idle CPU any more
            needed.set()
        for task in list(self._commits.values()):
            try:
                await task
            except Exception as e:  # noqa: BLE001 - logged by the task; the others must still finish
                log.debug("fork commit failed at close: %s", e)
