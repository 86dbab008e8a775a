"""Freezing: a stopped guest's disk layer, memory image and device state committed as
one template record. The one way a template record is made: the base template
(base.py), a template build's VM (aenv_vm/builds/vm.py) and named and fork snapshots
(aenv_vm/sandboxes/snapshots.py) all commit through ``freeze``; a paused sandbox's
pause, already committed, is named as a template by ``freeze_pause`` (nothing staged).

Each caller brings what it has: a booted machine its disk image, whose upper layer
is sealed here; a snapshot the layer it sealed while its sandbox was stopped (the
sandbox runs on). The memory file is always whole (a snapshot's is the template's
image with the captured pages written over it: snapshots.py consolidates it first).

Order (crash-safe: the workspace commit order, docs/store-format.md): the disk layer, then the
memory image and the device state staged as blobs (only their allocated, non-zero
chunks), then the ``tpl-<hex>`` record naming all three with the ``TemplateMeta``,
then the alias. Layer and blobs carry meta ``template: <id>`` (the layer of a
snapshot ``snapshot: <id>``, written when it was sealed).
"""
from __future__ import annotations

import time
from pathlib import Path

from aenv_store.formats.ids import Digest
from aenv_store.store import Store

from ..blockimage.image import BlockImage
from .meta import TemplateMeta
from .template import DEVICE_STATE, MEMORY_IMAGE, put_alias, stage_file, template_record


def freeze(store: Store, tid: str, *, disk: BlockImage | Digest, memory: Path, device_state: Path,
           meta: TemplateMeta, alias: str | None = None, exclusive_alias: bool = False) -> None:
    """Commit template ``tid`` (worker thread): ``disk`` an image whose upper layer is
    sealed now, or a layer sealed already; ``memory`` and ``device_state`` the stopped
    guest's files; ``alias``: ``template.<alias>`` → ``tid`` (``exclusive_alias``: fail
    if it exists)."""
    layer = disk if isinstance(disk, Digest) else disk.commit(meta={"template": tid}).layer_id
    with store.workspace() as ws:
        mem = stage_file(ws, memory, MEMORY_IMAGE, {"template": tid})
        state = stage_file(ws, device_state, DEVICE_STATE, {"template": tid})
        ws.commit(template_record(tid, layer, mem, state, meta, time.time()))
    if alias:
        put_alias(store, alias, tid, time.time(), exclusive=exclusive_alias)


def freeze_pause(store: Store, tid: str, *, disk: Digest, base: Digest, delta: Digest, device_state: Digest,
                 meta: TemplateMeta) -> None:
    """Template ``tid`` naming a committed pause's manifests (worker thread): its disk
    layer, its memory ``delta`` over full image ``base``, its device state. Nothing is
    staged or copied; the record is written through a workspace so that it holds the
    repository's shared lock: a gc (exclusive) runs wholly before it, and then the check
    that every manifest still exists fails cleanly (StoreNotFound), or wholly after it, and
    then the record is a root of its marks."""
    with store.workspace() as ws:
        ws.commit(template_record(tid, disk, base, device_state, meta, time.time(), delta=delta))
