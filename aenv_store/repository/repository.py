"""The repository: packs, index files, manifests and catalog records on a Backend.

Key layout and encodings: docs/store-format.md. This layer knows the formats
and the merged index; it has no local state besides that index (the workspace
and the node cache live elsewhere)."""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import blake3
import zstandard

from ..errors import AlreadyExists, CorruptData, StoreNotFound, RepositoryError
from ..formats import pack as packfmt
from ..formats.catalog import CatalogRecord, check_name
from ..formats.ids import Digest
from ..formats.index import IndexEntry, IndexFile, MergedIndex, decode_index, encode_index
from ..formats.manifest import Manifest, check_chunk_size
from .backends.base import Backend, ObjectInfo
from .locks import shared_lock

log = logging.getLogger(__name__)

FORMAT = "aenv-repository"
VERSION = 1
CONFIG_KEY = "config"
PACKS = "packs/"
INDEX = "index/"
MANIFESTS = "manifests/"
CATALOG = "catalog/"
LOCKS = "locks/"  # owned by aenv_store.repository.locks
# plaintext per decode task of a run (read_run with a pool): 8 chunks of 64 KiB, so a
# task (~0.5 ms of zstd + BLAKE3) outweighs handing it to another thread (~20 µs)
PART_BYTES = 512 << 10


def pack_key(pid: bytes) -> str:
    h = bytes(pid).hex()
    return f"{PACKS}{h[:2]}/{h}"


def index_key(iid: bytes) -> str:
    return f"{INDEX}{bytes(iid).hex()}"


def manifest_key(mid: bytes) -> str:
    h = bytes(mid).hex()
    return f"{MANIFESTS}{h[:2]}/{h}"


def catalog_key(name: str) -> str:
    return CATALOG + check_name(name)


def id_from_key(key: str) -> Digest | None:
    """The id in a pack/index/manifest key, or None if the key is not one."""
    try:
        return Digest.from_hex(key.rsplit("/", 1)[-1])
    except ValueError:
        return None


@dataclass(frozen=True)
class RepoConfig:
    id: str
    chunk_size: int
    created: float
    version: int = VERSION

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "version": self.version, "id": self.id,
                           "chunk_size": self.chunk_size, "created": self.created},
                          sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> "RepoConfig":
        try:
            obj = json.loads(data)
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise ValueError("not an aenv repository config")
            version = obj.get("version")
            if version != VERSION:
                raise RepositoryError(f"repository at {where} has format version {version!r}; "
                                      f"this aenv reads version {VERSION}")
            cfg = cls(id=str(obj["id"]), chunk_size=check_chunk_size(obj["chunk_size"]),
                      created=float(obj["created"]))
        except RepositoryError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise RepositoryError(f"corrupt repository config at {where}: {e}") from None
        return cfg


@dataclass(frozen=True)
class RepoStats:
    packs: int
    pack_bytes: int
    index_files: int
    index_entries: int
    raw_bytes: int
    manifests: int
    records: int



@dataclass(frozen=True)
class RecordVersion:
    """A catalog record's stored bytes as read (``raw`` None: there was no such record)."""
    name: str
    raw: bytes | None

    def record(self) -> CatalogRecord | None:
        return CatalogRecord.decode(self.raw) if self.raw is not None else None

