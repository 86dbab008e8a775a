"""The node cache: a bounded local directory of verified plaintext chunks.

Layout of a cache directory (format ``aenv-node-cache/2``; details and the
crash-safety argument in docs/cache.md)::

    index/                 LMDB environment (aenv_store.cache.index): digest -> size, checksum,
                           last access, segment and offset; LRU order; pin counts; segment
                           members; totals and counters
    data/ab/<16 hex>.seg   segment files: the chunks of one fill behind a versioned header
                           (segments.py; chunks page aligned, mapped by readers)
    inflight.lock          byte-range lock per chunk being fetched (one fetch per node)
    users.lock             every open NodeCache holds a shared flock (first/last user detection)
    gate.lock              serialises open/close so first/last detection is race-free

Write order makes a crash harmless (fill.py): a fill's segment is written in full
under a fresh name, then its chunks are indexed in one LMDB write transaction;
eviction removes index entries first and unlinks segments after the commit. So
an index entry never points at unwritten bytes; a crash can leave an orphan
segment (removed when the next first user reconciles) or an entry whose
segment is gone (read as a miss and dropped). Reads check size and xxh3 against
the index, so torn or tampered bytes are never returned.

A hit is one LMDB read transaction plus open/pread/close of its segment (~10 µs
for 64 KiB); the access time it produces is queued (touches.py).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Literal, Sequence, overload

import lmdb

from ..config import CacheConfig
from ..errors import ConfigError, StoreError
from ..formats.ids import Digest
from . import evict as cache_evict, files as cache_files
from .env import EnvRegistry, boot_id, open_env, wipe
from .files import SegmentFiles, unlink_all
from .fill import Filler, Location
from .flights import Flight, Flights
from .index import ENTRIES, ENTRY, USED, IndexDbs
from .lock import DigestLocks, FileLock
from .segments import ChunkData, Found, map_exact, read_checked
from .touches import Pending
from .writeback import WriteBehind

__all__ = ["CacheStats", "ChunkData", "FetchMany", "Location", "NodeCache", "validate_config"]

log = logging.getLogger(__name__)

OPEN_COUNT = b"open_count"
# entry fields a read needs: size, checksum, segment, offset
Where = tuple[int, int, int, int]


@dataclass(frozen=True)
class CacheStats:
    capacity: int
    used_bytes: int
    entries: int
    pinned: int            # cached entries with a pin count > 0
    hits: int              # counters are lifetime totals of every process that used this directory
    misses: int
    fetches: int
    evictions: int
    pinned_bytes: int = 0
    evicted_bytes: int = 0
    corrupt: int = 0       # entries dropped because their file no longer matched size/checksum
    high_watermark: float = 0.0
    low_watermark: float = 0.0
    min_free_disk: int = 0
    disk_free: int = 0
    path: str = ""

# Verified plaintexts of the digests asked, in that order (what get_or_fetch_many calls on misses).
FetchMany = Callable[[list[Digest]], Sequence[bytes]]


def _as_bytes(data: ChunkData) -> bytes:
    return data if type(data) is bytes else data[:]


def validate_config(config: CacheConfig) -> None:
    if config.capacity <= 0:
        raise ConfigError(f"cache.capacity must be > 0 bytes, got {config.capacity}")
    if not 0.0 < config.low_watermark <= config.high_watermark <= 1.0:
        raise ConfigError("cache.low_watermark and cache.high_watermark must satisfy "
                          f"0 < low <= high <= 1, got {config.low_watermark} and {config.high_watermark}")
    if config.min_free_disk < 0:
        raise ConfigError(f"cache.min_free_disk must be >= 0, got {config.min_free_disk}")
    if config.min_free_inodes < 0:
        raise ConfigError(f"cache.min_free_inodes must be >= 0, got {config.min_free_inodes}")


class NodeCache:
    """Bounded, LRU-evicting, pin-aware chunk cache shared by the processes of one node.

    Thread-safe. Any number of processes, and instances within a process, may share a
    directory; pins and queued LRU touches belong to the instance.
    Blocking calls: use ``loop.run_in_executor`` from asyncio code."""

    # the environments open in this process (cache/env.py); acquired after gate.lock
    _registry: ClassVar[EnvRegistry] = EnvRegistry()
    # bumped in a forked child: LMDB handles must not be used after fork(), so
    # instances inherited from the parent refuse to work instead of corrupting it
    _fork_generation: ClassVar[int] = 0

    @classmethod
    def _forked(cls) -> None:
        cls._fork_generation += 1
        cls._registry = EnvRegistry()

    def __init__(self, path: Path, config: CacheConfig) -> None:
        validate_config(config)
        self.path = Path(path).absolute()
        self.config = config
        self._files = SegmentFiles(str(self.path / "data"))
        self._lock = threading.Lock()   # own pins
        self._pending = Pending()
        self._filler = Filler(lambda: (self._env, self._db), self._files, config, self.path, self._pending)
        self._writes = WriteBehind(lambda items: self._filler.insert(items, direct=True), self.path.name)
        self._flights: Flights[Digest] = Flights()
        self._my_pins: Counter[bytes] = Counter()
        # digests this instance looked up in the index (diagnostics: a read consults it
        # once per chunk; updated without a lock, so approximate under concurrency)
        self.lookups = 0
        self._closed = True
        self._generation = NodeCache._fork_generation
        self._open()
        self._closed = False

    # -- opening and closing ---------------------------------------------------------------

    def _open(self) -> None:
        try:
            for d in (self.path, self.path / "data"):
                d.mkdir(parents=True, exist_ok=True)
            gate = FileLock(self.path / "gate.lock")
        except OSError as e:
            raise StoreError(f"cannot create node cache at {self.path}: {e}") from None
        try:
            gate.exclusive()
            self._users = FileLock(self.path / "users.lock")
            try:
                # no other user in any process (instances of this process hold the lock too)
                first = self._users.exclusive(blocking=False)
                self._shared = NodeCache._registry.acquire(self.path, wipe_if_bad=first)
                try:
                    if first:
                        self._first_open()
                    with self._env.begin(write=True) as txn:
                        # users that have not closed cleanly; a crashed one keeps this above zero
                        self._db.add_u64(txn, OPEN_COUNT, 1)
                    self._users.shared()  # EX -> SH while the gate keeps others out
                except BaseException:
                    NodeCache._registry.release(self.path, self._shared)
                    raise
            except BaseException:
                self._users.close()
                raise
        finally:
            gate.close()
        self._digest_locks = DigestLocks(self.path / "inflight.lock")
        self._files.make_shards()

    @property
    def _env(self) -> lmdb.Environment:
        return self._shared.env

    @property
    def _db(self) -> IndexDbs:
        return self._shared.dbs

    def _first_open(self) -> None:
        """No other process has the directory open: reconcile after a crash, drop stale pins."""
        boot = boot_id()
        with self._env.begin() as txn:
            clean = self._db.get_meta(txn, b"clean") == b"1"
            last_boot = self._db.get_meta(txn, b"boot_id")
        if not clean and last_boot is not None and last_boot != boot:
            # The host went down with the cache open. LMDB runs without fsync and chunk
            # files are not fsynced (speed), so neither can be trusted now; refilling is cheap.
            log.warning("node cache %s: host restarted without a clean close; starting empty", self.path)
            self._env.close()  # first user: nobody else shares this environment
            wipe(self.path)
            self._shared.env, self._shared.dbs = open_env(self.path, wipe_if_bad=False)
        elif not clean:
            self._reconcile()
        evicted: list[int] = []
        with self._env.begin(write=True) as txn:
            self._db.clear_pins(txn)  # pins belong to live users; there are none
            self._db.set_meta(txn, b"clean", b"0")
            self._db.set_u64(txn, OPEN_COUNT, 0)
            self._db.set_meta(txn, b"boot_id", boot)
            # the capacity may have been lowered
            cache_evict.make_room(txn, self._db, self.config, cache_evict.Room(self.path), 0, evicted)
        cache_evict.finish_evictions(self._files, evicted)
        self._env.sync(True)

    def _reconcile(self) -> None:
        dropped, orphans = cache_files.reconcile(self._env, self._db, self._files)
        if dropped or orphans:
            log.warning("node cache %s: reconciled after a crash: %d stale entries, %d orphan files removed",
                        self.path, dropped, orphans)

    def close(self) -> None:
        """Flush counters and LRU times, release this instance's pins; the last user marks the
        directory clean (so the next first user skips reconciliation)."""
        if self._closed:
            return
        if self._generation != NodeCache._fork_generation:
            self._closed = True  # inherited across fork(): the parent still owns it
            return
        self._writes.close()
        self._flush()
        self._closed = True
        with self._lock:
            mine, self._my_pins = self._my_pins, Counter()
        gate = FileLock(self.path / "gate.lock")
        try:
            gate.exclusive()
            with self._env.begin(write=True) as txn:
                for digest in mine:
                    self._db.add_pin(txn, digest, -1)
                self._db.add_u64(txn, OPEN_COUNT, -1)
                # Clean only if we are the last user and every other user closed properly:
                # a user that crashed may have left orphan files or stale entries.
                if self._users.exclusive(blocking=False) and self._db.get_u64(txn, OPEN_COUNT) == 0:
                    self._db.set_meta(txn, b"clean", b"1")
        finally:
            NodeCache._registry.release(self.path, self._shared)
            self._users.close()
            self._digest_locks.close()
            gate.close()

    def __enter__(self) -> "NodeCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"node cache {self.path} is closed")
        if self._generation != NodeCache._fork_generation:
            raise StoreError(f"node cache {self.path} was opened before fork(); open a new NodeCache in this process")

    def _lookup(self, digests: Sequence[bytes]) -> tuple[int, list[Where | None]]:
        """(LMDB snapshot id, (size, checksum, segment, offset) of each digest's entry or
        None), in one read transaction. Every read consults the index here, once per chunk."""
        self._check_open()
        self.lookups += len(digests)
        with self._env.begin(db=self._db.entries) as txn:
            raws = [txn.get(d) for d in digests]
            snapshot = txn.id()
        out: list[Where | None] = []
        for raw in raws:
            if raw is None:
                out.append(None)
            else:
                size, checksum, _, segment, offset = ENTRY.unpack(raw)
                out.append((size, checksum, segment, offset))
        return snapshot, out

    def _changed_since(self, snapshot: int) -> bool:
        """Whether any process committed an index change after that snapshot (a fetch that
        landed in between would be one)."""
        return int(self._env.info()["last_txnid"]) != snapshot

    def _load(self, digest: bytes, where: Where, mapped: bool) -> ChunkData | None:
        """The bytes of an index entry, checked against it (size and xxh3, for a mapping too);
        None, and the entry dropped, if its segment is gone or they do not match."""
        size, checksum, segment, offset = where
        found, data = read_checked(self._files.path(segment), offset, size, checksum, mapped)
        if found is Found.CORRUPT:
            log.warning("node cache %s: chunk %s does not match its index entry; dropped", self.path, digest.hex())
        if found is not Found.OK:
            self._drop(digest, where, corrupt=found is Found.CORRUPT)
        return data

    def _read(self, digest: bytes, mapped: bool = False) -> ChunkData | None:
        """The cached chunk, checked against the index; None (and the entry dropped) otherwise."""
        _, (entry,) = self._lookup([digest])
        return None if entry is None else self._load(digest, entry, mapped)

    def _drop(self, digest: bytes, where: Where, corrupt: bool) -> None:
        size, checksum, segment, offset = where
        emptied = False
        with self._env.begin(write=True) as txn:
            entry = self._db.get(txn, digest)
            if entry is None or (entry.size, entry.checksum, entry.segment, entry.offset) != where:
                return  # already gone or replaced (a replacement is in another segment)
            self._db.remove(txn, digest)
            if corrupt:
                self._db.add_u64(txn, b"corrupt", 1)
            emptied = self._db.segment_empty(txn, segment)
        if emptied:  # segment ids are never reused: unlinking after the commit cannot hit a new fill
            unlink_all([self._files.path(segment)])

    def _note_access(self, digest: bytes, counter: str | None = None) -> None:
        if self._pending.note(digest, counter):
            self._flush()

    def _count(self, counter: str, n: int = 1) -> None:
        self._pending.count(counter, n)

    def get(self, digest: Digest) -> bytes | None:
        """The cached bytes of ``digest`` or None. A hit refreshes its LRU position."""
        return self.get_many([digest])[0]

    def get_many(self, digests: Sequence[Digest]) -> list[bytes | None]:
        """``get`` for several digests, consulting the index once (one read transaction)."""
        # Chunks this instance fetched and handed to the write-behind, looked up BEFORE the
        # index: the write-behind forgets a chunk only after indexing it, so each chunk is
        # in one or the other. Looked up after, a chunk indexed between the two lookups was
        # in neither (a get right after a read, missing what the read had just fetched).
        unwritten = self._writes.get_many(digests)
        _, entries = self._lookup(digests)
        out: list[bytes | None] = []
        for digest, entry in zip(digests, entries):
            data = None if entry is None else self._load(digest, entry, False)
            if data is None:
                data = unwritten.get(digest)
            if data is None:
                self._count("misses")
                out.append(None)
            else:
                self._note_access(digest, "hits")
                out.append(_as_bytes(data))
        return out

    def contains(self, digest: Digest) -> bool:
        return self.location_of(digest, touch=False) is not None

    def drain(self) -> None:
        """Wait until the fills this instance wrote behind are indexed."""
        self._writes.drain()

    def location_of(self, digest: Digest, touch: bool = True) -> Location | None:
        """Where the chunk's bytes are (segment file, offset, size), or None; not checked
        against the index (readers use get/get_or_fetch_many, which are; this is for tests
        and tools). Pin the digest first if the bytes must outlive the call (an unpinned
        entry may be evicted at any time; an open descriptor or mapping stays valid even then)."""
        self._check_open()
        self._writes.drain()  # this instance's own writes are visible to it
        with self._env.begin(db=self._db.entries) as txn:
            raw = txn.get(digest)
        if raw is None:
            return None
        size, _, _, segment, offset = ENTRY.unpack(raw)
        path = self._files.path(segment)
        if not os.path.exists(path):
            return None
        if touch:
            self._note_access(digest)
        return Location(path, offset, size)

    # -- single-flight fetch ---------------------------------------------------------------

    def get_or_fetch(self, digest: Digest, fetch: Callable[[], bytes]) -> bytes:
        """Cached bytes, else ``fetch()`` — called once however many threads and processes
        ask for the same missing digest at the same time — stored and returned.

        Threads waiting in this process get the fetch's exception if it raises; nothing is
        cached then. Waiters in other processes cannot receive that exception: they
        find nothing cached when the lock frees and run their own fetch."""
        return self.get_or_fetch_many([digest], lambda _missing: [fetch()])[0]

    @overload
    def get_or_fetch_many(self, digests: Sequence[Digest], fetch: FetchMany,
                          mapped: Literal[False] = False) -> list[bytes]: ...

    @overload
    def get_or_fetch_many(self, digests: Sequence[Digest], fetch: FetchMany,
                          mapped: Literal[True]) -> list[ChunkData]: ...

    def get_or_fetch_many(self, digests: Sequence[Digest], fetch: FetchMany,
                          mapped: bool = False) -> list[bytes] | list[ChunkData]:
        """The chunks of ``digests``, in the order asked (duplicates allowed).

        Cached ones are read (``mapped``: mapped read-only, no copy) and checked against the
        index: a torn or tampered file is dropped and fetched again. The index is consulted
        once per chunk. The others are fetched with ``fetch(missing)`` (verified bytes, in
        the order of ``missing``), stored and returned; each missing digest is fetched once
        however many threads and processes ask for it at the same time (get_or_fetch
        describes how errors reach the waiters).

        Single flight, deadlock-free for any mix of batches: the first thread of this
        instance to miss a digest leads its fetch, the others wait for it. A leader takes
        the per-digest cross-process locks of its batch without blocking, in digest order;
        it fetches the ones it got in one call, stores them, releases them, and only then
        waits, one digest at a time, for the ones another process holds (then they are
        usually cached; if not, it fetches them itself). A thread waits for other threads'
        fetches only after finishing its own."""
        want = list(dict.fromkeys(Digest(d) if type(d) is not Digest else d for d in digests))
        snapshot, entries = self._lookup(want)
        got: dict[Digest, ChunkData] = {}
        missing: list[Digest] = []
        for digest, entry in zip(want, entries):
            data = None if entry is None else self._load(digest, entry, mapped)
            if data is None:
                missing.append(digest)
            else:
                got[digest] = data
                self._note_access(digest, "hits")
        if missing:
            unwritten = self._writes.get_many(missing)  # fetched by this instance, still being written
            if unwritten:
                for digest, data in unwritten.items():
                    got[digest] = data
                    self._note_access(digest, "hits")
                missing = [d for d in missing if d not in unwritten]
        if missing:
            self._count("misses", len(missing))
            got.update(self._fill(sorted(missing), snapshot, fetch, mapped))
        return [got[d] for d in digests]

    def _fill(self, missing: list[Digest], snapshot: int, fetch: FetchMany, mapped: bool) -> dict[Digest, ChunkData]:
        return self._flights.run(missing, lambda leading: self._lead(leading, snapshot, fetch, mapped), mapped)

    def _lead(self, flights: dict[Digest, Flight], snapshot: int, fetch: FetchMany, mapped: bool) -> None:
        """Fetch the digests this thread leads (sorted), across processes (see get_or_fetch_many)."""
        mine: list[Digest] = []
        held: list[Digest] = []   # another process is fetching these
        try:
            # A thread of ours may have fetched one between our lookup and our lead, and
            # handed it to the write-behind: its fetch lock does not exclude our threads
            # (DigestLocks), and its flight is gone. Until indexed it is in _writes;
            # once indexed, _changed_since below sees it (the write-behind indexes
            # before it forgets the bytes, so looking here first leaves no gap).
            unwritten = self._writes.get_many(list(flights))
            for digest in flights:
                data: ChunkData | None = unwritten.get(digest)
                if data is not None:
                    flights[digest].data = data
                    self._note_access(digest)
                    continue
                (mine if self._digest_locks.try_lock(digest) else held).append(digest)
            if mine and self._changed_since(snapshot):
                # something was stored after our lookup: one of ours may have landed meanwhile
                _, entries = self._lookup(mine)
                for digest, entry in zip(list(mine), entries):
                    data = None if entry is None else self._load(digest, entry, mapped)
                    if data is not None:
                        self._note_access(digest)
                        flights[digest].data = data
                        mine.remove(digest)
                        self._digest_locks.unlock(digest)
            if mine and self._fetch_and_store(mine, flights, fetch, mapped, hand_over=True):
                mine = []  # the write-behind thread unlocks them once they are indexed
        finally:
            for digest in mine:
                self._digest_locks.unlock(digest)
        for digest in held:
            self._digest_locks.lock(digest)  # blocks until that process is done with it
            try:
                data = self._read(digest, mapped)
                if data is not None:
                    self._note_access(digest)
                    flights[digest].data = data
                else:  # its fetch failed or was not stored (no room): ours then
                    self._fetch_and_store([digest], flights, fetch, mapped)
            finally:
                self._digest_locks.unlock(digest)

    def _fetch_and_store(self, digests: list[Digest], flights: dict[Digest, Flight], fetch: FetchMany,
                         mapped: bool, hand_over: bool = False) -> bool:
        """Fetch and store ``digests`` (their fetch locks held); True if their storing and
        the release of their locks were handed to the write-behind thread (``hand_over``:
        the caller allows it; only byte readers, who need nothing on disk to go on)."""
        self._count("fetches", len(digests))
        fetched = fetch(digests)
        if len(fetched) != len(digests):
            raise StoreError(f"chunk fetch returned {len(fetched)} chunks for {len(digests)} asked")
        datas = [d if type(d) is bytes else bytes(d) for d in fetched]
        if hand_over and not mapped:
            for digest, data in zip(digests, datas):
                flights[digest].data = data
            self._writes.submit(list(zip(digests, datas)), functools.partial(self._unlock_all, list(digests)))
            return True
        # bytes readers have the bytes: write them past the page cache; mapped ones map them next
        stored = self._filler.insert(list(zip(digests, datas)), direct=not mapped)
        for digest, data, where in zip(digests, datas, stored):
            mapping = map_exact(where.path, where.offset, where.size) if mapped and where is not None else None
            flights[digest].data = mapping or data
        return False

    def _unlock_all(self, digests: list[Digest]) -> None:
        for digest in digests:
            self._digest_locks.unlock(digest)

    # -- writes ----------------------------------------------------------------------------

    def put(self, digest: Digest, data: bytes) -> bool:
        """Store verified bytes for ``digest``; True if they are cached afterwards.

        Best effort: returns False without raising when the chunk cannot fit (larger than
        the capacity, everything else pinned, disk below its floor) or the disk fails."""
        return self.put_many([(digest, data)])[0]

    def put_many(self, items: Sequence[tuple[Digest, bytes]]) -> list[bool]:
        """``put`` for several chunks: one segment file and one LMDB write transaction (a
        workspace commit keeps all its new chunks at once)."""
        self._check_open()
        self._writes.drain()
        stored = [False] * len(items)
        todo: list[int] = []
        for i, (digest, _) in enumerate(items):
            if self.contains(digest):
                self._note_access(digest)
                stored[i] = True
            else:
                todo.append(i)
        if todo:
            got = self._filler.insert([items[i] for i in todo], direct=True)
            for i, where in zip(todo, got):
                stored[i] = where is not None
        return stored

    def _disk_free(self) -> int:
        return cache_evict.disk_free(self.path)

    def _flush(self) -> None:
        self._pending.flush(self._env, self._db, self.path)

    # -- pins and stats --------------------------------------------------------------------

    def pin(self, digests: Iterable[Digest]) -> None:
        """Protect these digests from eviction (counted; also before they are cached).
        Pins of this instance are released by unpin() or close(); after a crash they
        are dropped when the next first user opens the directory."""
        self._check_open()
        # The shared table counts users (instances), not pins: only this instance's first
        # pin of a digest writes it, so the hundredth sandbox of a template pins its tens of
        # thousands of chunks with a Counter update, not an LMDB write per chunk.
        with self._lock:
            mine = self._my_pins
            first = []
            for d in digests:
                digest = bytes(d)
                if not mine[digest]:
                    first.append(digest)
                mine[digest] += 1
        if first:
            try:
                with self._env.begin(write=True) as txn:
                    for digest in first:
                        self._db.add_pin(txn, digest, 1)
            except BaseException:
                with self._lock:
                    for digest in first:
                        self._my_pins[digest] -= 1
                        if not self._my_pins[digest]:
                            del self._my_pins[digest]
                raise

    def pins_held(self, digest: Digest) -> int:
        """How many pins of ``digest`` this instance holds."""
        with self._lock:
            return self._my_pins.get(bytes(digest), 0)

    def unpin(self, digests: Iterable[Digest]) -> None:
        """Release pins taken by this instance; extra unpins are ignored."""
        self._check_open()
        release: list[bytes] = []
        with self._lock:
            mine = self._my_pins
            for d in digests:
                digest = bytes(d)
                if mine.get(digest, 0) > 0:
                    mine[digest] -= 1
                    if not mine[digest]:
                        del mine[digest]
                        release.append(digest)     # this instance's last pin of it
        if release:
            with self._env.begin(write=True) as txn:
                for digest in release:
                    self._db.add_pin(txn, digest, -1)

    def stats(self) -> CacheStats:
        self._check_open()
        self._writes.drain()
        self._flush()
        with self._env.begin() as txn:
            def get(name: str) -> int:
                return self._db.get_u64(txn, name.encode())

            pinned = pinned_bytes = 0
            for digest in self._db.iter_pins(txn):
                entry = self._db.get(txn, digest)
                if entry is not None:
                    pinned += 1
                    pinned_bytes += entry.size
            cfg = self.config
            return CacheStats(
                capacity=cfg.capacity, used_bytes=self._db.get_u64(txn, USED),
                entries=self._db.get_u64(txn, ENTRIES), pinned=pinned, pinned_bytes=pinned_bytes,
                hits=get("hits"), misses=get("misses"), fetches=get("fetches"), evictions=get("evictions"),
                evicted_bytes=get("evicted_bytes"), corrupt=get("corrupt"),
                high_watermark=cfg.high_watermark, low_watermark=cfg.low_watermark,
                min_free_disk=cfg.min_free_disk, disk_free=self._disk_free(), path=str(self.path))

    def verify(self, read_data: bool = False) -> list[str]:
        """Problems found between index and files (empty = consistent): entries without a
        file or with the wrong size (``read_data``: wrong checksum), files without an entry,
        totals that disagree with the entries. Exact while nobody writes."""
        self._check_open()
        self._writes.drain()
        return cache_files.verify(self._env, self._db, self._files, read_data)


os.register_at_fork(after_in_child=NodeCache._forked)
