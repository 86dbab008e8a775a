"""Named snapshots of running sandboxes, usable as templates.

A snapshot stops the VM only for the capture (capture.py) and the seal of the
disk's upper layer, lets it run again, then writes a **full** memory image
(template memory + the captured pages: the consolidation step) and commits it
with the device state as a catalog record of kind ``template`` (templates/freeze.py),
so creating a sandbox from the snapshot's id or name restores from it like from
any template. Its meta is its parent template's (so it carries what a cold boot
of its sandboxes needs: the build's settings and start command) with the
snapshot's keys set (templates/meta.py). A fork (fork.py) takes a hidden
snapshot the same way and restores its children from the local files before
the commit.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import StoreError
from aenv_store.errors import StoreNotFound
from aenv_store.formats.catalog import check_name
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Manifest

from ..errors import BadRequest, Conflict, NotFound, VmError
from ..memory.memory_image import consolidate, sync_file
from ..service import SnapshotInfo
from ..templates.freeze import freeze
from ..templates.meta import HIDDEN_FORK, HIDDEN_KINDS, TemplateMeta
from ..templates.template import ALIAS_PREFIX, Template, find_template, list_templates, remove_template
from .capture import Capturer
from .handover import PAUSED_KIND, shared_mark
from .records import SandboxRecord
from .runtime import NodeRuntime
from .sandbox import Sandbox


@dataclass(frozen=True)
class LocalSnapshot:
    tid: str
    dir: Path
    layer: Digest                   # the sealed disk layer
    meta: TemplateMeta              # of the template record
    token: str | None               # envd access token the snapshot's guest holds
    provisional: Template           # restorable from the local files (memory/state ids unknown)
    timing: dict[str, float]


class NamedSnapshots:
    def __init__(self, rt: NodeRuntime, capturer: Capturer) -> None:
        self.rt = rt
        self.capturer = capturer

    def check_name_free(self, name: str) -> None:
        """BadRequest if ``name`` cannot be a snapshot's name, Conflict if it is taken."""
        try:
            check_name(ALIAS_PREFIX + name)
        except ValueError as e:
            raise BadRequest(f"snapshot name: {e}") from None
        try:
            find_template(self.rt.store, name)
        except NotFound:
            return
        raise Conflict(f"a template or snapshot named {name!r} already exists")

    async def take_local(self, sbx: Sandbox, rec: SandboxRecord | None, hidden: bool,
                         team: str | None = None) -> LocalSnapshot:
        """Capture, seal the disk, let the VM run again, write the full memory file:
        everything a restore on this node needs, nothing committed yet. The caller holds
        the sandbox's lock. ``team``: the owner a named snapshot's record carries."""
        tpl = sbx.template
        tid = f"tpl-{secrets.token_hex(6)}"
        d = self.rt.templates.dir(tid)
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            try:
                cap = await self.capturer.capture(sbx, d / "device-state")
                t1 = time.monotonic()
                layer = (await asyncio.to_thread(sbx.image.commit, None, {"snapshot": tid})).layer_id
            finally:
                if sbx.vm.alive() and sbx.vm.qmp is not None:
                    await sbx.vm.qmp.execute("cont")
            t2 = time.monotonic()
            # a local base (never the lazy file): consolidation reads it whole, holes kept.
            # Not synced here: restores from it need only the page cache, and writing
            # 256 MiB out would hold the fork's children back; ``commit`` syncs it before
            # the store names it (a local memory file the store names is trusted as is)
            base, _ = await self.rt.templates.full_files(tpl)
            try:
                await asyncio.to_thread(consolidate, base, cap.delta, d / "memory", False)
            finally:
                self.capturer.give_back(cap.delta.data)
            t3 = time.monotonic()
            meta = snapshot_meta(tpl.meta, sbx.id, tpl.id, sbx.guest_token, rec, self.rt.node_id if hidden else None,
                                 team=None if hidden else team)
            meta = dataclasses.replace(meta, snapshot_bytes=own_bytes(d / "memory", sbx.image.layers, tpl.disk))
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        # a Template for restores from the local files; its memory and state ids are
        # known once committed (the fork swaps in the committed one afterwards)
        unknown = Digest(bytes(32))
        provisional = Template(id=tid, disk=layer, memory=unknown, device_state=unknown, created=time.time(),
                               meta=meta)
        return LocalSnapshot(tid, d, layer, meta, meta.envd_token, provisional,
                             {"capture": t1 - t0, "seal": t2 - t1, "consolidate": t3 - t2})

    def commit(self, local: LocalSnapshot, name: str | None) -> None:
        """Commit a local snapshot to the store as a template record (worker thread)."""
        sync_file(local.dir / "memory")     # take_local left it to the page cache
        sync_file(local.dir)
        freeze(self.rt.store, local.tid, disk=local.layer, memory=local.dir / "memory",
               device_state=local.dir / "device-state", meta=local.meta, alias=name, exclusive_alias=True)

    def listed(self) -> list[SnapshotInfo]:
        """The named snapshots in the store (not forks' hidden ones), oldest first."""
        out = []
        for tpl, aliases in list_templates(self.rt.store):
            if tpl.meta.snapshot_of is not None and tpl.meta.hidden is None:
                out.append(SnapshotInfo(tpl.id, tuple(aliases), tpl.meta.snapshot_of, tpl.created, tpl.meta.team,
                                        tpl.meta.snapshot_bytes))
        return sorted(out, key=lambda s: s.created)

    def delete(self, snapshot_id: str, users: list[str]) -> None:
        """Delete a snapshot no sandbox uses (``users``: this node's sandboxes on it; paused
        sandboxes of other nodes sharing the repository count too)."""
        tpl = find_template(self.rt.store, snapshot_id)
        if tpl.meta.snapshot_of is None:
            raise BadRequest(f"{snapshot_id} is a template, not a snapshot")
        users = users + sorted(r.meta_dict().get("sandbox", r.name) for r in self.rt.store.list_records(PAUSED_KIND)
                               if r.meta_dict().get("template") == tpl.id
                               and r.meta_dict().get("sandbox") not in users)
        if users:  # their pauses are deltas over its memory image, their resumes need its record
            raise Conflict(f"snapshot {snapshot_id} is in use by {len(users)} sandbox(es) "
                           f"({', '.join(users[:3])}{', ...' if len(users) > 3 else ''}): kill them first")
        remove_template(self.rt.store, tpl.id)
        with contextlib.suppress(StoreError):
            self.rt.store.delete_record(shared_mark(tpl.id))
        self.rt.templates.forget(tpl.id)

    def is_hidden_fork(self, tid: str) -> bool:
        """A hidden snapshot (a fork's, or a pause's made for a batch: pausefork.py) that
        this node may drop with its last user: made here, never used elsewhere
        (``mark_shared``)."""
        store = self.rt.store
        try:
            meta = TemplateMeta.from_meta(store.get_record(tid).meta_dict())
        except (StoreError, ValueError):  # no such record, or the store cannot tell: not ours to drop
            return False
        if meta.hidden not in HIDDEN_KINDS or (meta.fork_node or "") not in ("", self.rt.node_id):
            return False
        try:
            store.get_record(shared_mark(tid))
        except StoreNotFound:
            return True
        except (StoreError, ValueError):
            pass
        return False

    def drop(self, tid: str) -> None:
        """Remove a hidden snapshot nothing uses any more (store and local files)."""
        with contextlib.suppress(StoreError, VmError):   # already gone, or the store is away (gc finds it)
            remove_template(self.rt.store, tid)
        self.rt.templates.forget(tid)


