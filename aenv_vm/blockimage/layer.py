"""Committed disk layers: store manifests of media type
``application/vnd.aenv.disk-layer`` (docs/block-image.md).

A layer's ``parent`` is the layer below it; the top layer's manifest id names
the whole stack. A layer without a parent is a base layer (gaps read as
zeros); in a delta layer gaps mean "take it from below" and zero extents mask
what is below. Extents are 4 KiB-aligned (except at the end of the image).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from aenv_store.errors import CorruptData, StoreNotFound
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest

from ..errors import VmError

if TYPE_CHECKING:
    from aenv_store.formats.catalog import CatalogRecord

DISK_LAYER = "application/vnd.aenv.disk-layer"
IMAGE_KIND = "image"
DISK_ROLE = "disk"
MAX_LAYERS = 255
LAYER_ALIGN = 4096


class ImageError(VmError):
    """A block image is unusable (bad stack, too many layers, read-only, ...)."""


class ManifestSource(Protocol):
    def load_manifest(self, mid: Digest) -> Manifest: ...


def load_stack(store: ManifestSource, top: Digest) -> list[Manifest]:
    """The layer manifests from ``top`` down its parents, returned bottom first."""
    chain: list[Manifest] = []
    mid: Digest | None = top
    seen: set[Digest] = set()
    while mid is not None:
        if mid in seen:
            raise CorruptData(f"layer {mid.short()} is its own ancestor")
        seen.add(mid)
        if len(chain) >= MAX_LAYERS:
            raise ImageError(f"image {top.short()} has more than {MAX_LAYERS} layers")
        try:
            m = store.load_manifest(mid)
        except StoreNotFound:
            raise StoreNotFound(f"layer {mid.short()} of image {top.short()} is missing") from None
        if m.media_type != DISK_LAYER:
            raise ImageError(f"manifest {mid.short()} is a {m.media_type}, not a disk layer")
        chain.append(m)
        mid = m.parent
    chain.reverse()
    return chain


def coalesce(extents: list[Extent]) -> list[Extent]:
    """Merge adjacent zero extents (data extents stay one per chunk piece)."""
    out: list[Extent] = []
    for e in extents:
        if out and e.chunk is None and out[-1].chunk is None and out[-1].end == e.offset:
            out[-1] = Extent(out[-1].offset, out[-1].length + e.length, None)
        else:
            out.append(e)
    return out


def image_record(name: str, top: Digest, meta: dict[str, str] | None = None,
                 created: float = 0.0) -> "CatalogRecord":
    from aenv_store.formats.catalog import CatalogRecord

    return CatalogRecord(name=name, kind=IMAGE_KIND, manifests=((DISK_ROLE, top),),
                         meta=tuple(sorted((meta or {}).items())), created=created)


def image_top(record: "CatalogRecord") -> Digest:
    """The top layer id a catalog record names (kind image, or any record with a disk role)."""
    for role, mid in record.manifests:
        if role == DISK_ROLE:
            return mid
    raise ImageError(f"catalog record {record.name!r} ({record.kind}) names no disk layer")
