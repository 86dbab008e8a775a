"""Storing chunks in the node cache: one segment file per batch, one LMDB write
transaction that indexes its chunks (and evicts to make room).

Order makes a crash harmless: the segment is written in full under a fresh
random name before the transaction that names it commits, so an entry never
points at bytes that were not written; a crash before the commit leaves an
orphan file that no entry names (deleted by the next first user's reconcile).
Nothing is fsynced (a cache may lose entries when the host goes down; the first
user then starts empty), and reads check every chunk's xxh3 against its entry,
so torn or altered bytes are never served."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import lmdb
import xxhash

from ..config import CacheConfig
from ..formats.ids import Digest
from . import evict as cache_evict
from .files import SegmentFiles, unlink_all
from .index import Entry, IndexDbs
from .segments import SegmentWriter
from .touches import Pending

log = logging.getLogger(__name__)

# bytes of chunks per segment file: a fill of a 16 MiB read is one file; a bigger
# put_many is split (a segment is built in one buffer and evicted as a whole)
SEGMENT_MAX = 16 << 20


@dataclass(frozen=True)
class Location:
    """Where a stored chunk's bytes are: its segment file, offset and size."""

    path: str
    offset: int
    size: int


def new_segment_id() -> int:
    # random and never reused: no two writers (processes, threads) ever touch one file,
    # and an eviction unlinking a segment cannot race with a put writing it
    while True:
        segment = int.from_bytes(os.urandom(8), "little")
        if segment:
            return segment


# the instance's current (environment, dbs): the first user may reopen the environment
EnvOf = Callable[[], tuple[lmdb.Environment, IndexDbs]]


class Filler:
    """The write side of one NodeCache instance."""

    def __init__(self, env_of: EnvOf, files: SegmentFiles, config: CacheConfig, path: Path,
                 pending: Pending) -> None:
        self._env_of = env_of
        self.files = files
        self.config = config
        self.path = path
        self.pending = pending
        self.writer = SegmentWriter()

    def insert(self, items: Sequence[tuple[Digest, bytes]], direct: bool) -> list[Location | None]:
        """Store the items in new segments (one per SEGMENT_MAX bytes, usually one) and one
        write transaction; the Location of each stored item (also of one already cached
        under its digest by a racing writer), else None.
        ``direct``: write past the page cache (the caller does not map them next)."""
        env, db = self._env_of()
        out: list[Location | None] = [None] * len(items)
        todo = [(i, d, data, xxhash.xxh3_64_intdigest(data))
                for i, (d, data) in enumerate(items) if len(data) <= self.config.capacity]
        written: list[tuple[int, list[tuple[int, Digest, bytes, int]], list[int]]] = []
        try:
            for group in _groups(todo):
                segment = new_segment_id()
                written.append((segment, group, []))
                written[-1][2].extend(self.writer.write(self.files.path(segment),
                                                        [(d, data, c) for _, d, data, c in group], direct))
        except OSError as e:
            unlink_all([self.files.path(segment) for segment, _, _ in written])
            log.warning("node cache %s: cannot write %d chunk(s): %s", self.path, len(todo), e)
            return out
        if not written:
            return out
        touches, deltas = self.pending.take()
        evicted: list[int] = []
        empty: list[int] = []
        try:
            with env.begin(write=True) as txn:
                self.pending.apply(txn, db, touches, deltas)  # our recent hits count before we evict
                room = cache_evict.Room(self.path)
                now = time.time_ns()
                pins = db.any_pins(txn)
                for segment, group, offsets in written:
                    seg_path = self.files.path(segment)
                    fresh: list[tuple[int, Digest, bytes, int, int]] = []
                    first: dict[Digest, int] = {}          # digest -> its first item in this group
                    again: list[tuple[int, int]] = []      # (item, its first item): a digest twice
                    for (i, digest, data, checksum), offset in zip(group, offsets):
                        if digest in first:
                            again.append((i, first[digest]))
                            continue
                        first[digest] = i
                        existing = db.get(txn, digest)
                        if existing is not None:
                            where = self.files.path(existing.segment)
                            if os.path.exists(where):  # raced with another writer (or a duplicate in items)
                                out[i] = Location(where, existing.offset, existing.size)
                                continue
                            db.remove(txn, digest)  # its segment vanished: replace the entry
                            if db.segment_empty(txn, existing.segment):
                                evicted.append(existing.segment)
                        fresh.append((i, digest, data, checksum, offset))
                    added = self._index(txn, db, room, fresh, segment, seg_path, now, pins, evicted, out)
                    for i, j in again:
                        out[i] = out[j]
                    if not added:
                        empty.append(segment)
        except (lmdb.Error, OSError) as e:
            self.pending.restore(touches, deltas)
            # nothing names them: the transaction did not commit
            unlink_all([self.files.path(segment) for segment, _, _ in written])
            log.warning("node cache %s: cannot store %d chunk(s): %s", self.path, len(todo), e)
            return [None] * len(items)
        cache_evict.finish_evictions(self.files, evicted + empty)
        return out

    def _index(self, txn: lmdb.Transaction, db: IndexDbs, room: cache_evict.Room,
               fresh: list[tuple[int, Digest, bytes, int, int]], segment: int, seg_path: str, now: int,
               pins: bool, evicted: list[int], out: list[Location | None]) -> int:
        """Index a segment's new chunks: room for all of them at once (the usual case: one
        eviction check and one update of the totals per segment), else chunk by chunk
        while they fit. Returns how many were indexed."""
        total = sum(len(data) for _, _, data, _, _ in fresh)
        if fresh and cache_evict.make_room(txn, db, self.config, room, total, evicted, segment):
            for i, digest, data, checksum, offset in fresh:
                db.add_uncounted(txn, digest, Entry(len(data), checksum, now, segment, offset), pins)
                out[i] = Location(seg_path, offset, len(data))
            db.count_added(txn, total, len(fresh))
            return len(fresh)
        added = 0
        for i, digest, data, checksum, offset in fresh:
            if cache_evict.make_room(txn, db, self.config, room, len(data), evicted, segment):
                db.add(txn, digest, Entry(len(data), checksum, now, segment, offset))
                out[i] = Location(seg_path, offset, len(data))
                added += 1
        return added


def _groups(todo: list[tuple[int, Digest, bytes, int]]) -> list[list[tuple[int, Digest, bytes, int]]]:
    """The items split into segments of at most SEGMENT_MAX bytes (a larger item alone)."""
    groups: list[list[tuple[int, Digest, bytes, int]]] = []
    size = 0
    for item in todo:
        if not groups or (size + len(item[2]) > SEGMENT_MAX and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += len(item[2])
    return groups
