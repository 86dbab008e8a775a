"""Builder workspace: a local staging area where artifacts are written before
they exist anywhere else, then published by ``commit()``.

Layout of ``<data-dir>/workspace/<uuid>/``: ``lock`` (flock held while the
workspace is alive, so a killed owner's directory is recognisably stale),
``pack-<n>`` (packs being written, sequentially), ``blob-<n>.scratch`` (sparse
files holding partially written chunks of random-access writers). Nothing in
the repository changes before ``commit()``; commit order and crash safety:
docs/store-format.md."""
from __future__ import annotations

import fcntl
import itertools
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import blake3
import zstandard

from .config import StoreConfig
from .errors import AlreadyExists, StoreNotFound, StoreError
from .formats import pack as packfmt
from .formats.catalog import CatalogRecord
from .formats.chunker import add_range, merge_zero_runs, pieces, zero_digest
from .formats.ids import Digest
from .formats.index import IndexEntry
from .formats.manifest import BLOB, Extent, Manifest, check_chunk_size
from .repository.repository import RecordVersion, Repository, pack_key

log = logging.getLogger(__name__)

STALE_UNLOCKED_AGE = 3600.0
STAGE_BATCH = 64  # whole chunks compressed concurrently per batch (bounds memory to ~64 payloads)
# Ingest pipeline (BlobWriter with an executor): whole chunks go to the pool in jobs of
# PIPELINE_JOB chunks (hash + zero check + zstd off the caller's thread, which meanwhile
# reads its next block); at most PIPELINE_DEPTH jobs are in flight (16 x 64 KiB x 8 = 8 MiB
# of payloads at the default chunk size) and they are staged in submission order.
PIPELINE_JOB = 16
PIPELINE_DEPTH = 8

_tls = threading.local()


def _compress(data: bytes | memoryview, level: int) -> bytes | memoryview:
    """encode_payload with a per-thread compressor (zstd contexts are not thread-safe)."""
    cctx = getattr(_tls, "cctx", None)
    if cctx is None or _tls.level != level:
        cctx = _tls.cctx = zstandard.ZstdCompressor(level=level)
        _tls.level = level
    return packfmt.encode_payload(data, cctx)  # a workspace dir without a lock file is stale after this long


@dataclass(frozen=True)
class CommitResult:
    manifests: tuple[Digest, ...]
    packs_added: int
    bytes_added: int
    chunks_added: int
    chunks_deduped: int


@dataclass
class _StagedPack:
    path: Path
    writer: packfmt.PackWriter | None  # None once finished
    pack_id: Digest | None = None


def clean_stale_workspaces(root: Path) -> int:
    """Remove workspace dirs whose owner is gone (lock not held). Returns how many."""
    if not root.is_dir():
        return 0
    removed = 0
    for d in root.iterdir():
        if not d.is_dir():
            continue
        try:
            age = time.time() - d.stat().st_mtime
        except FileNotFoundError:
            continue
        if d.name.startswith(".new-") and age < STALE_UNLOCKED_AGE:
            continue  # being created: its lock may not be taken yet
        lock = d / "lock"
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            # a crash before the lock existed
            if age > STALE_UNLOCKED_AGE:
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
        finally:
            os.close(fd)
    return removed


