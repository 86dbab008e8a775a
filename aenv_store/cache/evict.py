"""Eviction policy of the node cache: LRU between the high and low watermarks plus
a free-disk floor, never touching pinned entries. A segment file (one fill) is
evicted as a whole: its chunks were fetched together and are read together, and
its bytes can only be freed together (its unpinned members go with the least
recently used one; a segment with pinned members stays until those go too)."""
from __future__ import annotations

import os
from pathlib import Path

import lmdb

from ..config import CacheConfig
from .files import SegmentFiles, unlink_all
from .index import USED, IndexDbs


def disk_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Room:
    """The free-disk figure of one write transaction: statvfs once per put batch, then
    kept up to date with what the batch adds and evicts."""

    def __init__(self, path: Path) -> None:
        self.free = disk_free(path)


def make_room(txn: lmdb.Transaction, db: IndexDbs, cfg: CacheConfig, room: Room,
              incoming: int, evicted: list[int], filling: int = 0) -> bool:
    """Evict (inside ``txn``) per the watermarks and the free-disk floor so ``incoming``
    more bytes fit; False if they still would not (e.g. everything left is pinned).
    Appends the segments left without members to ``evicted``: unlink them (finish_evictions)
    after the commit. On True the caller adds the bytes; ``room`` already counts them.
    ``filling``: the segment being indexed, never a victim (it would evict its own batch)."""
    used = db.get_u64(txn, USED)
    free = room.free
    target: float | None = None
    if used + incoming > cfg.high_watermark * cfg.capacity:
        target = cfg.low_watermark * cfg.capacity - incoming
    deficit = cfg.min_free_disk - (free - incoming)
    if deficit > 0:
        # below the floor: free the deficit plus the watermark band, so we do not evict on every put
        below = used - deficit - (cfg.high_watermark - cfg.low_watermark) * cfg.capacity
        target = below if target is None else min(target, below)
    freed = 0
    if target is not None and used > target:
        freed = evict(txn, db, int(used - target), evicted, filling)
    ok = used - freed + incoming <= cfg.capacity and free + freed - incoming >= cfg.min_free_disk
    room.free = free + freed - (incoming if ok else 0)
    return ok


def evict(txn: lmdb.Transaction, db: IndexDbs, need: int, evicted: list[int], filling: int = 0) -> int:
    """Remove least-recently-used unpinned entries worth at least ``need`` bytes from the
    index, with the other unpinned members of their segments. Returns the bytes freed."""
    victims: dict[bytes, None] = {}
    freed = 0
    for digest in db.lru_order(txn):
        if freed >= need:
            break
        if digest in victims or db.pin_count(txn, digest):  # pinned ones are not listed; stay safe
            continue
        entry = db.get(txn, digest)
        if entry is None or entry.segment == filling:
            continue
        for member in db.segment_members(txn, entry.segment):
            if member not in victims and not db.pin_count(txn, member):
                victims[member] = None
                m = db.get(txn, member)
                freed += m.size if m is not None else 0
    segments: set[int] = set()
    for digest in victims:  # not while the cursor walks the lru table
        entry = db.remove(txn, digest)
        if entry is not None:
            segments.add(entry.segment)
    evicted.extend(s for s in segments if db.segment_empty(txn, s))
    if victims:
        db.add_u64(txn, b"evictions", len(victims))
        db.add_u64(txn, b"evicted_bytes", freed)
    return freed


def finish_evictions(files: SegmentFiles, segments: list[int]) -> None:
    """After the commit that removed their last entries: unlink the segment files (without
    holding LMDB's writer lock). Segment ids are never reused, so no put can be writing
    one of these; a crash in between leaves orphans for the next first user's reconcile."""
    unlink_all(files.path(s) for s in segments)
