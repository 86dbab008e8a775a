"""The node cache's LMDB index (format in docs/cache.md).

Five named databases in one LMDB environment:

``entries``  digest (32 B) -> ENTRY (size u64, xxh3-64 of the data u64, last access ns i64,
             segment id u64, offset in the segment u64)
``lru``      last access ns (u64 big-endian) + digest -> b""   (cursor order = least recent first);
             holds exactly the entries that are NOT pinned, so eviction never walks past pins
``pins``     digest -> how many NodeCache instances pin it, u32 (a digest may be pinned before it is cached)
``members``  segment id (u64 big-endian) + digest -> b"": the entries each segment file holds
             (a segment is unlinked when its last member goes)
``meta``     format marker, byte/entry totals, lifetime counters, clean flag, boot id

Every function here works inside a transaction the caller owns, so a put, an
eviction batch or a flush of LRU touches is one atomic step for every process
sharing the directory (LMDB serialises writers with a process-shared lock).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

import lmdb

FORMAT = b"aenv-node-cache/2"

ENTRY = struct.Struct("<QQqQQ")
SEGMENT = struct.Struct(">Q")
LRU_TIME = struct.Struct(">Q")
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")

# meta keys holding u64 values
USED = b"used"
ENTRIES = b"entries"
COUNTERS = ("hits", "misses", "fetches", "evictions", "evicted_bytes", "corrupt")


@dataclass(frozen=True)
class Entry:
    size: int
    checksum: int      # xxh3-64 of the data: catches a torn/overwritten file cheaply (~1 µs / 64 KiB)
    last_access: int   # time.time_ns() of the last recorded access
    segment: int = 0   # id of the segment file holding the bytes (cache/segments.py)
    offset: int = 0    # where in it (page aligned)

    def pack(self) -> bytes:
        return ENTRY.pack(self.size, self.checksum, self.last_access, self.segment, self.offset)


class IndexDbs:
    """Handles of the five databases; opened once per environment."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        self.entries = env.open_db(b"entries")
        self.lru = env.open_db(b"lru")
        self.pins = env.open_db(b"pins")
        self.members = env.open_db(b"members")
        self.meta = env.open_db(b"meta")

    # -- entries ---------------------------------------------------------------------------

    def get(self, txn: lmdb.Transaction, digest: bytes) -> Entry | None:
        raw = txn.get(digest, db=self.entries)
        return None if raw is None else Entry(*ENTRY.unpack(raw))

    def add(self, txn: lmdb.Transaction, digest: bytes, entry: Entry) -> None:
        """Insert a new entry (caller checked it is absent) and account its bytes."""
        self.add_uncounted(txn, digest, entry)
        self.count_added(txn, entry.size, 1)

    def add_uncounted(self, txn: lmdb.Transaction, digest: bytes, entry: Entry, pins: bool = True) -> None:
        """Insert a new entry without accounting it: the caller adds a batch's totals with
        one ``count_added`` (two fewer reads and writes per chunk of a fill). ``pins``:
        whether any digest may be pinned (False skips the pin lookup)."""
        txn.put(digest, entry.pack(), db=self.entries)
        txn.put(SEGMENT.pack(entry.segment) + digest, b"", db=self.members)
        if not pins or not self.pin_count(txn, digest):
            txn.put(LRU_TIME.pack(entry.last_access) + digest, b"", db=self.lru)

    def count_added(self, txn: lmdb.Transaction, size: int, entries: int) -> None:
        self.add_u64(txn, USED, size)
        self.add_u64(txn, ENTRIES, entries)

    def any_pins(self, txn: lmdb.Transaction) -> bool:
        return txn.stat(self.pins)["entries"] > 0

    def remove(self, txn: lmdb.Transaction, digest: bytes) -> Entry | None:
        """Delete an entry; the caller unlinks its segment if ``segment_empty`` afterwards."""
        entry = self.get(txn, digest)
        if entry is None:
            return None
        txn.delete(digest, db=self.entries)
        txn.delete(SEGMENT.pack(entry.segment) + digest, db=self.members)
        txn.delete(LRU_TIME.pack(entry.last_access) + digest, db=self.lru)
        self.add_u64(txn, USED, -entry.size)
        self.add_u64(txn, ENTRIES, -1)
        return entry

    def touch(self, txn: lmdb.Transaction, digest: bytes, when: int) -> bool:
        """Record an access at ``when``; older timestamps never move an entry back."""
        entry = self.get(txn, digest)
        if entry is None or when <= entry.last_access:
            return False
        if txn.delete(LRU_TIME.pack(entry.last_access) + digest, db=self.lru):  # absent while pinned
            txn.put(LRU_TIME.pack(when) + digest, b"", db=self.lru)
        txn.put(digest, Entry(entry.size, entry.checksum, when, entry.segment, entry.offset).pack(),
                db=self.entries)
        return True

    def lru_order(self, txn: lmdb.Transaction) -> Iterator[bytes]:
        """Unpinned digests from least to most recently used."""
        cursor = txn.cursor(db=self.lru)
        if not cursor.first():
            return
        for key in cursor.iternext(keys=True, values=False):
            yield bytes(key[LRU_TIME.size:])

    def iter_entries(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, Entry]]:
        cursor = txn.cursor(db=self.entries)
        for key, raw in cursor.iternext(keys=True, values=True):
            yield bytes(key), Entry(*ENTRY.unpack(raw))

    # -- pins ------------------------------------------------------------------------------

    def pin_count(self, txn: lmdb.Transaction, digest: bytes) -> int:
        raw = txn.get(digest, db=self.pins)
        return 0 if raw is None else U32.unpack(raw)[0]

    def add_pin(self, txn: lmdb.Transaction, digest: bytes, delta: int) -> int:
        before = self.pin_count(txn, digest)
        count = max(0, before + delta)
        if count:
            txn.put(digest, U32.pack(count), db=self.pins)
        else:
            txn.delete(digest, db=self.pins)
        if bool(before) != bool(count):
            self._set_evictable(txn, digest, evictable=not count)
        return count

    def _set_evictable(self, txn: lmdb.Transaction, digest: bytes, evictable: bool) -> None:
        entry = self.get(txn, digest)
        if entry is None:
            return
        key = LRU_TIME.pack(entry.last_access) + digest
        if evictable:
            txn.put(key, b"", db=self.lru)
        else:
            txn.delete(key, db=self.lru)

    def iter_pins(self, txn: lmdb.Transaction) -> Iterator[bytes]:
        cursor = txn.cursor(db=self.pins)
        for key in cursor.iternext(keys=True, values=False):
            yield bytes(key)

    def clear_pins(self, txn: lmdb.Transaction) -> None:
        for digest in list(self.iter_pins(txn)):
            self._set_evictable(txn, digest, evictable=True)
        txn.drop(self.pins, delete=False)

    def lru_problems(self, txn: lmdb.Transaction) -> list[str]:
        """Check the lru table holds exactly the unpinned entries, at their access times."""
        problems = []
        listed = 0
        for key in txn.cursor(db=self.lru).iternext(keys=True, values=False):
            listed += 1
            when, digest = LRU_TIME.unpack(key[:LRU_TIME.size])[0], bytes(key[LRU_TIME.size:])
            entry = self.get(txn, digest)
            if entry is None or entry.last_access != when or self.pin_count(txn, digest):
                problems.append(f"lru key {digest.hex()}@{when}: no such unpinned entry at that time")
        unpinned = sum(1 for digest, _ in self.iter_entries(txn) if not self.pin_count(txn, digest))
        if listed != unpinned:
            problems.append(f"lru lists {listed} entries, {unpinned} entries are unpinned")
        return problems

    # -- segments --------------------------------------------------------------------------

    def segment_members(self, txn: lmdb.Transaction, segment: int) -> list[bytes]:
        """Digests of the entries held by ``segment``."""
        prefix = SEGMENT.pack(segment)
        cursor = txn.cursor(db=self.members)
        out: list[bytes] = []
        if not cursor.set_range(prefix):
            return out
        for key in cursor.iternext(keys=True, values=False):
            if bytes(key[:SEGMENT.size]) != prefix:
                break
            out.append(bytes(key[SEGMENT.size:]))
        return out

    def segment_empty(self, txn: lmdb.Transaction, segment: int) -> bool:
        prefix = SEGMENT.pack(segment)
        cursor = txn.cursor(db=self.members)
        return not cursor.set_range(prefix) or bytes(cursor.key()[:SEGMENT.size]) != prefix

    def iter_members(self, txn: lmdb.Transaction) -> Iterator[tuple[int, bytes]]:
        for key in txn.cursor(db=self.members).iternext(keys=True, values=False):
            yield SEGMENT.unpack(key[:SEGMENT.size])[0], bytes(key[SEGMENT.size:])

    # -- meta ------------------------------------------------------------------------------

    def get_u64(self, txn: lmdb.Transaction, key: bytes) -> int:
        raw = txn.get(key, db=self.meta)
        return 0 if raw is None else U64.unpack(raw)[0]

    def set_u64(self, txn: lmdb.Transaction, key: bytes, value: int) -> None:
        txn.put(key, U64.pack(max(0, value)), db=self.meta)

    def add_u64(self, txn: lmdb.Transaction, key: bytes, delta: int) -> None:
        if delta:
            self.set_u64(txn, key, self.get_u64(txn, key) + delta)

    def get_meta(self, txn: lmdb.Transaction, key: bytes) -> bytes | None:
        raw = txn.get(key, db=self.meta)
        return None if raw is None else bytes(raw)

    def set_meta(self, txn: lmdb.Transaction, key: bytes, value: bytes) -> None:
        txn.put(key, value, db=self.meta)