class Repository:
    """Formats + merged index over one Backend. Thread-safe for reads."""

    def __init__(self, backend: Backend, config: RepoConfig, where: str) -> None:
        self.backend = backend
        self.config = config
        self.where = where
        self.index = MergedIndex()
        self._loaded_index: set[str] = set()
        self.bad_index_files: dict[str, str] = {}
        self._lock = threading.Lock()
        self._tls = threading.local()

    # -- lifecycle -----------------------------------------------------------------

    @classmethod
    def init(cls, backend: Backend, chunk_size: int, where: str) -> "Repository":
        check_chunk_size(chunk_size)
        config = RepoConfig(id=uuid.uuid4().hex, chunk_size=chunk_size, created=time.time())
        try:
            backend.create(CONFIG_KEY, config.encode())
        except AlreadyExists:
            raise RepositoryError(f"a repository already exists at {where}") from None
        return cls(backend, config, where)

    @classmethod
    def open(cls, backend: Backend, where: str, load_index: bool = True) -> "Repository":
        """Open an existing repository; ``load_index=False`` skips reading the index
        files (catalog / manifest work only; lookups then see nothing until
        ``refresh_index``)."""
        try:
            data = backend.get(CONFIG_KEY)
        except StoreNotFound:
            raise RepositoryError(f"no repository at {where}; run `aenv repo init`") from None
        repo = cls(backend, RepoConfig.decode(data, where), where)
        if load_index:
            repo.refresh_index()
        return repo

    def close(self) -> None:
        self.backend.close()

    def writer_lock(self) -> AbstractContextManager[object]:
        """Shared repository lock held by a workspace from staging to commit (locks.py)."""
        return shared_lock(self.backend, f"workspace-{uuid.uuid4().hex[:8]}")

    # -- index -------------------------------------------------------------------

    def refresh_index(self) -> int:
        """Load index files not loaded yet (e.g. written by other processes).
        Corrupt ones are skipped and remembered in ``bad_index_files``.

        If an index file we loaded is gone, gc has replaced it (its packs may be
        deleted or repacked): the merged index is then rebuilt from the files
        that exist now, so no stale entry makes a writer skip uploading a chunk
        that no longer exists ("dedup against a ghost")."""
        with self._lock:
            listed = list(self.backend.list(INDEX))
            rebuild = bool(self._loaded_index - {info.key for info in listed})
            loaded = set() if rebuild else self._loaded_index
            files: list[IndexFile] = []
            for info in listed:
                if info.key in loaded or info.key in self.bad_index_files:
                    continue
                try:
                    data = self.backend.get(info.key)
                    iid = id_from_key(info.key)
                    if iid is None or blake3.blake3(data).digest() != iid:
                        raise CorruptData("content does not match its name")
                    files.append(decode_index(data))
                except StoreNotFound:
                    continue
                except CorruptData as e:
                    log.warning("skipping index file %s: %s", info.key, e)
                    self.bad_index_files[info.key] = str(e)
                    continue
                loaded.add(info.key)
            if rebuild:
                index = MergedIndex()
                index.add_files(files)
                # swapped whole: lock-free lookups see the old or the new index, never half
                self.index, self._loaded_index = index, loaded
                log.info("index files were replaced (gc); reloaded %d index files", len(files))
                return max(1, len(files))
            if files:
                self.index.add_files(files)
            return len(files)

    def lookup(self, chunk: bytes) -> IndexEntry | None:
        return self.index.lookup(chunk)

    def lookup_many(self, chunks: Sequence[bytes]) -> list[IndexEntry | None]:
        return self.index.lookup_many(chunks)

    def has_chunk(self, chunk: bytes) -> bool:
        return self.index.lookup(chunk) is not None

    def write_index(self, entries: list[IndexEntry]) -> Digest:
        data = encode_index(entries)
        iid = Digest.of(data)
        self.backend.put(index_key(iid), data)
        with self._lock:
            self._loaded_index.add(index_key(iid))
            self.index.add_entries(entries)
        return iid

    def rebuild_index(self) -> tuple[Digest | None, int]:
        """Write one index file from the trailers of every pack, then delete the
        index files that existed before. Returns (new index id, entries)."""
        old = [info.key for info in self.backend.list(INDEX)]
        entries: list[IndexEntry] = []
        for info in self.list_packs():
            pid = id_from_key(info.key)
            if pid is None:
                continue
            try:
                for e in self.read_pack_trailer(info):
                    entries.append(IndexEntry(e.chunk, pid, e.offset, e.length, e.raw_length))
            except (CorruptData, StoreNotFound) as e:
                log.warning("pack %s skipped in index rebuild: %s", info.key, e)
        iid = None
        if entries:
            data = encode_index(entries)
            iid = Digest.of(data)
            self.backend.put(index_key(iid), data)
        for key in old:
            if iid is None or key != index_key(iid):
                self.backend.delete(key)
        with self._lock:
            self.index = MergedIndex()
            self._loaded_index.clear()
            self.bad_index_files.clear()
        self.refresh_index()
        return iid, len(entries)

    # -- packs -------------------------------------------------------------------

    def list_packs(self) -> Iterator[ObjectInfo]:
        return self.backend.list(PACKS)

    def read_pack_trailer(self, info_or_id: ObjectInfo | bytes) -> list[packfmt.PackEntry]:
        if isinstance(info_or_id, ObjectInfo):
            key, size = info_or_id.key, info_or_id.size
        else:
            key = pack_key(info_or_id)
            size = self.backend.stat(key).size
        try:
            return packfmt.read_trailer(lambda off, n: self.backend.get_range(key, off, n), size)
        except CorruptData as e:
            raise CorruptData(f"pack {key}: {e}") from None

    def has_pack(self, pid: bytes) -> bool:
        return self.backend.exists(pack_key(pid))

    def read_chunk_entry(self, entry: IndexEntry, dctx: zstandard.ZstdDecompressor | None = None) -> bytes:
        """Plaintext of one indexed chunk, verified against its id."""
        payload = self.backend.get_range(pack_key(entry.pack), entry.offset, entry.length)
        return _decode_verified(entry, payload, dctx)

    def read_run(self, run: list[IndexEntry], dctx: zstandard.ZstdDecompressor | None = None,
                 pool: Executor | None = None, part_bytes: int = PART_BYTES) -> list[bytes]:
        """Plaintexts of index entries lying close together in one pack (see
        ``coalesce``), fetched with a single range read and each verified.

        ``pool``: decode and verify parts of the run on it while this thread does
        the first part (zstd and BLAKE3 drop the GIL, so a 4 MiB run uses every
        CPU instead of one). Its tasks never wait on anything, so any pool will do,
        even one whose other tasks call read_run. ``part_bytes``: plaintext per part."""
        start = run[0].offset
        end = max(e.offset + e.length for e in run)
        blob = self.backend.get_range(pack_key(run[0].pack), start, end - start)
        view = memoryview(blob)  # payload slices without copies (zstd and BLAKE3 take buffers)
        parts = [run] if pool is None else _split(run, part_bytes)
        if len(parts) == 1:
            return _decode_part(run, view, start, dctx)
        assert pool is not None
        rest = [pool.submit(self._decode_part, part, view, start) for part in parts[1:]]
        try:
            out = _decode_part(parts[0], view, start, dctx)
            for fut in rest:
                out += fut.result()
        finally:
            for fut in rest:  # a CorruptData in one part: do not leave the others running unseen
                fut.cancel()
        return out

    def _decode_part(self, part: list[IndexEntry], view: memoryview, start: int) -> list[bytes]:
        return _decode_part(part, view, start, self._thread_dctx())

    def _thread_dctx(self) -> zstandard.ZstdDecompressor:
        # a decompressor must not be used by two threads at once: one per pool thread
        d: zstandard.ZstdDecompressor | None = getattr(self._tls, "dctx", None)
        if d is None:
            d = self._tls.dctx = zstandard.ZstdDecompressor()
        return d

    def read_chunk(self, chunk: bytes, dctx: zstandard.ZstdDecompressor | None = None) -> bytes:
        entry = self.index.lookup(chunk)
        if entry is None:
            # look again even if this refresh loaded nothing: a concurrent reader's
            # refresh (we waited on its lock) may have loaded the file we need
            self.refresh_index()
            entry = self.index.lookup(chunk)
        if entry is None:
            raise StoreNotFound(f"chunk {bytes(chunk).hex()} is not in the repository index")
        try:
            return self.read_chunk_entry(entry, dctx)
        except StoreNotFound:
            # the pack went away after we loaded the index (gc repacked its live
            # chunks elsewhere): forget it, load newer index files, try once more
            self.pack_gone(entry.pack)
            moved = self.index.lookup(chunk)
            if moved is None:
                raise StoreNotFound(f"chunk {bytes(chunk).hex()}: its pack {entry.pack.hex()} is gone "
                               "and no index lists it elsewhere") from None
            return self.read_chunk_entry(moved, dctx)

    def pack_gone(self, pack: bytes) -> None:
        """A pack named by the index is missing: drop its entries, reload index files."""
        if self.backend.exists(pack_key(pack)):
            return
        with self._lock:
            dropped = self.index.drop_pack(pack)
        log.info("pack %s is gone: dropped %d index entries", bytes(pack).hex(), dropped)
        self.refresh_index()

    # -- manifests ---------------------------------------------------------------

    def put_manifest(self, manifest: Manifest) -> Digest:
        data = manifest.encode()
        mid = Digest.of(data)
        key = manifest_key(mid)
        if not self.backend.exists(key):
            self.backend.put(key, data)
        return mid

    def has_manifest(self, mid: bytes) -> bool:
        return self.backend.exists(manifest_key(mid))

    def get_manifest(self, mid: bytes) -> Manifest:
        try:
            data = self.backend.get(manifest_key(mid))
        except StoreNotFound:
            raise StoreNotFound(f"manifest {bytes(mid).hex()} not found") from None
        if blake3.blake3(data).digest() != mid:
            raise CorruptData(f"manifest {bytes(mid).hex()}: content does not match its id")
        return Manifest.decode(data, stored_as=Digest(mid))

    # -- catalog -----------------------------------------------------------------

    def put_record(self, record: CatalogRecord, exclusive: bool = True) -> None:
        key = catalog_key(record.name)
        if exclusive:
            try:
                self.backend.create(key, record.encode())
            except AlreadyExists:
                raise AlreadyExists(f"catalog record {record.name!r} already exists") from None
        else:
            self.backend.put(key, record.encode())

    def get_record_version(self, name: str) -> RecordVersion:
        """The record named ``name`` as stored now, for a later ``swap_record``."""
        try:
            data = self.backend.get(catalog_key(name))
        except StoreNotFound:
            return RecordVersion(name, None)
        return RecordVersion(name, data)

    def swap_record(self, record: CatalogRecord, replaces: RecordVersion) -> None:
        """Write ``record`` only if its name still holds what ``replaces`` read
        (``Conflict`` otherwise): a record with one holder at a time, like a sandbox's
        pause, is never overwritten by a holder that lost it in between."""
        if replaces.name != record.name:
            raise ValueError(f"swap of record {record.name!r} against a version of {replaces.name!r}")
        self.backend.swap(catalog_key(record.name), record.encode(), replaces.raw)

    def get_record(self, name: str) -> CatalogRecord:
        try:
            data = self.backend.get(catalog_key(name))
        except StoreNotFound:
            raise StoreNotFound(f"no catalog record named {name!r}") from None
        rec = CatalogRecord.decode(data)
        if rec.name != name:
            raise CorruptData(f"catalog record {name!r} holds a record named {rec.name!r}")
        return rec

    def list_record_names(self) -> list[str]:
        return sorted(info.key[len(CATALOG):] for info in self.backend.list(CATALOG)
                      if "/" not in info.key[len(CATALOG):])

    def list_records(self, kind: str | None = None) -> list[CatalogRecord]:
        out = []
        for name in self.list_record_names():
            try:
                rec = self.get_record(name)
            except StoreNotFound:  # deleted while listing
                continue
            if kind is None or rec.kind == kind:
                out.append(rec)
        return out

    def delete_record(self, name: str) -> None:
        key = catalog_key(name)
        if not self.backend.exists(key):
            raise StoreNotFound(f"no catalog record named {name!r}")
        self.backend.delete(key)

    # -- stats -------------------------------------------------------------------

    def stats(self) -> RepoStats:
        packs = list(self.list_packs())
        chunks, raw_bytes = self.index.summary()
        return RepoStats(
            packs=len(packs), pack_bytes=sum(p.size for p in packs),
            index_files=sum(1 for _ in self.backend.list(INDEX)),
            index_entries=chunks,
            raw_bytes=raw_bytes,
            manifests=sum(1 for _ in self.backend.list(MANIFESTS)),
            records=len(self.list_record_names()),
        )


