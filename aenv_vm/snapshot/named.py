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
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from aenv_store.catalog import ALIAS, CatalogRecord
from aenv_store.errors import NotFound, StoreError

from ..blockimage.layer import DISK_ROLE
from ..qemu.errors import VmError
from ..template import (ALIAS_PREFIX, DEVICE_STATE, MEMORY_IMAGE, TEMPLATE_KIND, _put_file, find_template,
                        list_templates, remove_template)
from .errors import SnapshotError
from .memory_image import consolidate

if TYPE_CHECKING:
    from ..sandbox import Sandbox

MAX_FORK = 16


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
        async with self.lock(sid):
            sbx = self._running(sid)
            tpl = sbx.template
            tid = f"tpl-{secrets.token_hex(6)}"
            d = self.mgr.run_root / "templates" / tid
            d.mkdir(parents=True, exist_ok=True)
            try:
                try:
                    cap = await self._capture(sbx, d / "device-state")
                    layer = (await asyncio.to_thread(sbx.image.commit, None, {"snapshot": tid})).layer_id
                finally:
                    if sbx.vm.alive() and sbx.vm.qmp is not None:
                        await sbx.vm.qmp.execute("cont")
                base, _ = await self._template_files(tpl)
                try:
                    await asyncio.to_thread(consolidate, base, cap.delta, d / "memory")
                finally:
                    self._give_back(cap.delta.data)
                rec = self.records.get(sid)
                meta = dict(self.mgr.store.get_record(tpl.id).meta_dict())
                meta.update({"snapshot_of": sid, "parent_template": tpl.id})
                if hidden:
                    meta["hidden"] = "fork"
                if rec is not None:
                    meta["metadata"] = json.dumps(rec.metadata, sort_keys=True)
                    if rec.access_token:  # the memory image holds it anyway; restores need it to re-key envd
                        meta["envd_token"] = rec.access_token

                def commit() -> None:
                    store = self.mgr.store
                    with store.workspace() as ws:
                        mem = _put_file(ws, d / "memory", MEMORY_IMAGE, {"template": tid})
                        state = _put_file(ws, d / "device-state", DEVICE_STATE, {"template": tid})
                        ws.commit(CatalogRecord(name=tid, kind=TEMPLATE_KIND,
                                                manifests=((DISK_ROLE, layer), ("memory", mem), ("state", state)),
                                                meta=tuple(sorted(meta.items())), created=time.time()))
                    if name:
                        store.put_record(CatalogRecord(name=ALIAS_PREFIX + name, kind=ALIAS, target=tid,
                                                       created=time.time()), exclusive=True)
                await asyncio.to_thread(commit)
            except BaseException:
                shutil.rmtree(d, ignore_errors=True)
                raise
            return tid, ([name] if name else [])

    async def fork(self, sid: str, count: int, timeout: float | None = None,
                   access_token: Callable[[str], str] | None = None) -> "list[Sandbox | Exception]":
        """``count`` children of a running sandbox, started concurrently from one snapshot.
        A secured parent's children get ``access_token(child id)`` (default: random)."""
        if not 1 <= count <= MAX_FORK:
            raise SnapshotError(f"fork count must be 1..{MAX_FORK}, got {count}")
        parent = self.record(sid)
        t0 = time.monotonic()
        tid, _ = await self.snapshot(sid, None, hidden=True)
        self.last_fork_snapshot = time.monotonic() - t0
        tpl = self.mgr._template(tid)

        async def child() -> "Sandbox":
            sbx = await self.mgr._restore(tpl, egress=parent.allow_internet_access)
            try:
                token = ((access_token or (lambda _sid: secrets.token_urlsafe(24)))(sbx.id)
                         if parent.access_token else None)
                await asyncio.to_thread(self._init, sbx.envd_port, parent.access_token, token, sbx.envd_host)
            except BaseException:
                await self.mgr._teardown(sbx.id, sbx.vm, sbx.image, sbx.dir)
                raise
            self.mgr.sandboxes[sbx.id] = sbx
            self.on_created(sbx, timeout=parent.timeout if timeout is None else timeout,
                            metadata={**parent.metadata, "forked_from": sid}, auto_pause=parent.auto_pause,
                            env_vars=parent.env_vars, access_token=token,
                            allow_internet_access=parent.allow_internet_access)
            return sbx
        results = await asyncio.gather(*(child() for _ in range(count)), return_exceptions=True)
        self._drop_unused_fork(tid)   # every child failed: nothing uses the snapshot
        out: list[Sandbox | Exception] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out.append(r)  # type: ignore[arg-type]
        return out

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
