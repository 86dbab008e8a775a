"""The Store facade: one node's view of the repository, its node cache and
its builder workspaces. This is the API other layers code against
(notes: store-api contract; formats: docs/store-format.md)."""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zstandard

from .config import StoreSettings
from .errors import ConfigError, NotFound, RepositoryError, StoreError
from .formats.catalog import ALIAS, CatalogRecord
from .formats.ids import Digest
from .formats.index import IndexEntry
from .formats.manifest import Extent, Manifest, check_chunk_size
from .repository.backends.base import Backend
from .repository.backends.factory import open_backend_for, repository_path
from .repository.repository import Repository, coalesce
from .workspace import Workspace, clean_stale_workspaces

log = logging.getLogger(__name__)

MAX_ALIAS_DEPTH = 32
READ_THREADS = 4  # chunk fetches of one large read overlap I/O, zstd and BLAKE3 (both drop the GIL)


def _open_cache(settings: StoreSettings) -> Any:
    try:
        from .cache.node_cache import NodeCache
    except ImportError:  # the node cache module is optional for the core to work
        return None
    path = Path(settings.cache.path).expanduser() if settings.cache.path else settings.paths.cache
    return NodeCache(path, settings.cache)


def describe_location(settings: StoreSettings) -> str:
    cfg = settings.repository
    if cfg.backend == "posix_fs":
        return str(repository_path(cfg, settings.paths.data_dir))
    return f"{cfg.backend}://{cfg.bucket}/{cfg.prefix}".rstrip("/")


class Store:
    """Repository + node cache + workspace root of one node. Thread-safe reads."""

    def __init__(self, settings: StoreSettings, backend: Backend, repository: Repository, cache: Any) -> None:
        self.settings = settings
        self.backend = backend
        self.repository = repository
        self.cache = cache
        # New artifacts use the repository's chunk size (fixed at `aenv repo init`).
        self.chunk_size = repository.config.chunk_size
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._cpool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.closed = False
        # Optional chunk source between node cache and repository (P2P peers,
        # aenv_store.p2p.source); it returns verified bytes or None.
        self.peer_source: Any = None

    @classmethod
    def open(cls, settings: StoreSettings, create: bool = False) -> "Store":
        """Open the configured repository (``create``: initialise it if missing).
        RepositoryError if it is missing, corrupt or of an unknown version."""
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
            cleanup = getattr(backend, "cleanup_tmp", None)
            if cleanup is not None:
                cleanup()
            cache = _open_cache(settings)
        except BaseException:
            backend.close()
            raise
        store = cls(settings, backend, repo, cache)
        if settings.p2p.enabled:
            from .p2p.source import attach

            store.peer_source = attach(store)
        return store

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
        for pool in (self._pool, self._cpool):
            if pool is not None:
                pool.shutdown(wait=True)
        if self.peer_source is not None:
            self.peer_source.close()
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

    # -- reading ---------------------------------------------------------------------

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = zstandard.ZstdDecompressor()
        return d

    def fetch_chunk(self, cid: Digest) -> bytes:
        """A chunk straight from the repository (range read of exactly its bytes),
        decompressed and verified against its id; no cache."""
        return self.repository.read_chunk(cid, self._dctx())

    def _fetch_missing(self, cid: Digest) -> bytes:
        """A chunk the node cache lacks: peers first (if any; verified), then the repository."""
        if self.peer_source is not None:
            data = self.peer_source.fetch(cid)
            if data is not None:
                return data  # type: ignore[no-any-return]
        return self.fetch_chunk(cid)

    def read_chunk(self, cid: Digest) -> bytes:
        """Plaintext of one chunk: node cache -> P2P peers -> repository; verified (CorruptData)."""
        if self.cache is None:
            return self._fetch_missing(cid)
        return self.cache.get_or_fetch(cid, lambda: self._fetch_missing(cid))

    def read_chunk_uncached(self, cid: Digest) -> bytes:
        """Like read_chunk, but a miss is not added to the node cache (bulk exports
        and scans that should not evict a node's working set)."""
        if self.cache is not None:
            data = self.cache.get(cid)
            if data is not None:
                return data  # type: ignore[no-any-return]
        return self._fetch_missing(cid)

    def read_chunks(self, cids: list[Digest], cache: bool = True) -> list[bytes]:
        """Several chunks (in the order asked). Misses are fetched together: one
        batched peer request, then chunks lying close in one pack with a single
        range read each (runs in parallel), all verified; cached unless
        ``cache=False`` (see read_chunk_uncached)."""
        if len(cids) <= 1:
            return [self.read_chunk(c) if cache else self.read_chunk_uncached(c) for c in cids]
        got: dict[bytes, bytes] = {}
        missing = []
        for c in dict.fromkeys(bytes(c) for c in cids):
            data = self.cache.get(Digest(c)) if self.cache is not None else None
            if data is None:
                missing.append(c)
            else:
                got[c] = data
        if self.peer_source is not None and len(missing) > 1:
            # one batched peer request instead of a round trip per chunk
            fetched = self.peer_source.fetch_many([Digest(c) for c in missing])
            for cid, data in fetched.items():
                got[bytes(cid)] = data
            if cache and self.cache is not None and fetched:
                self.cache.put_many(list(fetched.items()))
            missing = [c for c in missing if c not in got]
        if len(missing) > 1:
            entries = [e for e in map(self.repository.lookup, missing) if e is not None]
            runs = coalesce(entries)
            for run, datas in zip(runs, self._read_pool().map(lambda r: self._fetch_run(r, cache), runs)):
                for e, data in zip(run, datas):
                    got[bytes(e.chunk)] = data
        # the rest: cache hits, and anything the index did not know (read_chunk refreshes it)
        return [got[bytes(c)] if bytes(c) in got else
                (self.read_chunk(c) if cache else self.read_chunk_uncached(c)) for c in cids]

    def _fetch_run(self, run: list[IndexEntry], cache: bool) -> list[bytes]:
        try:
            datas = self.repository.read_run(run, self._dctx())
        except NotFound:  # pack gone (gc repack): chunk by chunk, which re-resolves them
            datas = [self.repository.read_chunk(e.chunk, self._dctx()) for e in run]
        if cache and self.cache is not None:
            self.cache.put_many([(e.chunk, data) for e, data in zip(run, datas)])
        return datas

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="aenv-store-read")
            return self._pool

    def load_manifest(self, mid: Digest) -> Manifest:
        return self.repository.get_manifest(mid)

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
                raise NotFound(f"record {record.name!r}: manifest {role}={bytes(mid).hex()} does not exist")
        self.repository.put_record(record, exclusive)

    def delete_record(self, name: str) -> None:
        self.repository.delete_record(name)


