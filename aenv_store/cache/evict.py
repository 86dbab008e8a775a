"""Eviction policy of the node cache: LRU between the high and low watermarks plus
a free-disk floor, never touching pinned entries; and the two-step removal
(index first, files after the commit) that the ``dying`` table keeps race-free."""
from __future__ import annotations

import os
from pathlib import Path

import lmdb

from ..config import CacheConfig
from .files import ChunkFiles, unlink_all
from .index import ENTRY, USED, IndexDbs


def disk_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def make_room(txn: lmdb.Transaction, db: IndexDbs, files: ChunkFiles, cfg: CacheConfig, path: Path,
              incoming: int, evicted: list[bytes]) -> bool:
    """Evict (inside ``txn``) per the watermarks and the free-disk floor so ``incoming``
    more bytes fit; False if they still would not (e.g. everything left is pinned).
    Appends the victims to ``evicted``: pass them to finish_evictions after the commit."""
    used = db.get_u64(txn, USED)
    free = disk_free(path)
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
        freed = evict(txn, db, files, int(used - target), evicted)
    return used - freed + incoming <= cfg.capacity and free + freed - incoming >= cfg.min_free_disk


def evict(txn: lmdb.Transaction, db: IndexDbs, files: ChunkFiles, need: int, evicted: list[bytes]) -> int:
    """Remove least-recently-used unpinned entries worth ``need`` bytes from the index and
    mark them ``dying``: until their files are unlinked no put may create a file there."""
    sweep_dead_evictions(txn, db, files)
    victims: list[bytes] = []
    freed = 0
    for digest in db.lru_order(txn):
        if freed >= need:
            break
        if db.pin_count(txn, digest):  # pinned entries are not listed; stay safe anyway
            continue
        raw = txn.get(digest, db=db.entries)
        if raw is None:
            continue
        victims.append(digest)
        freed += ENTRY.unpack(raw)[0]
    pid = os.getpid()
    for digest in victims:  # not while the cursor walks the lru table
        db.remove(txn, digest)
        db.mark_dying(txn, digest, pid)
        evicted.append(digest)
    if victims:
        db.add_u64(txn, b"evictions", len(victims))
        db.add_u64(txn, b"evicted_bytes", freed)
    return freed


def finish_evictions(env: lmdb.Environment, db: IndexDbs, files: ChunkFiles, victims: list[bytes]) -> None:
    """After the commit that removed their entries: unlink the files (without holding
    LMDB's writer lock), then lift the ``dying`` marks so the chunks may be cached again."""
    if not victims:
        return
    unlink_all(files.path(d) for d in victims)
    with env.begin(write=True) as txn:
        for digest in victims:
            db.clear_dying(txn, digest)


def sweep_dead_evictions(txn: lmdb.Transaction, db: IndexDbs, files: ChunkFiles) -> None:
    """Finish evictions whose process died between its commit and its unlinks."""
    me = os.getpid()
    for digest, pid in list(db.iter_dying(txn)):
        if pid != me and not _alive(pid):
            unlink_all([files.path(digest)])
            db.clear_dying(txn, digest)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