def coalesce(entries: Iterable[IndexEntry], max_gap: int = 64 << 10,
             max_span: int = 8 << 20) -> list[list[IndexEntry]]:
    """Group index entries into runs readable with one range read each: same
    pack, sorted by offset, holes of at most ``max_gap`` bytes, at most
    ``max_span`` bytes per read (a restore or a VM's sequential reads become a
    few large reads instead of one request per chunk; on S3 that is latency)."""
    by_pack: dict[bytes, list[IndexEntry]] = {}
    for e in entries:
        by_pack.setdefault(bytes(e.pack), []).append(e)
    runs: list[list[IndexEntry]] = []
    for group in by_pack.values():
        group.sort(key=lambda e: e.offset)
        run = [group[0]]
        end = group[0].offset + group[0].length
        for e in group[1:]:
            if e.offset - end <= max_gap and e.offset + e.length - run[0].offset <= max_span:
                run.append(e)
            else:
                runs.append(run)
                run = [e]
            end = max(end, e.offset + e.length)
        runs.append(run)
    return runs


def _split(run: list[IndexEntry], part_bytes: int) -> list[list[IndexEntry]]:
    """``run`` cut into consecutive parts of at least ``part_bytes`` of plaintext (the
    last may be smaller)."""
    parts: list[list[IndexEntry]] = [[]]
    size = 0
    for e in run:
        if size >= part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(e)
        size += e.raw_length
    return parts


def _decode_part(part: list[IndexEntry], view: memoryview, start: int,
                 dctx: zstandard.ZstdDecompressor | None) -> list[bytes]:
    return [_decode_verified(e, view[e.offset - start:e.offset - start + e.length], dctx) for e in part]


def _decode_verified(entry: IndexEntry, payload: bytes | memoryview, dctx: zstandard.ZstdDecompressor | None) -> bytes:
    """Decode one chunk's stored payload and check it against its id; errors name the pack."""
    pe = packfmt.PackEntry(entry.chunk, entry.offset, entry.length, entry.raw_length)
    try:
        data = packfmt.decode_payload(payload, pe, dctx)
    except CorruptData as e:
        raise CorruptData(f"{e} (pack {entry.pack.hex()})") from None
    if blake3.blake3(data).digest() != entry.chunk:
        raise CorruptData(f"chunk {entry.chunk.hex()} in pack {entry.pack.hex()} at offset {entry.offset}: "
                          "content does not match its id")
    return data