def own_bytes(memory: Path, layers: Sequence[Manifest], template_disk: Digest) -> int:
    """What a snapshot takes on its own: its full memory image as allocated (a hole costs
    nothing) plus the data of its disk's layers above its template's (``template_disk``,
    their parent), zero runs free; before the repository's deduplication and compression,
    which can only make it smaller."""
    disk = 0
    for layer in reversed(layers):
        if layer.id == template_disk:
            break
        disk += sum(e.length for e in layer.extents if e.chunk is not None)
    return os.stat(memory).st_blocks * 512 + disk


def snapshot_meta(parent: TemplateMeta, of: str, parent_template: str, token: str | None,
                  rec: SandboxRecord | None, fork_node: str | None, hidden: str = HIDDEN_FORK,
                  team: str | None = None) -> TemplateMeta:
    """The meta of a snapshot of sandbox ``of`` (running ``parent_template``, whose meta is
    ``parent``: the machine, and a build's settings and start command, which a cold boot of
    the snapshot's sandboxes needs) with the snapshot's own keys set. ``token``: what its
    envd demands now; ``fork_node``: a hidden snapshot (of kind ``hidden``) made on that node;
    ``team``: the API team that owns a named snapshot."""
    meta = dataclasses.replace(
        parent, snapshot_of=of, parent_template=parent_template,
        # what the frozen envd demands (the memory image holds it anyway; restores need
        # it to re-key envd): the sandbox's token, not the parent template's secret
        envd_token=token or None,
        # the parent's own snapshot keys are not this snapshot's: a named snapshot of a
        # fork child is not hidden, and what was mounted or set is this sandbox's
        # (nor is its owner: a snapshot of a sandbox made from team A's snapshot is its taker's)
        hidden=None, fork_node=None, metadata=None, volume_paths=None, team=team)
    if fork_node is not None:   # only its maker drops it (drop_unused)
        meta = dataclasses.replace(meta, hidden=hidden, fork_node=fork_node)
    if rec is not None:
        meta = dataclasses.replace(meta, metadata=tuple(sorted(rec.metadata.items())))
        if rec.volume_mounts:   # mounted in the frozen guest: a create from it must drop them
            meta = dataclasses.replace(meta, volume_paths=tuple(sorted(m["path"] for m in rec.volume_mounts)))
    return meta
