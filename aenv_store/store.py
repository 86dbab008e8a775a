"""The Store facade: one node's view of the repository, its node cache and
its builder workspaces. This is the API other layers code against
(notes: store-api contract; formats: docs/store-format.md)."""
from __future__ import annotations

import functools
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .cache.node_cache import ChunkData, NodeCache
from .chunks import ChunkChain, ChunkSource
from .config import StoreSettings
from .errors import ConfigError, StoreNotFound, RepositoryError, StoreError
from .formats.catalog import ALIAS, CatalogRecord
from .formats.ids import Digest
from .formats.manifest import Extent, Manifest, check_chunk_size
from .manifest_cache import ManifestCache
from .repository.backends.base import Backend
from .repository.backends.factory import open_backend_for, repository_path
from .repository.repository import RecordVersion, Repository
from .workspace import Workspace, clean_stale_workspaces

log = logging.getLogger(__name__)

MAX_ALIAS_DEPTH = 32
# Sequential BlobReader reads: this many windows of the caller's read size are read
# ahead on the store's read-ahead threads (the next windows' range reads, zstd, BLAKE3
# and node-cache fills overlap with the caller's use of this one), for reads up to
# READ_AHEAD_MAX bytes; so a reader holds at most READ_AHEAD * READ_AHEAD_MAX ahead.
READ_AHEAD = 2
READ_AHEAD_MAX = 16 << 20
READ_AHEAD_THREADS = 2


def _open_cache(settings: StoreSettings) -> NodeCache:
    path = Path(settings.cache.path).expanduser() if settings.cache.path else settings.paths.cache
    return NodeCache(path, settings.cache)


def describe_location(settings: StoreSettings) -> str:
    cfg = settings.repository
    if cfg.backend == "posix_fs":
        return str(repository_path(cfg, settings.paths.data_dir))
    return f"{cfg.backend}://{cfg.bucket}/{cfg.prefix}".rstrip("/")


