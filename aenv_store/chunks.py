"""The read chain: every chunk a node reads comes node cache -> peers -> repository.

``ChunkChain`` consults the node cache once per chunk; the misses go to the chunk
sources in the order they were added (P2P peers: ``aenv_store.p2p.source``), and
what they do not have to the repository (neighbouring chunks of one pack with one
range read, runs in parallel). Every chunk is checked against its BLAKE3 id
before anyone sees it (the repository checks what it decodes, the chain checks
what sources return), then stored in the node cache.

Single flight and the integrity of cached files are the node cache's
(``NodeCache.get_or_fetch_many``): one fetch per missing chunk however many
threads and processes of the node ask at once, for single and batched reads;
cached files are checked against their index entry (size, xxh3) when read or
mapped, and a torn or tampered one is dropped and fetched again.

A ``ChunkSource`` is anything between the cache and the repository that may
have a chunk: it answers with what it could get, never fails a read.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Protocol, Sequence

import blake3
import zstandard

from .cache.node_cache import ChunkData, NodeCache
from .errors import StoreNotFound
from .formats.ids import Digest
from .formats.index import IndexEntry
from .repository.repository import Repository, coalesce

log = logging.getLogger(__name__)

READ_THREADS = 4  # range reads of one batch in flight at once (I/O: more than the CPUs)
# zstd + BLAKE3 of the parts of a run (Repository.read_run), beside the thread that read
# it: both drop the GIL, so one per CPU is what can run at once
DECODE_THREADS = os.cpu_count() or 1


class ChunkSource(Protocol):
    """A source of committed chunks between the node cache and the repository."""

    def fetch_many(self, cids: list[Digest]) -> Mapping[Digest, bytes]:
        """The chunks of ``cids`` this source could get (in time); absent ones are left out.
        Never raises for a chunk it does not have or cannot reach: the repository follows."""
        ...

    def close(self) -> None: ...


class ChunkChain:
    """Node cache -> sources -> repository, for one node's Store. Thread-safe."""

    def __init__(self, repository: Repository, cache: NodeCache | None,
                 sources: Sequence[ChunkSource] = ()) -> None:
        self.repository = repository
        self.cache = cache
        self._sources: list[ChunkSource] = list(sources)
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._decode: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def sources(self) -> tuple[ChunkSource, ...]:
        return tuple(self._sources)

    def add_source(self, source: ChunkSource) -> None:
        """Consult ``source`` after those added before, before the repository; the chain
        closes it."""
        self._sources.append(source)

    def close(self) -> None:
        with self._pool_lock:
            pools, self._pool, self._decode = (self._pool, self._decode), None, None
        for pool in pools:  # readers first: their runs may still hand parts to the decoders
            if pool is not None:
                pool.shutdown(wait=True)
        for source in self._sources:
            source.close()
        self._sources.clear()

    # -- reads -----------------------------------------------------------------------

    def read(self, cid: Digest) -> bytes:
        return self.read_many([cid])[0]

    def read_many(self, cids: Sequence[Digest], cache: bool = True) -> list[bytes]:
        """Plaintexts of ``cids`` (in the order asked, duplicates allowed). ``cache=False``:
        cached chunks are used, misses are fetched but not stored (one-pass bulk reads
        that should not evict a node's working set; with nothing stored there is no
        fetch for others to share, so these misses are not single-flight)."""
        if self.cache is None:
            return self._fetch_each(cids)
        if cache:
            return self.cache.get_or_fetch_many(cids, self._fetch)
        have = self.cache.get_many(cids)
        missing = list(dict.fromkeys(c for c, data in zip(cids, have) if data is None))
        fetched = dict(zip(missing, self._fetch(missing))) if missing else {}
        return [data if data is not None else fetched[c] for c, data in zip(cids, have)]

    def map_many(self, cids: Sequence[Digest]) -> list[ChunkData]:
        """Like read_many, but chunks in the node cache come back as read-only mappings of
        their files, checked against the index when mapped (no copy; the page cache holds
        the bytes for every reader on the node); plain bytes without a node cache."""
        if self.cache is None:
            return list(self._fetch_each(cids))
        return self.cache.get_or_fetch_many(cids, self._fetch, mapped=True)

    def fetch_from_repository(self, cid: Digest) -> bytes:
        """One chunk straight from the repository (a range read of exactly its bytes),
        verified; no cache, no peers (what a node serves to its peers)."""
        return self.repository.read_chunk(cid, self._dctx())

    # -- misses ----------------------------------------------------------------------

    def _fetch_each(self, cids: Sequence[Digest]) -> list[bytes]:
        unique = list(dict.fromkeys(cids))
        got = dict(zip(unique, self._fetch(unique)))
        return [got[c] for c in cids]

    def _fetch(self, cids: list[Digest]) -> list[bytes]:
        """Verified plaintexts of distinct ``cids``: sources first, then the repository."""
        got: dict[bytes, bytes] = {}
        for source in self._sources:
            want = [c for c in cids if c not in got]
            if not want:
                break
            asked = set(want)
            for cid, data in source.fetch_many(want).items():
                if cid not in asked or blake3.blake3(data).digest() != cid:
                    log.warning("chunk source %s returned chunk %s unasked or with other content; ignored",
                                type(source).__name__, bytes(cid).hex()[:16])
                    continue
                got[cid] = data
        rest = [c for c in cids if c not in got]
        if rest:
            got.update(zip(rest, self._from_repository(rest)))
        return [got[c] for c in cids]

    def _from_repository(self, cids: list[Digest]) -> list[bytes]:
        if len(cids) == 1:
            return [self.fetch_from_repository(cids[0])]
        entries = [e for e in self.repository.lookup_many(cids) if e is not None]
        runs = coalesce(entries)
        datas = [self._read_run(runs[0])] if len(runs) == 1 else list(self._read_pool().map(self._read_run, runs))
        got = {bytes(e.chunk): data for run, run_datas in zip(runs, datas) for e, data in zip(run, run_datas)}
        # chunks the index did not know: read_chunk reloads the index files first
        return [got[c] if c in got else self.fetch_from_repository(c) for c in cids]

    def _read_run(self, run: list[IndexEntry]) -> list[bytes]:
        try:
            return self.repository.read_run(run, self._dctx(), self._decode_pool())
        except StoreNotFound:  # the pack is gone (gc repacked it): chunk by chunk, which re-resolves them
            return [self.fetch_from_repository(Digest(e.chunk)) for e in run]

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d: zstandard.ZstdDecompressor | None = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = zstandard.ZstdDecompressor()
        return d

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="aenv-store-read")
            return self._pool

    def _decode_pool(self) -> ThreadPoolExecutor | None:
        """Decoders for the parts of a run; a separate pool, so a reader waiting for its
        parts never waits for a thread that another waiting reader holds."""
        if DECODE_THREADS < 2:
            return None
        with self._pool_lock:
            if self._decode is None:
                self._decode = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="aenv-store-decode")
            return self._decode
