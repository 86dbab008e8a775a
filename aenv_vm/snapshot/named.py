"""Named snapshots (usable as templates) and fork, for the Snapshotter.

A snapshot stops the VM only for the capture (device state + private pages)
and the seal of the disk's upper layer, lets it run again, then writes a
**full** memory image (base + delta: the consolidation step) and commits it
with the device state as a catalog record of kind ``template``, so
``SandboxManager.create(snapshot_id or name)`` restores from it like from any
template. A fork is a hidden snapshot plus ``count`` children restored from
it concurrently; the hidden snapshot goes with its last child.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from aenv_store.errors import NotFound, StoreError
from aenv_store.formats.catalog import ALIAS, CatalogRecord
from aenv_store.formats.ids import Digest

from ..blockimage.layer import DISK_ROLE
from ..qemu.errors import VmError
from ..template import (ALIAS_PREFIX, DEVICE_STATE, MEMORY_IMAGE, TEMPLATE_KIND, Template, _put_file,
                        find_template, list_templates, remove_template)
from .errors import SnapshotError
from .memory_image import consolidate

if TYPE_CHECKING:
    from ..sandbox import Sandbox

MAX_FORK = 16
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LocalSnapshot:
    tid: str
    dir: Path
    layer: Digest                   # the sealed disk layer
    meta: dict[str, str]            # of the template record
    token: str | None               # envd access token the snapshot's guest holds
    provisional: Template           # restorable from the local files (memory/state ids unknown)
    timing: dict[str, float]


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    names: tuple[str, ...]
    sandbox_id: str
    created: float


class NamedSnapshots:
    """Mixed into Snapshotter (which provides mgr, records, lock, _capture, ...)."""

    mgr: Any
    records: Any
    _configs: dict
    _tokens: dict
    last_fork_snapshot: float | None
    last_fork_timing: dict[str, float] | None
    _fork_commits: dict[str, asyncio.Task]

    async def snapshot(self, sid: str, name: str | None = None, *, hidden: bool = False) -> tuple[str, list[str]]:
        """A named snapshot of a running sandbox, usable as a template. The VM is
        stopped only for the capture and the disk seal."""
        if name is not None:
            try:
                find_template(self.mgr.store, name)
            except VmError:
                pass
            else:
                raise SnapshotError(f"a template or snapshot named {name!r} already exists")
        local = await self._snapshot_local(sid, hidden)
        try:
            await asyncio.to_thread(self._snapshot_commit, local, name)
        except BaseException:
            shutil.rmtree(local.dir, ignore_errors=True)
            raise
        return local.tid, ([name] if name else [])

    async def _snapshot_local(self, sid: str, hidden: bool) -> _LocalSnapshot:
        """Capture, seal the disk, let the VM run again, write the full memory file:
        everything a restore on this node needs, nothing committed yet."""
        async with self.lock(sid):
            sbx = self._running(sid)
            await self._template_committed(sbx)
            tpl = sbx.template
            tid = f"tpl-{secrets.token_hex(6)}"
            d = self.mgr.run_root / "templates" / tid
            d.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            try:
                try:
                    cap = await self._capture(sbx, d / "device-state")
                    t1 = time.monotonic()
                    layer = (await asyncio.to_thread(sbx.image.commit, None, {"snapshot": tid})).layer_id
                finally:
                    if sbx.vm.alive() and sbx.vm.qmp is not None:
                        await sbx.vm.qmp.execute("cont")
                t2 = time.monotonic()
                base, _ = await self._template_files(tpl)
                try:
                    await asyncio.to_thread(consolidate, base, cap.delta, d / "memory")
                finally:
                    self._give_back(cap.delta.data)
                t3 = time.monotonic()
                rec = self.records.get(sid)
                meta = dict(self.mgr.store.get_record(tpl.id).meta_dict())
                meta.update({"snapshot_of": sid, "parent_template": tpl.id})
                if hidden:
                    meta["hidden"] = "fork"
                token = rec.access_token if rec is not None else None
                if rec is not None:
                    meta["metadata"] = json.dumps(rec.metadata, sort_keys=True)
                    if rec.access_token:  # the memory image holds it anyway; restores need it to re-key envd
                        meta["envd_token"] = rec.access_token
            except BaseException:
                shutil.rmtree(d, ignore_errors=True)
                raise
            # a Template for restores from the local files; its memory and state ids are
            # known once committed (the fork swaps in the committed one before it returns)
            unknown = Digest(bytes(32))
            provisional = Template(id=tid, disk=layer, memory=unknown, device_state=unknown,
                                   memory_mib=tpl.memory_mib, vcpus=tpl.vcpus, accel=tpl.accel,
                                   guest_key=tpl.guest_key, kernel_cmdline=tpl.kernel_cmdline, created=time.time())
            return _LocalSnapshot(tid, d, layer, meta, token, provisional,
                                  {"capture": t1 - t0, "seal": t2 - t1, "consolidate": t3 - t2})

    def _snapshot_commit(self, local: _LocalSnapshot, name: str | None) -> None:
        """Commit a local snapshot to the store as a template record (worker thread)."""
        store = self.mgr.store
        d = local.dir
        with store.workspace() as ws:
            mem = _put_file(ws, d / "memory", MEMORY_IMAGE, {"template": local.tid})
            state = _put_file(ws, d / "device-state", DEVICE_STATE, {"template": local.tid})
            ws.commit(CatalogRecord(name=local.tid, kind=TEMPLATE_KIND,
                                    manifests=((DISK_ROLE, local.layer), ("memory", mem), ("state", state)),
                                    meta=tuple(sorted(local.meta.items())), created=time.time()))
        if name:
            store.put_record(CatalogRecord(name=ALIAS_PREFIX + name, kind=ALIAS, target=local.tid,
                                           created=time.time()), exclusive=True)

    async def fork(self, sid: str, count: int, timeout: float | None = None,
                   access_token: Callable[[str], str] | None = None) -> "list[Sandbox | Exception]":
        """``count`` children of a running sandbox, started concurrently from one snapshot.
        A secured parent's children get ``access_token(child id)`` (default: random).

        The children restore from the snapshot's local files; the snapshot is
        committed to the store in the background once they answer (so that it does
        not compete with them for the CPU). Its ids are needed only from a child's
        first pause or snapshot on, which wait for that commit (``_template_committed``)."""
        if not 1 <= count <= MAX_FORK:
            raise SnapshotError(f"fork count must be 1..{MAX_FORK}, got {count}")
        parent = self.record(sid)
        t0 = time.monotonic()
        local = await self._snapshot_local(sid, hidden=True)
        tid = local.tid
        self._tokens[tid] = local.token     # what the children's envd holds until their /init
        t1 = time.monotonic()
        tokens: dict[str, str | None] = {}

        def init(child_id: str) -> dict:
            # identity, clock and the child's own token in the child's one /init
            tokens[child_id] = ((access_token or (lambda _sid: secrets.token_urlsafe(24)))(child_id)
                                if parent.access_token else None)
            return {"accessToken": tokens[child_id]} if parent.access_token else {}
        egress = parent.allow_internet_access is not False
        tasks = [asyncio.ensure_future(self.mgr._restore(local.provisional, egress=egress, init=init))
                 for _ in range(count)]
        answered: list[float] = []      # when each child's /init answered (or it failed)
        for task in tasks:
            task.add_done_callback(lambda _t: answered.append(time.monotonic()))
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            # nobody else knows these children yet: stop them (and anything still starting)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for t in tasks:
                k = t.result() if t.done() and not t.cancelled() and t.exception() is None else None
                if k is not None:
                    await self.mgr._teardown(k.id, k.vm, k.image, k.dir)
            shutil.rmtree(local.dir, ignore_errors=True)
            self._tokens.pop(tid, None)
            raise
        kids = [r for r in results if not isinstance(r, BaseException)]
        self.last_fork_snapshot = t1 - t0
        self.last_fork_timing = {**local.timing, "children answering": max(answered) - t1}
        if kids:
            self._fork_commits[tid] = asyncio.get_running_loop().create_task(self._commit_fork(local))
        else:   # every child failed: nothing uses the snapshot
            shutil.rmtree(local.dir, ignore_errors=True)
            self._tokens.pop(tid, None)
        for k in kids:
            self.mgr.sandboxes[k.id] = k
            self.on_created(k, timeout=parent.timeout if timeout is None else timeout,
                            metadata={**parent.metadata, "forked_from": sid}, auto_pause=parent.auto_pause,
                            env_vars=parent.env_vars, access_token=tokens[k.id],
                            allow_internet_access=parent.allow_internet_access)
        out: list[Sandbox | Exception] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out.append(r)  # type: ignore[arg-type]
        return out

    async def _commit_fork(self, local: _LocalSnapshot) -> None:
        """A fork's hidden snapshot to the store (background); then its children carry
        the committed template. On failure the task keeps the error: their pauses fail
        with it (there is no memory image in the store to take a delta over)."""
        tc = time.monotonic()
        try:
            await asyncio.to_thread(self._snapshot_commit, local, None)
            tpl = self.mgr._template(local.tid)
        except Exception as e:
            log.error("fork snapshot %s could not be committed: %s", local.tid, e)
            raise
        for sbx in self.mgr.sandboxes.values():
            if sbx.template.id == local.tid:
                sbx.template = tpl
        self._fork_commits.pop(local.tid, None)
        if self.last_fork_timing is not None:
            self.last_fork_timing["commit (background)"] = time.monotonic() - tc
        self._drop_unused_fork(local.tid)   # its children may all be gone already

    async def _template_committed(self, sbx: "Sandbox") -> None:
        """Wait until the template ``sbx`` runs on is in the store (a fork child's, right
        after the fork); ``sbx.template`` is then the committed one."""
        pending = self._fork_commits.get(sbx.template.id)
        if pending is not None:
            try:
                await asyncio.shield(pending)
            except Exception as e:
                raise SnapshotError(f"sandbox {sbx.id}: its fork snapshot {sbx.template.id} was not committed "
                                    f"to the store ({e}): it cannot be paused or snapshotted") from None

    def list_snapshots(self) -> list[SnapshotInfo]:
        out = []
        for tpl, aliases in list_templates(self.mgr.store):
            meta = self.mgr.store.get_record(tpl.id).meta_dict()
            if "snapshot_of" in meta and "hidden" not in meta:
                out.append(SnapshotInfo(tpl.id, tuple(aliases), meta["snapshot_of"], tpl.created))
        return sorted(out, key=lambda s: s.created)

    def delete_snapshot(self, snapshot_id: str) -> None:
        tpl = find_template(self.mgr.store, snapshot_id)
        if "snapshot_of" not in self.mgr.store.get_record(tpl.id).meta_dict():
            raise SnapshotError(f"{snapshot_id} is a template, not a snapshot")
        users = sorted(r.id for r in self.records.all() if r.template == tpl.id)
        if users:  # their pauses are deltas over its memory image, their resumes need its record
            raise SnapshotError(f"snapshot {snapshot_id} is in use by {len(users)} sandbox(es) "
                                f"({', '.join(users[:3])}{', ...' if len(users) > 3 else ''}): kill them first")
        remove_template(self.mgr.store, tpl.id)
        shutil.rmtree(self.mgr.run_root / "templates" / tpl.id, ignore_errors=True)

    def _drop_unused_fork(self, tid: str) -> None:
        """A fork's hidden snapshot lives while a child (running or paused) uses it."""
        try:
            if self.mgr.store.get_record(tid).meta_dict().get("hidden") != "fork":
                return
        except (NotFound, StoreError, ValueError):
            return
        if any(r.template == tid for r in self.records.all()) or any(
                s.template.id == tid for s in self.mgr.sandboxes.values()):
            return
        with contextlib.suppress(NotFound, StoreError, VmError):
            remove_template(self.mgr.store, tid)
        shutil.rmtree(self.mgr.run_root / "templates" / tid, ignore_errors=True)
        self._configs.pop(tid, None)
        self._tokens.pop(tid, None)
