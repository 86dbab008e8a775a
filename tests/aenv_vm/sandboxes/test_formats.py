"""memory.delta, pagemap bits, /proc/PID/maps parsing and sandbox records: pure
formats, tested without QEMU (hypothesis for the binary ones)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from aenv_store.formats.ids import Digest
from aenv_vm.memory import memory_image as mi
from aenv_vm.memory.pagemap import PAGE, PagemapError, parse_maps, private_mask, runs
from aenv_vm.sandboxes.records import RecordStore, SandboxRecord, SandboxState, SnapshotRef

BASE = Digest(bytes(range(32)))


def delta_of(pages: list[int], mem_pages: int = 64) -> mi.Delta:
    idx = np.array(sorted(set(pages)), dtype=np.int64)
    data = bytearray(os.urandom(len(idx) * PAGE))
    return mi.Delta(BASE, mem_pages * PAGE, idx, mi.page_hashes(data), memoryview(data))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 63), max_size=40))
def test_delta_roundtrip(tmp_path_factory: pytest.TempPathFactory, pages: list[int]) -> None:
    path = tmp_path_factory.mktemp("d") / "memory.delta"
    d = delta_of(pages)
    mi.write_delta(path, d, sync=False)
    back = mi.read_delta(path)
    assert back.base == BASE and back.memory_size == d.memory_size
    assert np.array_equal(back.pages, d.pages) and np.array_equal(back.hashes, d.hashes)
    assert bytes(back.data) == bytes(d.data)
    assert (mi.page_hashes(back.data) == back.hashes).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 63), min_size=1, max_size=10), st.data())
def test_corrupt_delta_is_rejected_or_detected(tmp_path_factory: pytest.TempPathFactory, pages: list[int],
                                               data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("d") / "memory.delta"
    d = delta_of(pages)
    mi.write_delta(path, d, sync=False)
    raw = bytearray(path.read_bytes())
    flipped = None
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]           # truncated
    else:
        flipped = data.draw(st.integers(0, len(raw) - 1))              # one byte changed anywhere
        raw[flipped] ^= data.draw(st.integers(1, 255))
    path.write_bytes(bytes(raw))
    try:
        back = mi.read_delta(path)
    except mi.MemoryImageError:
        return
    n = len(d.pages)
    in_padding = flipped is not None and 64 + 16 * n <= flipped < mi._data_offset(n)
    # what the header checks cannot reject is visible as a changed field (the caller compares
    # the base with its template's) or as pages that no longer match their xxh3 (the commit checks)
    assert in_padding or back.base != d.base or back.memory_size != d.memory_size \
        or not np.array_equal(back.pages, d.pages) or not (mi.page_hashes(back.data) == back.hashes).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 63), max_size=40), st.lists(st.integers(0, 63), max_size=40), st.data())
def test_incremental_delta_roundtrip(tmp_path_factory: pytest.TempPathFactory, before: list[int],
                                     after: list[int], data: st.DataObject) -> None:
    """A version-2 delta over its parent reads back as the whole flattened delta, and
    holds only the pages that are new or changed."""
    root = tmp_path_factory.mktemp("paused")
    (root / "1").mkdir()
    (root / "2").mkdir()
    parent = delta_of(before)
    mi.write_delta(root / "1" / "memory.delta", parent, sync=False)
    # the next pause: some of the parent's pages unchanged, some rewritten, some new
    pages = np.array(sorted(set(after) | set(data.draw(st.lists(st.sampled_from(before), max_size=40))
                                               if before else [])), dtype=np.int64)
    keep = set(data.draw(st.lists(st.sampled_from(pages.tolist()), max_size=40)) if len(pages) else [])
    buf = bytearray(os.urandom(len(pages) * PAGE))
    for i, p in enumerate(pages.tolist()):
        j = np.searchsorted(parent.pages, p)
        if p in keep and j < len(parent.pages) and parent.pages[j] == p:
            buf[i * PAGE:(i + 1) * PAGE] = parent.data[j * PAGE:(j + 1) * PAGE]
    d = mi.Delta(BASE, parent.memory_size, pages, mi.page_hashes(buf), memoryview(buf))
    index = mi.read_index(root / "1" / "memory.delta")
    assert index is not None
    written = mi.write_incremental(root / "2" / "memory.delta", d, index, 1)
    unchanged = sum(1 for p in pages.tolist() if p in keep and p in set(parent.pages.tolist()))
    assert written == len(pages) - unchanged
    assert mi.is_incremental(root / "2" / "memory.delta") == (unchanged > 0)
    back = mi.read_delta(root / "2" / "memory.delta")
    assert np.array_equal(back.pages, d.pages) and np.array_equal(back.hashes, d.hashes)
    assert bytes(back.data) == bytes(d.data)
    if unchanged:
        assert mi.parent_seq(root / "2" / "memory.delta") == 1
        # consolidation (what the pause's commit does) makes it self-contained
        mi.write_delta(root / "2" / "memory.delta", back, sync=False)
        (root / "1" / "memory.delta").unlink()
        assert bytes(mi.read_delta(root / "2" / "memory.delta").data) == bytes(d.data)


def test_incremental_delta_needs_its_version1_parent(tmp_path: Path) -> None:
    for s in ("1", "2", "3"):
        (tmp_path / s).mkdir()
    parent = delta_of([1, 2, 3, 9])
    mi.write_delta(tmp_path / "1" / "memory.delta", parent, sync=False)
    buf = bytearray(parent.data)
    buf[:PAGE] = os.urandom(PAGE)                            # page 1 changed, the rest not
    d = mi.Delta(BASE, parent.memory_size, parent.pages, mi.page_hashes(buf), memoryview(buf))
    assert mi.write_incremental(tmp_path / "2" / "memory.delta", d, mi.read_index(tmp_path / "1" / "memory.delta"),
                                1) == 1
    # a version-2 file is never a parent (that would be a chain)
    assert mi.read_index(tmp_path / "2" / "memory.delta") is None
    (tmp_path / "3" / "memory.delta").write_bytes((tmp_path / "2" / "memory.delta").read_bytes())
    os.replace(tmp_path / "2" / "memory.delta", tmp_path / "1" / "memory.delta")
    with pytest.raises(mi.MemoryImageError, match="cannot read|itself incremental"):
        mi.read_delta(tmp_path / "3" / "memory.delta")      # its parent ../1 is now itself incremental
    (tmp_path / "1" / "memory.delta").unlink()
    with pytest.raises(mi.MemoryImageError, match="cannot read"):
        mi.read_delta(tmp_path / "3" / "memory.delta")      # parent gone
    other = mi.DeltaIndex(Digest(bytes(32)), parent.pages, parent.hashes)
    with pytest.raises(mi.MemoryImageError, match="another base"):
        mi.write_incremental(tmp_path / "2" / "memory.delta", d, other, 1)


def test_bad_delta_files(tmp_path: Path) -> None:
    with pytest.raises(mi.MemoryImageError, match="cannot read"):
        mi.read_delta(tmp_path / "missing")
    (tmp_path / "junk").write_bytes(b"NOTADELTA" * 20)
    with pytest.raises(mi.MemoryImageError, match="not a version-1 memory delta"):
        mi.read_delta(tmp_path / "junk")


def test_pagemap_bits_and_runs() -> None:
    present, swapped, filepage = 1 << 63, 1 << 62, 1 << 61
    entries = np.array([0, present, present | filepage, swapped, present | 5, filepage], dtype=np.uint64)
    assert private_mask(entries).tolist() == [False, True, False, True, True, False]
    first, length, at = runs(np.array([3, 4, 5, 9, 11, 12], dtype=np.int64))
    assert first.tolist() == [3, 9, 11] and length.tolist() == [3, 1, 2] and at.tolist() == [0, 3, 4]
    assert [len(x) for x in runs(np.zeros(0, dtype=np.int64))] == [0, 0, 0]


def test_parse_maps() -> None:
    text = ("55d0-55e0 r-xp 00000000 fd:01 123 /usr/bin/qemu-system-x86_64\n"
            "7f0000000000-7f0010000000 rw-p 00000000 fd:01 77 /run/aenv/templates/tpl-1/memory\n"
            "7f1000000000-7f1000001000 rw-p 00000000 00:00 0 \n")
    m = parse_maps(text, "/run/aenv/templates/tpl-1/memory")
    assert (m.start, m.end, m.file_offset, m.pages) == (0x7f0000000000, 0x7f0010000000, 0, 0x10000)
    with pytest.raises(PagemapError, match="not mapped"):
        parse_maps(text, "/elsewhere")


def test_records_survive_reopen(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "records")
    rec = SandboxRecord(id="sbx-1", template="tpl-a", state=SandboxState.RUNNING, started_at=1.0, end_at=2.0,
                        metadata={"k": "v"}, access_token="t",
                        snapshot=SnapshotRef(seq=3, local="/x/3", base="ab" * 32, disk_top=None, committed=True))
    store.put(rec)
    store.put(rec.replace(id="sbx-2", state=SandboxState.PAUSED))
    store.close()
    again = RecordStore(tmp_path / "records")
    assert again.get("sbx-1") == rec
    assert [r.id for r in again.all()] == ["sbx-1", "sbx-2"] and again.get("sbx-2").state == SandboxState.PAUSED
    again.delete("sbx-1")
    assert again.get("sbx-1") is None
    again.close()


def test_delta_written_over_a_spare_file(tmp_path: Path) -> None:
    """A pause overwrites its sandbox's spare (an old, larger delta) in place: the result
    is exactly the new delta, the spare is consumed, nothing of the old one remains."""
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    spare = tmp_path / "spare"
    old = delta_of(list(range(0, 60)))
    mi.write_delta(spare, old, sync=False)
    parent = delta_of([1, 2, 3])
    mi.write_delta(tmp_path / "1" / "memory.delta", parent, sync=False)
    new = delta_of([2, 5])
    mi.write_delta(tmp_path / "2" / "memory.delta", new, sync=False, spare=spare)
    assert not spare.exists()
    back = mi.read_delta(tmp_path / "2" / "memory.delta")
    assert bytes(back.data) == bytes(new.data) and np.array_equal(back.pages, new.pages)
    mi.write_delta(spare, old, sync=False)
    buf = bytearray(parent.data)
    buf[PAGE:2 * PAGE] = os.urandom(PAGE)                    # page 2 changed, 1 and 3 not
    d = mi.Delta(BASE, parent.memory_size, parent.pages, mi.page_hashes(buf), memoryview(buf))
    index = mi.read_index(tmp_path / "1" / "memory.delta")
    assert index is not None
    assert mi.write_incremental(tmp_path / "2" / "memory.delta", d, index, 1, spare=spare) == 1
    assert not spare.exists()
    assert bytes(mi.read_delta(tmp_path / "2" / "memory.delta").data) == bytes(buf)
    # no spare: a new file, as before
    assert mi.write_incremental(tmp_path / "2" / "memory.delta", d, index, 1, spare=spare) == 1


def _mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_a_file_mapped_delta_is_written_window_by_window_and_released(tmp_path: Path) -> None:
    """A resume writes a delta into the new guest's memory in windows of at most 8 MiB
    and drops each window of the delta's file mapping from its RSS once written: the
    reader ends holding none of a 24 MiB delta, and every page landed where it belongs
    (written here into this process's own private mapping of a memory file)."""
    from aenv_vm.memory.pagemap import ram_mapping, write_pages

    import mmap
    mem_pages = 16384                       # 64 MiB
    memory = tmp_path / "memory"
    with open(memory, "wb") as f:
        f.truncate(mem_pages * PAGE)
    pages = list(range(0, mem_pages, 3))[:6144]   # 24 MiB in runs of one page
    path = tmp_path / "memory.delta"
    mi.write_delta(path, delta_of(pages, mem_pages), sync=False)
    delta = mi.read_delta(path)
    assert delta.mapped is not None
    assert mi.hashes_match(delta)                         # the commit's check, window by window
    assert _mapped_rss(path) < 1 << 20, _mapped_rss(path)
    assert (mi.page_hashes(delta.data) == delta.hashes).all()
    assert _mapped_rss(path) >= 20 << 20                  # read whole: resident

    with open(memory, "r+b") as f:
        guest = mmap.mmap(f.fileno(), mem_pages * PAGE, flags=mmap.MAP_PRIVATE)
    windows: list[tuple[int, int]] = []

    def written(first: int, end: int) -> None:
        windows.append((first, end))
        delta.release(first, end)
    try:
        write_pages(os.getpid(), ram_mapping(os.getpid(), memory), delta.pages, delta.data, written)
        assert windows[0][0] == 0 and windows[-1][1] == len(pages)
        assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
        assert all(0 < (end - first) * PAGE <= 8 << 20 + PAGE for first, end in windows), windows
        assert _mapped_rss(path) < 1 << 20, _mapped_rss(path)
        for k in (0, 1, 4000, len(pages) - 1):
            p = pages[k]
            assert guest[p * PAGE:(p + 1) * PAGE] == bytes(delta.data[k * PAGE:(k + 1) * PAGE])
        assert guest[PAGE:2 * PAGE] == bytes(PAGE)   # a page not in the delta: untouched
    finally:
        guest.close()
    with open(path, "r+b") as f:                      # a torn page in the last window
        f.seek(os.path.getsize(path) - 100)
        f.write(b"torn")
    assert not mi.hashes_match(mi.read_delta(path))
