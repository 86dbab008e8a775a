"""A snapshot's own bytes (sandboxes/snapshots.py ``own_bytes``, what a team's
snapshotBytes quota sums): its memory image as allocated, holes free, plus the data of its
disk's layers above its template's top layer, zero runs free; and the size travels in its
record's meta."""
from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest
from aenv_vm.blockimage.layer import DISK_LAYER
from aenv_vm.sandboxes.snapshots import own_bytes
from aenv_vm.templates.meta import TemplateMeta

MIB = 1 << 20


def layer(parent: Manifest | None, data: int, zeros: int) -> Manifest:
    chunk = 1 * MIB        # a data extent lies within one chunk
    extents = [Extent(off, chunk, Digest.of(b"%d" % off)) for off in range(0, data, chunk)]
    if zeros:
        extents.append(Extent(data, zeros, None))
    return Manifest(DISK_LAYER, 64 * MIB, tuple(extents), parent=parent.id if parent else None, chunk_size=chunk)


def test_only_the_layers_above_the_template_and_the_allocated_memory_count(tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    with memory.open("wb") as f:
        f.truncate(256 * MIB)                   # a hole: costs nothing
        f.seek(8 * MIB)
        f.write(b"x" * (3 * MIB))
    base = layer(None, 40 * MIB, 0)
    template_top = layer(base, 5 * MIB, 1 * MIB)
    pause = layer(template_top, 2 * MIB, 7 * MIB)      # a pause of the sandbox before the snapshot
    sealed = layer(pause, 1 * MIB, 0)
    allocated = memory.stat().st_blocks * 512
    assert 3 * MIB <= allocated < 4 * MIB
    assert own_bytes(memory, (base, template_top, pause, sealed), template_top.id) == allocated + 3 * MIB
    # nothing written since the template: the memory image only
    assert own_bytes(memory, (base, template_top), template_top.id) == allocated


@given(st.none() | st.integers(0, 1 << 62))
def test_the_size_round_trips_through_the_records_meta(size: int | None) -> None:
    meta = TemplateMeta(memory_mib=256, vcpus=1, accel="tcg", guest_key="g", kernel_cmdline="console=ttyS0",
                        snapshot_bytes=size)
    assert TemplateMeta.from_meta(meta.to_meta()).snapshot_bytes == size
