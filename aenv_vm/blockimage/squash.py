"""Bounded disk chains: squash a sandbox's layer stack into one layer.

Every pause that wrote to the disk seals one more layer on the sandbox's
stack (block images allow 255). When a stack grows past ``MAX_DISK_CHAIN``
the pause's commit replaces it by one equivalent base layer built from the
flattened extent map: a segment that covers a whole chunk keeps that chunk
(no data is read or stored again); a segment that covers part of a chunk (a
later layer overwrote the rest) is read and staged as a new, smaller chunk.
Reads never walked the chain anyway (the map is flat); squashing bounds the
manifests a reopen must load and keeps commits below the 255-layer limit.
"""
from __future__ import annotations

from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest
from aenv_store.store import Store
from aenv_store.workspace import Workspace

from .extent_map import ExtentMap
from .layer import DISK_LAYER, coalesce, load_stack

MAX_DISK_CHAIN = 32


def squash(store: Store, ws: Workspace, top: Digest, meta: dict[str, str]) -> tuple[Digest, int]:
    """Stage (in workspace ``ws``) one parentless layer with the content of the stack
    under ``top``; returns its id and how many bytes had to be restaged."""
    layers = load_stack(store, top)
    size = layers[-1].size
    chunk_len: dict[Digest, int] = {}
    for m in layers:
        for e in m.extents:
            if e.chunk is not None:
                chunk_len[e.chunk] = e.length
    flat = ExtentMap.from_layers(size, [m.extents for m in layers])
    extents: list[Extent] = []
    restaged = 0
    for seg in flat.segments():
        if seg.chunk is None:
            extents.append(Extent(seg.start, seg.length, None))
        elif seg.chunk_offset == 0 and seg.length == chunk_len.get(seg.chunk):
            extents.append(Extent(seg.start, seg.length, seg.chunk))
        else:
            piece = store.read_chunk(seg.chunk)[seg.chunk_offset:seg.chunk_offset + seg.length]
            cid = ws.stage(piece)
            extents.append(Extent(seg.start, seg.length, cid))
            restaged += seg.length
    layer = Manifest(DISK_LAYER, size, tuple(coalesce(extents)), parent=None, chunk_size=layers[-1].chunk_size,
                     meta=tuple(sorted({**meta, "squashed_from": top.hex()}.items())))
    return ws.add_manifest(layer), restaged
