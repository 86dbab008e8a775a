"""The node cache: a bounded local directory of verified plaintext chunks.

Layout of a cache directory (details and the crash-safety argument in docs/cache.md)::

    index/            LMDB environment (aenv_store.cache.index): digest -> size, checksum,
                      last access; LRU order; pin counts; totals and counters
    data/ab/<hex>     one file per chunk, exactly its bytes (files.py; mapped by readers)
    tmp/              chunk files being written
    inflight.lock     byte-range lock per chunk being fetched (one fetch per node)
    users.lock        every open NodeCache holds a shared flock (first/last user detection)
    gate.lock         serialises open/close so first/last detection is race-free

Write order makes a crash harmless: a chunk is written to tmp/ in full, renamed
into data/ and indexed in one LMDB write transaction; eviction removes index
entries first and the files after the commit. So an index entry never points
to a partial file; a crash can leave an orphan file (removed when the next
first user reconciles) or an entry whose file is gone (read as a miss and
dropped). Reads check size and xxh3 against the index, so torn or tampered
files are never returned.

A hit is one LMDB read transaction plus open/read/close of one file (~10 µs
for 64 KiB). The access time it produces is queued in memory and written to
LMDB in batches (every TOUCH_BATCH hits or TOUCH_INTERVAL seconds, and before
this process evicts), so LRU order across processes lags by at most that much.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Literal, Sequence, overload

import lmdb
import xxhash

from ..config import CacheConfig
from ..errors import ConfigError, StoreError
from ..formats.ids import Digest
from . import evict as cache_evict, files as cache_files
from .env import EnvRegistry, boot_id, open_env, wipe
from .files import ChunkData, Found, map_exact, read_checked, unlink_all, write_file
from .flights import Flight, Flights
from .index import COUNTERS, ENTRIES, ENTRY, USED, Entry, IndexDbs
from .lock import DigestLocks, FileLock

log = logging.getLogger(__name__)

TOUCH_BATCH = 512       # queued LRU touches that trigger a flush
TOUCH_INTERVAL = 1.0    # seconds: queued touches/counters are flushed at least this often (on activity)
OPEN_COUNT = b"open_count"


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
        self._files = cache_files.ChunkFiles(str(self.path / "data"))
        self._file = self._files.path
        self._tmp = str(self.path / "tmp")
        self._lock = threading.Lock()   # pending touches, counter deltas, flights, own pins
        self._pending: dict[bytes, int] = {}
        self._deltas: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._last_flush = time.monotonic()
        self._flights: Flights[Digest] = Flights()
        self._my_pins: Counter[bytes] = Counter()
        self._tmp_seq = itertools.count()
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
            for d in (self.path, self.path / "data", Path(self._tmp)):
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
        for name in os.listdir(self._tmp):  # leftovers of dead processes (nobody else is here)
            unlink_all([os.path.join(self._tmp, name)])
        evicted: list[bytes] = []
        with self._env.begin(write=True) as txn:
            for digest, _pid in list(self._db.iter_dying(txn)):  # evictions cut short by a crash
                unlink_all([self._file(digest)])
                self._db.clear_dying(txn, digest)
            self._db.clear_pins(txn)  # pins belong to live users; there are none
            self._db.set_meta(txn, b"clean", b"0")
            self._db.set_u64(txn, OPEN_COUNT, 0)
            self._db.set_meta(txn, b"boot_id", boot)
            self._make_room(txn, 0, evicted)  # the capacity may have been lowered
        self._finish_evictions(evicted)
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
        self._flush()
        self._closed = True
        with self._lock:
            mine, self._my_pins = self._my_pins, Counter()
        gate = FileLock(self.path / "gate.lock")
        try:
            gate.exclusive()
            with self._env.begin(write=True) as txn:
                for digest, n in mine.items():
                    self._db.add_pin(txn, digest, -n)
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

    def _lookup(self, digests: Sequence[bytes]) -> tuple[int, list[tuple[int, int] | None]]:
        """(LMDB snapshot id, (size, checksum) of each digest's entry or None), in one read
        transaction. Every read consults the index here, once per chunk."""
        self._check_open()
        self.lookups += len(digests)
        with self._env.begin(db=self._db.entries) as txn:
            raws = [txn.get(d) for d in digests]
            snapshot = txn.id()
        return snapshot, [None if raw is None else ENTRY.unpack(raw)[:2] for raw in raws]

    def _changed_since(self, snapshot: int) -> bool:
        """Whether any process committed an index change after that snapshot (a fetch that
        landed in between would be one)."""
        return int(self._env.info()["last_txnid"]) != snapshot

    def _load(self, digest: bytes, size: int, checksum: int, mapped: bool) -> ChunkData | None:
        """The file of an index entry, checked against it (size and xxh3, for a mapping too);
        None, and the entry dropped, if it is gone or does not match."""
        found, data = read_checked(self._file(digest), size, checksum, mapped)
        if found is Found.CORRUPT:
            log.warning("node cache %s: chunk %s does not match its index entry; dropped", self.path, digest.hex())
        if found is not Found.OK:
            self._drop(digest, size, checksum, corrupt=found is Found.CORRUPT)
        return data

    def _read(self, digest: bytes, mapped: bool = False) -> ChunkData | None:
        """The cached chunk, checked against the index; None (and the entry dropped) otherwise."""
        _, (entry,) = self._lookup([digest])
        return None if entry is None else self._load(digest, *entry, mapped)

    def _drop(self, digest: bytes, size: int, checksum: int, corrupt: bool) -> None:
        path = self._file(digest)
        with self._env.begin(write=True) as txn:
            entry = self._db.get(txn, digest)
            if entry is None or (entry.size, entry.checksum) != (size, checksum):
                return  # already gone or replaced
            if not corrupt and os.path.exists(path):
                return  # a put restored the file meanwhile
            self._db.remove(txn, digest)
            if corrupt:
                self._db.add_u64(txn, b"corrupt", 1)
                unlink_all([path])  # inside the txn: no put can rename a fresh file in between

    def _note_access(self, digest: bytes, counter: str | None = None) -> None:
        with self._lock:
            self._pending[digest] = time.time_ns()
            if counter:
                self._deltas[counter] += 1
            due = len(self._pending) >= TOUCH_BATCH or time.monotonic() - self._last_flush >= TOUCH_INTERVAL
        if due:
            self._flush()

    def _count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self._deltas[counter] += n

    def get(self, digest: Digest) -> bytes | None:
        """The cached bytes of ``digest`` or None. A hit refreshes its LRU position."""
        return self.get_many([digest])[0]

    def get_many(self, digests: Sequence[Digest]) -> list[bytes | None]:
        """``get`` for several digests, consulting the index once (one read transaction)."""
        _, entries = self._lookup(digests)
        out: list[bytes | None] = []
        for digest, entry in zip(digests, entries):
            data = None if entry is None else self._load(digest, *entry, False)
            if data is None:
                self._count("misses")
                out.append(None)
            else:
                self._note_access(digest, "hits")
                out.append(_as_bytes(data))
        return out

    def contains(self, digest: Digest) -> bool:
        self._check_open()
        with self._env.begin(db=self._db.entries) as txn:
            present = txn.get(digest) is not None
        return present and os.path.exists(self._file(digest))

    def path_of(self, digest: Digest) -> Path | None:
        """The file holding exactly the chunk's bytes, or None; not checked against the index
        (readers use get/get_or_fetch_many, which are). Pin the digest first if the file must
        outlive the call (an unpinned entry may be evicted at any time; an open file
        descriptor or mapping stays valid even then)."""
        if not self.contains(digest):
            return None
        self._note_access(digest)
        return Path(self._file(digest))

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
            data = None if entry is None else self._load(digest, *entry, mapped)
            if data is None:
                missing.append(digest)
            else:
                got[digest] = data
                self._note_access(digest, "hits")
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
            for digest in flights:
                (mine if self._digest_locks.try_lock(digest) else held).append(digest)
            if mine and self._changed_since(snapshot):
                # something was stored after our lookup: one of ours may have landed meanwhile
                _, entries = self._lookup(mine)
                for digest, entry in zip(list(mine), entries):
                    data = None if entry is None else self._load(digest, *entry, mapped)
                    if data is not None:
                        self._note_access(digest)
                        flights[digest].data = data
                        mine.remove(digest)
                        self._digest_locks.unlock(digest)
            if mine:
                self._fetch_and_store(mine, flights, fetch, mapped)
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
                         mapped: bool) -> None:
        self._count("fetches", len(digests))
        fetched = fetch(digests)
        if len(fetched) != len(digests):
            raise StoreError(f"chunk fetch returned {len(fetched)} chunks for {len(digests)} asked")
        datas = [d if type(d) is bytes else bytes(d) for d in fetched]
        stored = self._insert(list(zip(digests, datas)), known_missing=True)
        for digest, data, ok in zip(digests, datas, stored):
            flights[digest].data = (map_exact(self._file(digest), len(data)) or data) if mapped and ok else data

    # -- writes ----------------------------------------------------------------------------

    def put(self, digest: Digest, data: bytes) -> bool:
        """Store verified bytes for ``digest``; True if they are cached afterwards.

        Best effort: returns False without raising when the chunk cannot fit (larger than
        the capacity, everything else pinned, disk below its floor) or the disk fails."""
        return self.put_many([(digest, data)])[0]

    def put_many(self, items: Sequence[tuple[Digest, bytes]]) -> list[bool]:
        """``put`` for several chunks with one LMDB write transaction (a cold bulk read
        inserts a whole read batch at once; a transaction per chunk cost ~20% of it)."""
        return self._insert(items, known_missing=False)

    def _insert(self, items: Sequence[tuple[Digest, bytes]], known_missing: bool) -> list[bool]:
        """put_many; ``known_missing``: the caller just found these digests missing under
        their fetch locks, so do not look them up before writing their files (the write
        transaction still checks)."""
        self._check_open()
        stored = [False] * len(items)
        todo: list[tuple[int, Digest, str, int, int]] = []  # index, digest, tmp file, size, checksum
        renamed: set[str] = set()
        try:
            for i, (digest, data) in enumerate(items):
                size = len(data)
                if size > self.config.capacity:
                    continue
                if not known_missing and self.contains(digest):
                    self._note_access(digest)
                    stored[i] = True
                    continue
                tmp = f"{self._tmp}/{digest.hex()}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_seq)}"
                try:
                    write_file(tmp, data)
                except OSError as e:
                    unlink_all([tmp])
                    log.warning("node cache %s: cannot write chunk %s: %s", self.path, digest.hex(), e)
                    continue
                todo.append((i, digest, tmp, size, xxhash.xxh3_64_intdigest(data)))
            if not todo:
                return stored
            touches, deltas = self._take_pending()
            evicted: list[bytes] = []
            try:
                with self._env.begin(write=True) as txn:
                    self._apply_pending(txn, touches, deltas)  # our recent hits count before we evict
                    for i, digest, tmp, size, checksum in todo:
                        path = self._file(digest)
                        existing = self._db.get(txn, digest)
                        if existing is not None and os.path.exists(path):
                            stored[i] = True  # raced with another writer (or a duplicate in items)
                        elif self._db.is_dying(txn, digest):
                            pass  # an eviction will unlink this path any moment: no file there now
                        else:
                            if existing is not None:
                                self._db.remove(txn, digest)  # its file vanished: replace the entry
                            if self._make_room(txn, size, evicted):
                                # rename inside the write txn: renames and index changes of all
                                # processes are serialised, so an entry always names its own file
                                os.rename(tmp, path)
                                renamed.add(tmp)
                                self._db.add(txn, digest, Entry(size, checksum, time.time_ns()))
                                stored[i] = True
            except (lmdb.Error, OSError) as e:
                self._restore_pending(touches, deltas)
                unlink_all([self._file(d) for _, d, tmp, _, _ in todo if tmp in renamed])  # no entries
                renamed.clear()
                for i, *_ in todo:
                    stored[i] = False
                log.warning("node cache %s: cannot store %d chunk(s): %s", self.path, len(todo), e)
                return stored
            self._finish_evictions(evicted)
            return stored
        finally:
            unlink_all([tmp for _, _, tmp, _, _ in todo if tmp not in renamed])

    def _disk_free(self) -> int:
        return cache_evict.disk_free(self.path)

    def _make_room(self, txn: lmdb.Transaction, incoming: int, evicted: list[bytes]) -> bool:
        return cache_evict.make_room(txn, self._db, self._files, self.config, self.path, incoming, evicted)

    def _finish_evictions(self, victims: list[bytes]) -> None:
        try:
            cache_evict.finish_evictions(self._env, self._db, self._files, victims)
        except lmdb.Error as e:  # the marks stay; the next eviction or first user sweeps them
            log.warning("node cache %s: cannot finish evictions: %s", self.path, e)

    # -- batched LRU touches and counters --------------------------------------------------

    def _take_pending(self) -> tuple[dict[bytes, int], dict[str, int]]:
        with self._lock:
            touches, self._pending = self._pending, {}
            deltas, self._deltas = self._deltas, dict.fromkeys(COUNTERS, 0)
            self._last_flush = time.monotonic()
        return touches, deltas

    def _restore_pending(self, touches: dict[bytes, int], deltas: dict[str, int]) -> None:
        with self._lock:
            for d, t in touches.items():
                self._pending[d] = max(t, self._pending.get(d, 0))
            for k, v in deltas.items():
                self._deltas[k] += v

    def _apply_pending(self, txn: lmdb.Transaction, touches: dict[bytes, int], deltas: dict[str, int]) -> None:
        for digest, when in touches.items():
            self._db.touch(txn, digest, when)
        for name, delta in deltas.items():
            self._db.add_u64(txn, name.encode(), delta)

    def _flush(self) -> None:
        touches, deltas = self._take_pending()
        if not touches and not any(deltas.values()):
            return
        try:
            with self._env.begin(write=True) as txn:
                self._apply_pending(txn, touches, deltas)
        except lmdb.Error as e:
            self._restore_pending(touches, deltas)
            log.warning("node cache %s: cannot record accesses: %s", self.path, e)

    # -- pins and stats --------------------------------------------------------------------

    def pin(self, digests: Iterable[Digest]) -> None:
        """Protect these digests from eviction (counted; also before they are cached).
        Pins of this instance are released by unpin() or close(); after a crash they
        are dropped when the next first user opens the directory."""
        self._check_open()
        todo = [bytes(d) for d in digests]
        if not todo:
            return
        with self._env.begin(write=True) as txn:
            for digest in todo:
                self._db.add_pin(txn, digest, 1)
        with self._lock:
            self._my_pins.update(todo)

    def unpin(self, digests: Iterable[Digest]) -> None:
        """Release pins taken by this instance; extra unpins are ignored."""
        self._check_open()
        release: list[bytes] = []
        with self._lock:
            for d in digests:
                digest = bytes(d)
                if self._my_pins[digest] > 0:
                    self._my_pins[digest] -= 1
                    if not self._my_pins[digest]:
                        del self._my_pins[digest]
                    release.append(digest)
        if release:
            with self._env.begin(write=True) as txn:
                for digest in release:
                    self._db.add_pin(txn, digest, -1)

    def stats(self) -> CacheStats:
        self._check_open()
        self._flush()
        with self._env.begin() as txn:
            get = lambda name: self._db.get_u64(txn, name.encode())  # noqa: E731
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
        return cache_files.verify(self._env, self._db, self._files, read_data)


os.register_at_fork(after_in_child=NodeCache._forked)