class Store:
    """Repository + node cache + workspace root of one node. Thread-safe reads."""

    def __init__(self, settings: StoreSettings, backend: Backend, repository: Repository,
                 cache: NodeCache | None) -> None:
        self.settings = settings
        self.backend = backend
        self.repository = repository
        self.cache = cache
        # every chunk read: node cache -> chunk sources (P2P, added by aenv_store.assembly) -> repository
        self.chunks = ChunkChain(repository, cache)
        # New artifacts use the repository's chunk size (fixed at `aenv repo init`).
        self.chunk_size = repository.config.chunk_size
        self.manifests = ManifestCache()
        self._cpool: ThreadPoolExecutor | None = None
        self._apool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.closed = False

    @classmethod
    def open(cls, settings: StoreSettings, create: bool = False) -> "Store":
        """Open the configured repository (``create``: initialise it if missing).
        RepositoryError if it is missing, corrupt or of an unknown version. No P2P:
        aenv_store.assembly.open_node_store adds it when ``[p2p] enabled``."""
        try:
            check_chunk_size(settings.store.chunk_size)
        except ValueError as e:
            raise ConfigError(f"store.chunk_size: {e}") from None
        if settings.store.compression_level not in range(-7, 23):
            raise ConfigError(f"store.compression_level must be in 1..19, got {settings.store.compression_level}")
        if settings.store.pack_target_size < 64 << 10:
            raise ConfigError("store.pack_target_size must be at least 64 KiB")
        where = describe_location(settings)
        backend = open_backend_for(settings)
        try:
            try:
                repo = Repository.open(backend, where)
            except RepositoryError:
                if not create or backend.exists("config"):
                    raise
                repo = Repository.init(backend, settings.store.chunk_size, where)
            clean_stale_workspaces(settings.paths.workspace)
            backend.cleanup_tmp()
            cache = _open_cache(settings)
        except BaseException:
            backend.close()
            raise
        return cls(settings, backend, repo, cache)

    @classmethod
    def init(cls, settings: StoreSettings) -> "Store":
        """Create a new repository (RepositoryError if one exists) and open it."""
        try:
            check_chunk_size(settings.store.chunk_size)
        except ValueError as e:
            raise ConfigError(f"store.chunk_size: {e}") from None
        backend = open_backend_for(settings)
        try:
            Repository.init(backend, settings.store.chunk_size, describe_location(settings))
        finally:
            backend.close()
        return cls.open(settings)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._cpool is not None:
            self._cpool.shutdown(wait=True)
        with self._pool_lock:
            apool, self._apool = self._apool, None
        if apool is not None:  # before the read chain: read-ahead tasks use it
            apool.shutdown(wait=True, cancel_futures=True)
        self.chunks.close()
        if self.cache is not None:
            self.cache.close()
        self.repository.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------

    def workspace(self, chunk_size: int | None = None) -> Workspace:
        """A new staging area under <data-dir>/workspace/<uuid>."""
        return Workspace(self.settings.paths.workspace, self.repository, self.settings.store,
                         self.read_chunk, chunk_size or self.chunk_size, executor=self._compress_pool())

    def _compress_pool(self) -> ThreadPoolExecutor | None:
        threads = os.cpu_count() or 1
        if threads < 2:
            return None
        with self._pool_lock:
            if self._cpool is None:
                self._cpool = ThreadPoolExecutor(threads, thread_name_prefix="aenv-store-zstd")
            return self._cpool

    def _read_ahead(self, task: Callable[[], bytes]) -> "Future[bytes] | None":
        """Run ``task`` on the read-ahead threads; None once the store is closing."""
        with self._pool_lock:
            if self.closed:
                return None
            if self._apool is None:
                self._apool = ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="aenv-store-ahead")
            return self._apool.submit(task)

    # -- reading ---------------------------------------------------------------------

    def add_chunk_source(self, source: ChunkSource) -> None:
        """Consult ``source`` between the node cache and the repository; closed with the store."""
        self.chunks.add_source(source)

    @property
    def chunk_sources(self) -> tuple[ChunkSource, ...]:
        return self.chunks.sources

    def fetch_chunk(self, cid: Digest) -> bytes:
        """A chunk straight from the repository (range read of exactly its bytes),
        decompressed and verified against its id; no cache, no peers."""
        return self.chunks.fetch_from_repository(cid)

    def read_chunk(self, cid: Digest) -> bytes:
        """Plaintext of one chunk: node cache -> P2P peers -> repository; verified (CorruptData)."""
        return self.chunks.read(cid)

    def read_chunk_uncached(self, cid: Digest) -> bytes:
        """Like read_chunk, but a miss is not added to the node cache (bulk exports
        and scans that should not evict a node's working set)."""
        return self.chunks.read_many([cid], cache=False)[0]

    def read_chunks(self, cids: Sequence[Digest], cache: bool = True) -> list[bytes]:
        """Several chunks (in the order asked). Misses are fetched together: one
        batched peer request, then chunks lying close in one pack with a single
        range read each (runs in parallel), all verified; cached unless
        ``cache=False`` (see read_chunk_uncached)."""
        return self.chunks.read_many(cids, cache)

    def map_chunks(self, cids: Sequence[Digest]) -> list[ChunkData]:
        """Like read_chunks, but chunks come back as verified read-only mappings of their
        node-cache files where there are such (plain bytes otherwise): block images keep
        no private copy of what the page cache holds for every reader on the node."""
        return self.chunks.map_many(cids)

    def pin_chunks(self, cids: Iterable[Digest]) -> None:
        """Keep these chunks in the node cache (counted; also before they are cached)
        until unpin_chunks or close."""
        if self.cache is not None:
            self.cache.pin(cids)

    def unpin_chunks(self, cids: Iterable[Digest]) -> None:
        if self.cache is not None:
            self.cache.unpin(cids)

    def keep_chunks(self, chunks: Sequence[tuple[Digest, bytes]]) -> None:
        """Add chunks whose plaintext the caller has (and whose ids it computed from it)
        to the node cache, best effort; without a node cache nothing happens."""
        if self.cache is not None:
            self.cache.put_many(chunks)

    def load_manifest(self, mid: Digest) -> Manifest:
        """The manifest ``mid`` (verified against its id), decoded once per process while
        it is in use (manifest_cache.py)."""
        return self.manifests.get(mid, self.repository.get_manifest)

    def open_blob(self, mid: Digest | Manifest, cache: bool = True) -> "BlobReader":
        """A reader over a manifest. ``cache=False`` for one-pass bulk reads (export,
        restore elsewhere): chunks already cached are used, misses are not cached."""
        manifest = mid if isinstance(mid, Manifest) else self.load_manifest(mid)
        return BlobReader(self, manifest, cache)

    # -- catalog ---------------------------------------------------------------------

    def get_record(self, name: str) -> CatalogRecord:
        return self.repository.get_record(name)

    def resolve(self, name: str) -> CatalogRecord:
        seen = []
        rec = self.get_record(name)
        while rec.kind == ALIAS:
            seen.append(rec.name)
            if len(seen) > MAX_ALIAS_DEPTH or rec.target in seen:
                raise StoreError(f"alias loop resolving {name!r}: {' -> '.join(seen + [str(rec.target)])}")
            assert rec.target is not None
            rec = self.get_record(rec.target)
        return rec

    def list_records(self, kind: str | None = None) -> list[CatalogRecord]:
        return self.repository.list_records(kind)

    def put_record(self, record: CatalogRecord, exclusive: bool = True) -> None:
        """Write a record whose manifests are already committed (e.g. an alias)."""
        for role, mid in record.manifests:
            if not self.repository.has_manifest(mid):
                raise StoreNotFound(f"record {record.name!r}: manifest {role}={bytes(mid).hex()} does not exist")
        self.repository.put_record(record, exclusive)

    def get_record_version(self, name: str) -> RecordVersion:
        return self.repository.get_record_version(name)

    def swap_record(self, record: CatalogRecord, replaces: RecordVersion) -> None:
        """``put_record`` only over ``replaces`` (``Conflict`` if the record changed since)."""
        for role, mid in record.manifests:
            if not self.repository.has_manifest(mid):
                raise StoreNotFound(f"record {record.name!r}: manifest {role}={bytes(mid).hex()} does not exist")
        self.repository.swap_record(record, replaces)

    def delete_record(self, name: str) -> None:
        self.repository.delete_record(name)