_ZEROS = bytes(4 << 20)


def _zeros(n: int) -> bytes | memoryview:
    """n zero bytes without allocating for the common sizes (a view of one shared buffer)."""
    return memoryview(_ZEROS)[:n] if n <= len(_ZEROS) else bytes(n)


class BlobReader:
    """Random-access reads over one manifest (whole artifact or a delta)."""

    def __init__(self, store: Store, manifest: Manifest, cache: bool = True) -> None:
        self.store = store
        self.manifest = manifest
        self.size = manifest.size
        self.cache = cache
        self._pinned = False

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) clipped at the size; zero extents read as
        zeros. In a delta manifest, a gap raises NotFound (the caller resolves it
        from the parent); in a full manifest a gap reads as zeros."""
        if offset < 0 or length < 0:
            raise ValueError(f"negative offset/length ({offset}, {length})")
        end = min(offset + length, self.size)
        if offset >= end:
            return b""
        extents = self.manifest.extents_in(offset, end - offset)
        datas = self.store.read_chunks([e.chunk for e in extents if e.chunk is not None], self.cache)
        # pieces joined once at the end: no zero-filled buffer to overwrite, no final copy
        # of it into bytes (both were ~28% of a cold 4 MiB read)
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
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return parts[0]
        return b"".join(parts)

    def _gap(self, a: int, b: int) -> None:
        if self.manifest.parent is not None:
            raise NotFound(f"range [{a}, {b}) is not in delta manifest {self.manifest.id.short()} "
                           f"(read it from parent {self.manifest.parent.short()})")

    def extents(self) -> tuple[Extent, ...]:
        return self.manifest.extents

    def pin(self) -> None:
        if self.store.cache is not None and not self._pinned:
            self.store.cache.pin(set(self.manifest.chunks))
            self._pinned = True

    def unpin(self) -> None:
        if self.store.cache is not None and self._pinned:
            self.store.cache.unpin(set(self.manifest.chunks))
            self._pinned = False