class Workspace(AbstractContextManager["Workspace"]):
    """Stages chunks into local packs and manifests; ``commit()`` publishes them."""

    def __init__(self, root: Path, repository: Repository, config: StoreConfig,
                 read_committed: Callable[[Digest], bytes], chunk_size: int | None = None,
                 executor: Executor | None = None) -> None:
        self.repository = repository
        self.config = config
        self.chunk_size = check_chunk_size(chunk_size or config.chunk_size)
        self._read_committed = read_committed
        root.mkdir(parents=True, exist_ok=True)
        self.id = uuid.uuid4().hex
        # Create under a dot name, lock, then rename: a cleaner never sees an unlocked new dir.
        tmp = root / f".new-{self.id}"
        tmp.mkdir()
        self._lock_fd = os.open(tmp / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path = root / self.id
        os.rename(tmp, self.path)
        try:
            # shared repository lock for the workspace's life: gc (exclusive) waits for it
            self._repo_lock = repository.writer_lock()
            self._repo_lock.__enter__()
            # gc may have run since the index was loaded (it cannot run again while we
            # hold the lock): dedup must not trust entries for packs it deleted
            # (refresh_index rebuilds the merged index when index files were removed)
            try:
                repository.refresh_index()
            except BaseException:
                self._repo_lock.__exit__(None, None, None)
                raise
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            raise
        self._level = config.compression_level
        self._cctx = zstandard.ZstdCompressor(level=self._level)
        self._executor = executor
        self._dctx = zstandard.ZstdDecompressor()
        self._packs: list[_StagedPack] = []
        self._current: packfmt.PackWriter | None = None
        self._staged: dict[bytes, tuple[int, packfmt.PackEntry]] = {}
        self._manifests: dict[bytes, Manifest] = {}
        self._writers: set[BlobWriter] = set()
        self._blob_no = 0
        self._published = False
        self.state = "open"  # open | committed | aborted
        self.chunks_added = 0
        self.chunks_deduped = 0
        self.bytes_added = 0

    def __repr__(self) -> str:
        return f"Workspace({self.id}, {self.state})"

    # -- staging -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.state != "open":
            raise StoreError(f"workspace {self.id} is {self.state}")

    def _check_staging(self) -> None:
        self._check_open()
        if self._published:
            # its packs are in the repository already; only commit(record) may be retried
            raise StoreError(f"workspace {self.id} is published: nothing more can be staged")

    def stage(self, data: bytes | memoryview) -> Digest | None:
        """Stage one chunk's plaintext; None if it is all zeros (never stored).
        Dedups against the repository index and this workspace."""
        return self.stage_many([data])[0]

    def stage_many(self, chunks: Sequence[bytes | memoryview]) -> list[Digest | None]:
        """Stage several chunks (in order). Hashing and dedup run inline (BLAKE3
        is ~4 GB/s); zstd, the slow part, runs on the store's thread pool when
        there is more than one new chunk, and packs are still written in order."""
        self._check_staging()
        out: list[Digest | None] = []
        new: list[tuple[Digest, bytes | memoryview]] = []
        batch: set[bytes] = set()
        lookup = self.repository.index.lookup
        for data in chunks:
            n = len(data)
            if n == 0:
                raise ValueError("empty chunk")
            raw = blake3.blake3(data).digest()
            if raw == zero_digest(n):
                out.append(None)
                continue
            cid = Digest(raw)
            out.append(cid)
            if raw in self._staged or raw in batch or lookup(raw) is not None:
                self.chunks_deduped += 1
                continue
            batch.add(raw)
            new.append((cid, data))
        if len(new) > 1 and self._executor is not None:
            payloads: Iterable[bytes | memoryview] = self._executor.map(_compress, (d for _, d in new),
                                                                      itertools.repeat(self._level))
        else:
            payloads = (packfmt.encode_payload(d, self._cctx) for _, d in new)
        for (cid, data), payload in zip(new, payloads):
            self._append(cid, payload, len(data))
        return out

    def _prepare(self, chunks: Sequence[bytes | memoryview]) -> list[tuple[bytes, bytes | memoryview | None]]:
        """Worker-thread half of staging: (BLAKE3, zstd payload) per chunk; the payload
        is None when the chunk is all zeros or already known (no zstd spent on dedup hits).
        BLAKE3 and zstd release the GIL, so several of these run in parallel."""
        out: list[tuple[bytes, bytes | memoryview | None]] = []
        lookup = self.repository.index.lookup
        staged = self._staged  # read-only here; the caller's thread is the only writer
        for data in chunks:
            raw = blake3.blake3(data).digest()
            known = raw == zero_digest(len(data)) or raw in staged or lookup(raw) is not None
            out.append((raw, None if known else _compress(data, self._level)))
        return out

    def _stage_prepared(self, chunks: Sequence[bytes | memoryview],
                        prepared: list[tuple[bytes, bytes | memoryview | None]]) -> list[Digest | None]:
        """Caller-thread half: dedup and pack append in order (same result as stage_many)."""
        self._check_staging()
        out: list[Digest | None] = []
        lookup = self.repository.index.lookup
        for data, (raw, payload) in zip(chunks, prepared):
            n = len(data)
            if raw == zero_digest(n):
                out.append(None)
                continue
            cid = Digest(raw)
            out.append(cid)
            if raw in self._staged or lookup(raw) is not None:
                self.chunks_deduped += 1
                continue
            if payload is None:  # known when prepared, gone since (index reloaded): compress now
                payload = packfmt.encode_payload(data, self._cctx)
            self._append(cid, payload, n)
        return out

    def _append(self, cid: Digest, payload: bytes | memoryview, raw_length: int) -> None:
        if self._current is None:
            path = self.path / f"pack-{len(self._packs)}"
            self._current = packfmt.PackWriter(path)
            self._packs.append(_StagedPack(path, self._current))
        entry = self._current.add(cid, payload, raw_length)
        self._staged[bytes(cid)] = (len(self._packs) - 1, entry)
        self.chunks_added += 1
        self.bytes_added += len(payload)
        if self._current.payload_bytes >= self.config.pack_target_size:
            self._finish_pack()

    def put_chunk(self, data: bytes) -> Digest:
        """Stage one chunk and return its id. All-zero data is not stored: use a
        zero extent for it in manifests (the id returned is then ``zero_digest(len(data))``)."""
        cid = self.stage(data)
        return cid if cid is not None else Digest(zero_digest(len(data)))

    def _finish_pack(self) -> None:
        if self._current is None:
            return
        staged = self._packs[-1]
        staged.pack_id = self._current.finish()
        staged.writer = None
        self._current = None

    def has_chunk(self, chunk: bytes) -> bool:
        return bytes(chunk) in self._staged or self.repository.has_chunk(chunk)

    def read_chunk(self, chunk: Digest) -> bytes:
        """Plaintext of a staged or committed chunk (for read-modify-write)."""
        hit = self._staged.get(bytes(chunk))
        if hit is None:
            return self._read_committed(chunk)
        pack_no, entry = hit
        staged = self._packs[pack_no]
        if staged.writer is not None:
            payload = staged.writer.read_payload(entry)
        else:
            with open(staged.path, "rb") as f:
                f.seek(entry.offset)
                payload = f.read(entry.length)
        return packfmt.decode_payload(payload, entry, self._dctx)

    def blob_writer(self, media_type: str = BLOB, size: int | None = None, parent: Digest | None = None,
                    meta: dict[str, str] | None = None, chunk_size: int | None = None) -> "BlobWriter":
        self._check_staging()
        w = BlobWriter(self, media_type, size, parent, meta or {}, check_chunk_size(chunk_size or self.chunk_size),
                       self.path / f"blob-{self._blob_no}.scratch")
        self._blob_no += 1
        self._writers.add(w)
        return w

    def add_manifest(self, manifest: Manifest) -> Digest:
        """Stage a manifest; its chunks and parent must be staged here or committed."""
        self._check_staging()
        for e in manifest.extents:
            if e.chunk is not None and not self.has_chunk(e.chunk):
                if bytes(e.chunk) == zero_digest(e.length):
                    raise ValueError(f"extent at {e.offset} references the all-zero chunk: use a zero extent")
                raise StoreNotFound(f"manifest references chunk {e.chunk.hex()} that is neither staged nor committed")
        if manifest.parent is not None and bytes(manifest.parent) not in self._manifests \
                and not self.repository.has_manifest(manifest.parent):
            raise StoreNotFound(f"parent manifest {manifest.parent.hex()} is neither staged nor committed")
        mid = manifest.id
        self._manifests.setdefault(bytes(mid), manifest)
        return mid

    # -- commit / abort ----------------------------------------------------------

    def commit(self, record: CatalogRecord | None = None, exclusive: bool = True,
               replaces: RecordVersion | None = None) -> CommitResult:
        """Publish: packs -> index -> manifests -> catalog record, each durable.
        ``replaces``: the record is written only over that version of it (``Conflict``
        otherwise; what was published stays, unreferenced, for gc)."""
        self._check_open()
        if self._writers:
            raise StoreError(f"{len(self._writers)} blob writer(s) still open: close them before commit")
        repo = self.repository
        if record is not None:
            for role, mid in record.manifests:
                if bytes(mid) not in self._manifests and not repo.has_manifest(mid):
                    raise StoreNotFound(f"record {record.name!r}: manifest {role}={bytes(mid).hex()} does not exist")
            if exclusive and replaces is None and repo.backend.exists(f"catalog/{record.name}"):
                # fail before uploading anything; create() below stays the real arbiter
                raise AlreadyExists(f"catalog record {record.name!r} already exists")
        packs_added = 0
        if not self._published:
            self._finish_pack()
            entries: list[IndexEntry] = []
            for staged in self._packs:
                assert staged.pack_id is not None
                if not repo.has_pack(staged.pack_id):
                    # a finished pack is never touched again: posix_fs renames it into place
                    repo.backend.move_file(pack_key(staged.pack_id), staged.path)
                    packs_added += 1
            for raw, (pack_no, e) in self._staged.items():
                pid = self._packs[pack_no].pack_id
                assert pid is not None
                entries.append(IndexEntry(e.chunk, pid, e.offset, e.length, e.raw_length))
            if entries:
                repo.write_index(entries)
            for m in self._manifests.values():
                repo.put_manifest(m)
            self._published = True
        if record is not None and replaces is not None:
            repo.swap_record(record, replaces)
        elif record is not None:
            repo.put_record(record, exclusive=exclusive)
        result = CommitResult(
            manifests=tuple(Digest(m) for m in self._manifests),
            packs_added=packs_added, bytes_added=self.bytes_added,
            chunks_added=self.chunks_added, chunks_deduped=self.chunks_deduped,
        )
        self._close("committed")
        return result

    def abort(self) -> None:
        if self.state == "open":
            self._close("aborted")

    def _close(self, state: str) -> None:
        for w in list(self._writers):
            w._discard()
        self._writers.clear()
        for staged in self._packs:
            if staged.writer is not None:
                staged.writer.discard()
        self._current = None
        self.state = state
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self._repo_lock.__exit__(None, None, None)
        finally:
            os.close(self._lock_fd)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.abort()

    def __del__(self) -> None:
        if getattr(self, "state", None) == "open":
            try:
                self.abort()
            except Exception:  # interpreter shutdown: the next open cleans the dir
                pass


class BlobWriter:
    """Streaming writer of one artifact. Whole aligned chunks are staged as
    they arrive; partial chunks wait in a sparse scratch file on local disk
    (read-modify-write), so memory stays bounded by one chunk.

    Full blob (no parent): unwritten ranges read as zeros. Delta (parent set):
    unwritten ranges are gaps (taken from the parent); ``write_zeros`` marks
    explicit zeros that mask the parent."""

    def __init__(self, ws: Workspace, media_type: str, size: int | None, parent: Digest | None,
                 meta: dict[str, str], chunk_size: int, scratch: Path) -> None:
        if size is not None and size < 0:
            raise ValueError(f"negative size {size}")
        self.ws = ws
        self.media_type = media_type
        self.fixed_size = size
        self.parent = parent
        self.meta = tuple(sorted((str(k), str(v)) for k, v in meta.items()))
        self.chunk_size = chunk_size
        self._scratch_path = scratch
        self._scratch_fd: int | None = None
        self._done: dict[int, tuple[Digest | None, int]] = {}     # sealed chunk -> (id or None=zeros, length)
        self._partial: dict[int, list[tuple[int, int]]] = {}     # chunk -> written [a, b) within it
        self._end = 0
        # pipelined whole chunks: (chunk numbers, their data, the worker's result)
        self._inflight: deque[tuple[list[int], list[memoryview], Future[list[tuple[bytes, bytes | memoryview | None]]]]] = deque()
        self.closed = False
        # check the manifest fields now, not after streaming gigabytes
        Manifest(media_type, size or 0, (), parent, chunk_size, self.meta)

    @property
    def size(self) -> int:
        return self.fixed_size if self.fixed_size is not None else self._end

    def _chunk_len(self, k: int) -> int:
        if self.fixed_size is None:
            return self.chunk_size
        return min(self.chunk_size, self.fixed_size - k * self.chunk_size)

    def _check(self, offset: int, length: int) -> None:
        if self.closed:
            raise StoreError("blob writer is closed")
        self.ws._check_open()
        if offset < 0 or length < 0:
            raise ValueError(f"negative offset/length ({offset}, {length})")
        if self.fixed_size is not None and offset + length > self.fixed_size:
            raise ValueError(f"write [{offset}, {offset + length}) beyond blob size {self.fixed_size}")

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" \
            else data
        self._check(offset, len(mv))
        if self.ws._executor is not None and not isinstance(mv.obj, bytes) and len(mv) >= self.chunk_size:
            # whole chunks stay referenced after we return (pipeline): the caller may
            # reuse a bytearray/mmap buffer, so take an immutable copy once per call
            mv = memoryview(mv.tobytes())
        i = 0
        cs = self.chunk_size
        whole: list[tuple[int, memoryview]] = []  # full chunks, staged in batches
        for k, within, n in pieces(offset, len(mv), cs):
            piece = mv[i:i + n]
            i += n
            if within == 0 and n == self._chunk_len(k):
                whole.append((k, piece))
                if len(whole) >= STAGE_BATCH:
                    self._stage_whole(whole)
            else:
                self._stage_whole(whole)
                self._write_partial(k, within, piece)
        self._stage_whole(whole)
        self._end = max(self._end, offset + len(mv))

    def _stage_whole(self, whole: list[tuple[int, memoryview]]) -> None:
        if not whole:
            return
        ex = self.ws._executor
        if ex is None:
            for (k, piece), cid in zip(whole, self.ws.stage_many([p for _, p in whole])):
                self._partial.pop(k, None)
                self._done[k] = (cid, len(piece))
            whole.clear()
            return
        self.ws._check_staging()
        for j in range(0, len(whole), PIPELINE_JOB):
            job = whole[j:j + PIPELINE_JOB]
            ks = [k for k, _ in job]
            datas = [p for _, p in job]
            for k in ks:
                # a whole-chunk write replaces whatever partial data the chunk had
                self._partial.pop(k, None)
            self._inflight.append((ks, datas, ex.submit(self.ws._prepare, datas)))
            self._reap(PIPELINE_DEPTH)
        whole.clear()

    def _reap(self, depth: int) -> None:
        """Stage finished jobs in order; block on the oldest while more than ``depth`` are in flight."""
        q = self._inflight
        while q and (len(q) > depth or q[0][2].done()):
            ks, datas, fut = q[0]
            prepared = fut.result()
            q.popleft()
            for k, data, cid in zip(ks, datas, self.ws._stage_prepared(datas, prepared)):
                self._done[k] = (cid, len(data))

    def _drain(self) -> None:
        """Everything in flight staged: needed before _done is read or changed out of order."""
        self._reap(0)

    def append(self, data: bytes | bytearray | memoryview) -> None:
        self.write(self._end, data)

    def write_zeros(self, offset: int, length: int) -> None:
        self._check(offset, length)
        self._drain()
        for k, within, n in pieces(offset, length, self.chunk_size):
            if within == 0 and n == self._chunk_len(k):
                self._partial.pop(k, None)
                self._done[k] = (None, n)
            else:
                self._write_partial(k, within, bytes(n))
        self._end = max(self._end, offset + length)

    def _scratch(self) -> int:
        if self._scratch_fd is None:
            self._scratch_fd = os.open(self._scratch_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return self._scratch_fd

    def _pwrite(self, data: bytes | memoryview, pos: int) -> None:
        fd = self._scratch()
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n

    def _pread(self, pos: int, length: int) -> bytes:
        data = os.pread(self._scratch(), length, pos)
        if len(data) < length:  # a hole at the end of the sparse file
            data += bytes(length - len(data))
        return data

    def _write_partial(self, k: int, within: int, piece: bytes | memoryview) -> None:
        self._drain()
        base = k * self.chunk_size
        if k in self._done:
            # read-modify-write of a sealed chunk: bring its bytes back to scratch
            cid, length = self._done.pop(k)
            self._pwrite(bytes(length) if cid is None else self.ws.read_chunk(cid), base)
            self._partial[k] = [(0, length)]
        self._pwrite(piece, base + within)
        ranges = add_range(self._partial.get(k, []), within, within + len(piece))
        full = self._chunk_len(k)
        if ranges == [(0, full)]:  # the chunk is complete: stage it now, keep scratch small
            self._partial.pop(k, None)
            self._done[k] = (self.ws.stage(self._pread(base, full)), full)
        else:
            self._partial[k] = ranges

    def close(self) -> Digest:
        """Seal the remaining partial chunks, stage the manifest, return its id."""
        if self.closed:
            raise StoreError("blob writer is closed")
        self.ws._check_open()
        self._drain()
        size = self.size
        cs = self.chunk_size
        delta = self.parent is not None
        extents: list[Extent] = []
        for k in sorted(set(self._done) | set(self._partial)):
            base = k * cs
            if k in self._done:
                cid, length = self._done[k]
                extents.append(Extent(base, length, cid))
            elif delta:
                for a, b in self._partial[k]:
                    extents.append(Extent(base + a, b - a, self.ws.stage(self._pread(base + a, b - a))))
            else:
                length = min(cs, size - base)
                extents.append(Extent(base, length, self.ws.stage(self._pread(base, length))))
        if not delta:
            # full blob: everything not written is zeros
            filled: list[Extent] = []
            pos = 0
            for e in extents:
                if e.offset > pos:
                    filled.append(Extent(pos, e.offset - pos, None))
                filled.append(e)
                pos = e.end
            if pos < size:
                filled.append(Extent(pos, size - pos, None))
            extents = filled
        manifest = Manifest(self.media_type, size, tuple(merge_zero_runs(extents)), self.parent, cs, self.meta)
        mid = self.ws.add_manifest(manifest)
        self._discard()
        return mid

    def _discard(self) -> None:
        self.closed = True
        for _, _, fut in self._inflight:
            # abandoned: let running jobs finish (they only read their own data), drop results
            fut.cancel()
        self._inflight.clear()
        self.ws._writers.discard(self)
        if self._scratch_fd is not None:
            os.close(self._scratch_fd)
            self._scratch_fd = None
            self._scratch_path.unlink(missing_ok=True)
        self._done.clear()
        self._partial.clear()

    def __enter__(self) -> "BlobWriter":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None and not self.closed:
            self.close()
        elif not self.closed:
            self._discard()