_ZEROS = bytes(4 << 20)


def _zeros(n: int) -> bytes | memoryview:
    """n zero bytes without allocating for the common sizes (a view of one shared buffer)."""
    return memoryview(_ZEROS)[:n] if n <= len(_ZEROS) else bytes(n)


def _joined(parts: list[bytes | memoryview]) -> bytes:
    if len(parts) == 1 and type(parts[0]) is bytes:
        return parts[0]
    return b"".join(parts)


class BlobReader:
    """Random-access reads over one manifest (whole artifact or a delta). Thread-safe.

    Sequential reads (a read starting where the previous one ended) are read ahead: the next READ_AHEAD windows of the same size are read on the
    store's read-ahead threads, through the same read chain (node cache, single
    flight, verification), so a cold sequential read keeps every CPU busy. A read
    elsewhere drops the windows read ahead."""

    def __init__(self, store: Store, manifest: Manifest, cache: bool = True) -> None:
        self.store = store
        self.manifest = manifest
        self.size = manifest.size
        self.cache = cache
        self._pinned = False
        self._lock = threading.Lock()
        self._next = -1         # where a sequential read starts (none yet)
        self._ahead: dict[tuple[int, int], Future[bytes]] = {}

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) clipped at the size; zero extents read as
        zeros. In a delta manifest, a gap raises StoreNotFound (the caller resolves it
        from the parent); in a full manifest a gap reads as zeros."""
        if offset < 0 or length < 0:
            raise ValueError(f"negative offset/length ({offset}, {length})")
        end = min(offset + length, self.size)
        if offset >= end:
            return b""
        ahead = self._take_ahead(offset, length, end)
        if ahead is not None:
            try:
                return ahead.result()
            except Exception:  # noqa: BLE001 - read it again here: its error is this caller's
                pass
        return _joined(self._read(offset, end))

    def read_parts(self, offset: int, length: int) -> list[bytes | memoryview]:
        """``read`` as the pieces it is made of (chunks, slices of chunks, zeros), in order,
        not joined, and without read-ahead: for a caller that reads windows on threads of
        its own and copies the pieces into its own buffers (an export), which saves
        the join's copy of every byte."""
        if offset < 0 or length < 0:
            raise ValueError(f"negative offset/length ({offset}, {length})")
        end = min(offset + length, self.size)
        return self._read(offset, end) if offset < end else []

    def _take_ahead(self, offset: int, length: int, end: int) -> Future[bytes] | None:
        """This read's window if it was read ahead; schedules the windows after it."""
        with self._lock:
            mine = self._ahead.pop((offset, length), None)
            # two reads in a row make a sequential reader: one read (a header at 0, one
            # window a peer serves) is not a reason to fetch the next windows
            sequential, self._next = offset == self._next, end
            if not sequential or length > READ_AHEAD_MAX:
                stale, self._ahead = self._ahead, {}
            else:
                stale = {k: f for k, f in self._ahead.items() if k[0] < end}
                for k in stale:
                    del self._ahead[k]
                for i in range(READ_AHEAD):
                    start = end + i * length
                    if start >= self.size:
                        break
                    if (start, length) not in self._ahead:
                        stop = min(start + length, self.size)
                        fut = self.store._read_ahead(functools.partial(self._read_joined, start, stop))
                        if fut is None:
                            break
                        self._ahead[(start, length)] = fut
        for fut in stale.values():
            fut.cancel()  # one already running finishes; its chunks are cached all the same
        return mine

    def _read_joined(self, offset: int, end: int) -> bytes:
        return _joined(self._read(offset, end))

    def _read(self, offset: int, end: int) -> list[bytes | memoryview]:
        extents = self.manifest.extents_in(offset, end - offset)
        datas = self.store.read_chunks([e.chunk for e in extents if e.chunk is not None], self.cache)
        # pieces, joined once at the end (_joined): no zero-filled buffer to overwrite, no
        # final copy of it into bytes (both were ~28% of a cold 4 MiB read)
        parts: list[bytes | memoryview] = []
        pos = offset
        di = 0
        for e in extents:
            if e.offset > pos:
                self._gap(pos, e.offset)
                parts.append(_zeros(e.offset - pos))
            a, b = max(e.offset, offset), min(e.end, end)
            if e.chunk is not None:
                data = datas[di]
                di += 1
                if len(data) != e.length:
                    raise StoreError(f"chunk {e.chunk.hex()} has {len(data)} bytes, extent wants {e.length}")
                parts.append(data if (a, b) == (e.offset, e.end) else memoryview(data)[a - e.offset:b - e.offset])
            else:
                parts.append(_zeros(b - a))
            pos = b
        if pos < end:
            self._gap(pos, end)
            parts.append(_zeros(end - pos))
        return parts

    def _gap(self, a: int, b: int) -> None:
        if self.manifest.parent is not None:
            raise StoreNotFound(f"range [{a}, {b}) is not in delta manifest {self.manifest.id.short()} "
                           f"(read it from parent {self.manifest.parent.short()})")

    def extents(self) -> tuple[Extent, ...]:
        return self.manifest.extents

    def pin(self) -> None:
        if not self._pinned:
            self.store.pin_chunks(set(self.manifest.chunks))
            self._pinned = True

    def unpin(self) -> None:
        if self._pinned:
            self.store.unpin_chunks(set(self.manifest.chunks))
            self._pinned = False
