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
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Mapping

from ..errors import SnapshotError
from ..machine.plan import identity
from ..service import TokenMinter
from .records import RecordStore, SandboxRecord
from .restore import RestorePlan, greeting, new_sandbox_id, restore, teardown_sandbox
from .runtime import NodeRuntime
from .sandbox import CreateTiming, Sandbox
from .snapshots import LocalSnapshot, NamedSnapshots

# children per fork request: E2B's bound; the admission gate (aenv_vm/machine/admission.py) paces
# their restores, and a child beyond the node's room or queue fails alone (429 each)
MAX_FORK = 100
log = logging.getLogger(__name__)


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
        self.last_snapshot: float | None = None             # seconds the fork's snapshot took (until restorable)
        self.last_timing: dict[str, float] | None = None

    async def restore_children(self, local: LocalSnapshot, parent: SandboxRecord, count: int,
                               access_token: TokenMinter | None) -> list[Child | Exception]:
        """Restore ``count`` children from ``local`` (taken ``snapshot_seconds`` ago).
        A secured parent's children get ``access_token(child id)`` (default: random)."""
        t1 = time.monotonic()
        tid = local.tid
        mem, state = local.dir / "memory", local.dir / "device-state"
        policy = parent.policy
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
                                     greeting(self.rt, body, local.token, probe_health=False), policy=policy))
        tasks = [asyncio.ensure_future(restore(self.rt, p)) for p in plans]
        answered: list[float] = []      # when each child's /init answered (or it failed)
        for task in tasks:
            task.add_done_callback(lambda _t: answered.append(time.monotonic()))
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            # nobody else knows these children yet: stop them (and anything still starting)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    await teardown_sandbox(self.rt, task.result()[0])
            self._discard(local)
            raise
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
        if self.last_timing is not None:
            self.last_timing["commit (background)"] = time.monotonic() - tc
        self.drop_unused(local.tid)   # its children may all be gone already

    async def wait_committed(self, sbx: Sandbox) -> None:
        """Wait until the template ``sbx`` runs on is in the store (a fork child's, right
        after the fork); ``sbx.template`` is then the committed one."""
        pending = self._commits.get(sbx.template.id)
        if pending is not None:
            try:
                await asyncio.shield(pending)
            except Exception as e:
                raise SnapshotError(f"sandbox {sbx.id}: its fork snapshot {sbx.template.id} was not committed "
                                    f"to the store ({e}): it cannot be paused or snapshotted") from None

    def drop_unused(self, tid: str) -> None:
        """A fork's hidden snapshot lives while a child (running or paused) uses it."""
        if tid in self._commits or not self.snapshots.is_hidden_fork(tid):
            return
        if any(r.template == tid for r in self.records.all()) or any(
                s.template.id == tid for s in self.running.values()):
            return
        self.snapshots.drop(tid)

    async def close(self) -> None:
        for task in list(self._commits.values()):
            try:
                await task
            except Exception as e:  # noqa: BLE001 - logged by the task; the others must still finish
                log.debug("fork commit failed at close: %s", e)
