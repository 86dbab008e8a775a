"""`aenv repo gc`: mark from catalog roots, sweep what nothing reaches.

Under the repository's exclusive lock (so no writer is between staging and
commit; see aenv_store.repository.locks and docs/admin.md):

1. mark: catalog records -> manifests -> parent manifests -> chunks. Any record,
   manifest or index file that cannot be read aborts gc: with part of the graph
   unknown, "unreferenced" cannot be decided (restic's prune does the same).
2. plan: every live chunk gets one home pack (a pack inside the grace period if
   it has one, else the pack holding the most live chunks). Packs with no home
   chunks are deleted; packs whose unreferenced share of payload bytes exceeds
   ``repack_threshold`` are repacked; anything younger than ``grace`` (packs,
   index files and the packs they name, manifests) is left alone.
3. sweep, in a crash-safe order (a crash between any two steps leaves a valid
   repository; the next gc finishes the job):
   a. copy live chunks of repacked packs into new packs (payloads copied as
      stored, each verified against its id first), upload them;
   b. write one new index file: the new packs plus every entry that the
      obsolete index files hold for packs that stay;
   c. delete the obsolete index files (those naming a deleted/repacked or
      missing pack);
   d. delete the deleted and repacked packs;
   e. delete unreachable manifests older than the grace period.
   Before each destructive step the lock is checked (``RepositoryLock.check``).
"""
from __future__ import annotations

import logging
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import zstandard

from ..errors import CorruptData, StoreNotFound, StoreError
from ..formats import pack as packfmt
from ..formats.catalog import CatalogRecord
from ..formats.ids import Digest
from ..formats.index import IndexEntry, decode_index, encode_index
from ..formats.manifest import Manifest
from ..repository.backends.base import ObjectInfo
from ..repository.locks import LockKind, RepositoryLock, acquire
from ..repository.repository import CATALOG, INDEX, MANIFESTS, PACKS, Repository, id_from_key, index_key, manifest_key, pack_key
from .progress import Advancer, ProgressFactory, human_bytes, no_progress

log = logging.getLogger(__name__)

DEFAULT_GRACE = 3600.0
DEFAULT_REPACK_THRESHOLD = 0.5


class GcError(StoreError):
    """gc refused to run: the repository has problems that make liveness unknowable."""


@dataclass(frozen=True)
class GcReport:
    dry_run: bool
    records: int
    live_manifests: int
    live_chunks: int
    packs_before: int
    pack_bytes_before: int
    packs_deleted: int
    packs_deleted_bytes: int
    packs_repacked: int
    packs_repacked_bytes: int
    packs_written: int
    packs_written_bytes: int
    repack_live_bytes: int      # payload bytes of live chunks in repacked packs (what a dry run would copy)
    chunks_copied: int
    index_files_deleted: int
    index_files_written: int
    manifests_deleted: int
    manifests_deleted_bytes: int
    kept_young_packs: int
    kept_young_manifests: int
    seconds: float

    @property
    def freed_bytes(self) -> int:
        written = self.repack_live_bytes if self.dry_run else self.packs_written_bytes
        return self.packs_deleted_bytes + self.packs_repacked_bytes - written + self.manifests_deleted_bytes

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["freed_bytes"] = self.freed_bytes
        return d


@dataclass
class _Plan:
    delete: dict[bytes, ObjectInfo] = field(default_factory=dict)
    repack: dict[bytes, ObjectInfo] = field(default_factory=dict)
    home: dict[bytes, bytes] = field(default_factory=dict)          # live chunk -> pack it is kept in
    obsolete_index: list[str] = field(default_factory=list)
    carried: list[IndexEntry] = field(default_factory=list)         # entries moved into the new index
    manifests: list[ObjectInfo] = field(default_factory=list)       # unreachable, old enough
    young_packs: int = 0
    young_manifests: int = 0
    repack_live_bytes: int = 0


class Collector:
    def __init__(self, repo: Repository, grace: float = DEFAULT_GRACE, dry_run: bool = False,
                 repack_threshold: float = DEFAULT_REPACK_THRESHOLD, pack_target_size: int = 32 << 20,
                 progress: ProgressFactory = no_progress, tmp_dir: Path | None = None) -> None:
        if grace < 0:
            raise GcError(f"grace period must be >= 0 seconds, got {grace}")
        if not 0.0 <= repack_threshold <= 1.0:
            raise GcError(f"repack threshold must be between 0 and 1, got {repack_threshold}")
        self.repo = repo
        self.backend = repo.backend
        self.grace = grace
        self.dry_run = dry_run
        self.repack_threshold = repack_threshold
        self.pack_target_size = pack_target_size
        self.progress = progress
        self.tmp_dir = tmp_dir
        self.lock: RepositoryLock | None = None
        self.young_roots: set[bytes] = set()  # manifests kept only because they are inside the grace period

    def run(self, lock_wait: float = 0.0) -> GcReport:
        # A dry run deletes nothing, so it only needs writers' view of a stable repository.
        kind = LockKind.SHARED if self.dry_run else LockKind.EXCLUSIVE
        with acquire(self.backend, kind, purpose="aenv repo gc" + (" --dry-run" if self.dry_run else ""),
                     wait=lock_wait) as lock:
            self.lock = lock
            return self._run()

    # -- mark ----------------------------------------------------------------------

    def _mark(self, cutoff: float) -> tuple[int, set[bytes], set[bytes]]:
        records: list[CatalogRecord] = []
        for info in self.backend.list(CATALOG):
            try:
                records.append(CatalogRecord.decode(self.backend.get(info.key)))
            except StoreNotFound:
                continue
            except CorruptData as e:
                raise GcError(f"catalog record {info.key} is unreadable ({e}); gc cannot tell what it keeps "
                              "alive. Run `aenv repo verify`, then fix or delete the record") from None
        live_manifests: set[bytes] = set()
        live_chunks: set[bytes] = set()
        roots = [bytes(mid) for rec in records for _, mid in rec.manifests]
        with self.progress("gc: mark", len(roots), "") as bar:
            self._walk(roots, live_manifests, live_chunks, bar, strict=True)
            # Manifests inside the grace period are roots too: a writer without a lock (or
            # one that lost it) may be between writing its manifests and its record; keep
            # what they reach, parents included. Unreadable ones are not roots of anything.
            young = [bytes(mid) for info in self.backend.list(MANIFESTS)
                     if info.mtime > cutoff and (mid := id_from_key(info.key)) is not None
                     and bytes(mid) not in live_manifests]
            before = set(live_manifests)
            self._walk(young, live_manifests, live_chunks, bar, strict=False)
            self.young_roots = live_manifests - before
        return len(records), live_manifests, live_chunks

    def _walk(self, roots: list[bytes], live_manifests: set[bytes], live_chunks: set[bytes], bar: Advancer,
              strict: bool) -> None:
        todo = list(roots)
        while todo:
            mid = todo.pop()
            if mid in live_manifests:
                continue
            key = manifest_key(mid)
            try:
                data = self.backend.get(key)
                if blake3.blake3(data).digest() != mid:
                    raise CorruptData("content does not match its id")
                m = Manifest.decode(data)
            except (StoreNotFound, CorruptData) as e:
                if not strict:
                    log.warning("gc: young manifest %s (or its parent) unreadable, not a root: %s", key, e)
                    continue
                raise GcError(f"manifest {key} reachable from the catalog is unreadable ({e}); "
                              "run `aenv repo verify` to see the affected snapshots") from None
            live_manifests.add(mid)
            live_chunks.update(bytes(c) for c in m.chunks)
            if m.parent is not None:
                todo.append(bytes(m.parent))
            bar.advance(1)

    # -- plan ----------------------------------------------------------------------

    def _plan(self, live_manifests: set[bytes], live_chunks: set[bytes], cutoff: float,
              packs: dict[bytes, ObjectInfo]) -> _Plan:
        plan = _Plan()
        index_files: dict[str, list[IndexEntry]] = {}
        young_index: set[str] = set()
        for info in self.backend.list(INDEX):
            iid = id_from_key(info.key)
            try:
                data = self.backend.get(info.key)
                if iid is None or blake3.blake3(data).digest() != iid:
                    raise CorruptData("content does not match its name")
                index_files[info.key] = decode_index(data).entries()
            except StoreNotFound:
                continue
            except CorruptData as e:
                raise GcError(f"index file {info.key} is corrupt ({e}); packs it lists would look unreferenced. "
                              "Run `aenv repo verify --rebuild-index` first") from None
            if info.mtime > cutoff:
                young_index.add(info.key)

        # Packs inside the grace period, or named by an index file inside it, are untouchable.
        young = {p for p, i in packs.items() if i.mtime > cutoff}
        for key in young_index:
            young.update(bytes(e.pack) for e in index_files[key])
        plan.young_packs = len(young & set(packs))

        by_pack: dict[bytes, dict[bytes, IndexEntry]] = defaultdict(dict)
        for file_entries in index_files.values():
            for entry in file_entries:
                if bytes(entry.pack) in packs:
                    by_pack[bytes(entry.pack)].setdefault(bytes(entry.chunk), entry)
        candidates: dict[bytes, list[bytes]] = defaultdict(list)
        for pid, pack_entries in by_pack.items():
            for c in pack_entries:
                if c in live_chunks:
                    candidates[c].append(pid)
        missing = [c for c in live_chunks if not candidates.get(c)]
        if missing:
            raise GcError(f"{len(missing)} live chunks (e.g. {missing[0].hex()}) are in no index or their pack is "
                          "missing; run `aenv repo verify` (and `--rebuild-index` if the packs exist)")
        live_count = {pid: sum(1 for c in entries if c in live_chunks) for pid, entries in by_pack.items()}
        for c, pids in candidates.items():
            plan.home[c] = max(pids, key=lambda p: (p in young, live_count[p], p))

        home_bytes: dict[bytes, int] = defaultdict(int)
        for c, pid in plan.home.items():
            home_bytes[pid] += by_pack[pid][c].length
        for pid, info in packs.items():
            if pid in young:
                continue
            total = sum(e.length for e in by_pack.get(pid, {}).values())
            live = home_bytes.get(pid, 0)
            if live == 0:
                plan.delete[pid] = info      # unreferenced, or not indexed at all (a crashed commit's)
            elif total and (total - live) / total > self.repack_threshold:
                plan.repack[pid] = info
                plan.repack_live_bytes += live
        gone = set(plan.delete) | set(plan.repack)
        for key, entries in sorted(index_files.items()):
            if key in young_index:
                continue
            named = {bytes(e.pack) for e in entries}
            if named & gone or named - set(packs):
                plan.obsolete_index.append(key)
                plan.carried.extend(e for e in entries if bytes(e.pack) in packs and bytes(e.pack) not in gone)

        for info in self.backend.list(MANIFESTS):
            mid = id_from_key(info.key)
            if mid is None or bytes(mid) in live_manifests:
                continue
            if info.mtime > cutoff:
                plan.young_manifests += 1
            else:
                plan.manifests.append(info)
        return plan

    # -- sweep ---------------------------------------------------------------------

    def _check_lock(self) -> None:
        if self.lock is not None:
            self.lock.check()

    def _repack(self, plan: _Plan) -> tuple[list[IndexEntry], list[tuple[bytes, int]], int]:
        """Copy the home chunks of packs being repacked into new packs; returns
        (index entries of the new packs, [(pack id, size)], chunks copied)."""
        moving: dict[bytes, list[bytes]] = defaultdict(list)
        for c, pid in plan.home.items():
            if pid in plan.repack:
                moving[pid].append(c)
        new_entries: list[IndexEntry] = []
        written: list[tuple[bytes, int]] = []
        copied = 0
        dctx = zstandard.ZstdDecompressor()
        with tempfile.TemporaryDirectory(prefix="aenv-gc-", dir=self.tmp_dir) as tmp, \
                self.progress("gc: repack", sum(i.size for i in plan.repack.values()), "bytes") as bar:
            writer: packfmt.PackWriter | None = None
            seq = 0

            def flush() -> None:
                nonlocal writer
                if writer is None:
                    return
                pid = writer.finish()
                self._check_lock()
                self.backend.put_file(pack_key(pid), writer.path)
                written.append((bytes(pid), writer.size))
                new_entries.extend(IndexEntry(e.chunk, pid, e.offset, e.length, e.raw_length) for e in writer.entries)
                writer.path.unlink(missing_ok=True)
                writer = None

            for pid in sorted(plan.repack):
                info = plan.repack[pid]
                with self.backend.open_stream(info.key) as f:
                    data = f.read()
                entries = {bytes(e.chunk): e for e in packfmt.read_trailer(lambda o, n: data[o:o + n], len(data))}
                for c in sorted(moving.get(pid, ())):
                    e = entries.get(c)
                    if e is None:
                        raise GcError(f"pack {info.key} does not hold chunk {c.hex()} its index promises; "
                                      "run `aenv repo verify`")
                    payload = data[e.offset:e.offset + e.length]
                    plain = packfmt.decode_payload(payload, e, dctx)
                    if blake3.blake3(plain).digest() != c:
                        raise GcError(f"live chunk {c.hex()} in pack {info.key} is corrupt; gc will not copy it. "
                                      "Run `aenv repo verify --read-data`")
                    if writer is None:
                        seq += 1
                        writer = packfmt.PackWriter(Path(tmp) / f"repack-{seq}")
                    writer.add(Digest(c), payload, e.raw_length)
                    copied += 1
                    if writer.payload_bytes >= self.pack_target_size:
                        flush()
                bar.advance(info.size)
            flush()
        return new_entries, written, copied

    def _run(self) -> GcReport:
        t0 = time.monotonic()
        cutoff = time.time() - self.grace
        nrecords, live_manifests, live_chunks = self._mark(cutoff)
        packs: dict[bytes, ObjectInfo] = {}
        for info in self.backend.list(PACKS):
            named = id_from_key(info.key)
            if named is not None and info.key == pack_key(named):
                packs[bytes(named)] = info
        plan = self._plan(live_manifests, live_chunks, cutoff, packs)
        new_entries: list[IndexEntry] = []
        written: list[tuple[bytes, int]] = []
        copied = 0
        index_written = 0
        if not self.dry_run:
            self._check_lock()
            if plan.repack:
                new_entries, written, copied = self._repack(plan)
            if new_entries or plan.carried:
                data = encode_index(plan.carried + new_entries)
                self._check_lock()
                self.backend.put(index_key(Digest.of(data)), data)
                index_written = 1
            # A repacked pack can come out byte-identical to a leftover of an earlier,
            # interrupted gc (same chunks, same order): never delete what was just written.
            fresh = {pack_key(pid) for pid, _ in written}
            doomed = [i.key for i in list(plan.delete.values()) + list(plan.repack.values()) if i.key not in fresh]
            for pid in [p for p, i in plan.delete.items() if i.key in fresh]:
                del plan.delete[pid]
            with self.progress("gc: delete", len(plan.obsolete_index) + len(doomed) + len(plan.manifests), "") as bar:
                self._check_lock()
                new_key = index_key(Digest.of(data)) if index_written else None
                for key in plan.obsolete_index:
                    if key != new_key:
                        self.backend.delete(key)
                    bar.advance(1)
                self._check_lock()
                for key in doomed:
                    self.backend.delete(key)
                    bar.advance(1)
                self._check_lock()
                for info in plan.manifests:
                    self.backend.delete(info.key)
                    bar.advance(1)
            self.backend.cleanup_tmp(older_than=max(self.grace, 600.0))   # temp files of crashed writers
        return GcReport(
            dry_run=self.dry_run, records=nrecords, live_manifests=len(live_manifests) - len(self.young_roots),
            live_chunks=len(live_chunks),
            packs_before=len(packs), pack_bytes_before=sum(i.size for i in packs.values()),
            packs_deleted=len(plan.delete), packs_deleted_bytes=sum(i.size for i in plan.delete.values()),
            packs_repacked=len(plan.repack), packs_repacked_bytes=sum(i.size for i in plan.repack.values()),
            packs_written=len(written), packs_written_bytes=sum(s for _, s in written),
            repack_live_bytes=plan.repack_live_bytes, chunks_copied=copied,
            index_files_deleted=len(plan.obsolete_index), index_files_written=index_written,
            manifests_deleted=len(plan.manifests), manifests_deleted_bytes=sum(i.size for i in plan.manifests),
            kept_young_packs=plan.young_packs, kept_young_manifests=plan.young_manifests + len(self.young_roots),
            seconds=time.monotonic() - t0,
        )


def gc(repo: Repository, grace: float = DEFAULT_GRACE, dry_run: bool = False,
       repack_threshold: float = DEFAULT_REPACK_THRESHOLD, pack_target_size: int = 32 << 20,
       progress: ProgressFactory = no_progress, tmp_dir: Path | None = None, lock_wait: float = 0.0) -> GcReport:
    """Run gc on ``repo`` (see the module docstring). Raises ``LockError`` if the
    repository is locked, ``GcError`` if the repository is damaged."""
    return Collector(repo, grace, dry_run, repack_threshold, pack_target_size, progress, tmp_dir).run(lock_wait)


def format_report(r: GcReport) -> list[str]:

    verb = "would free" if r.dry_run else "freed"
    lines = [
        f"live: {r.records} catalog records, {r.live_manifests} manifests, {r.live_chunks} chunks",
        f"packs: {r.packs_before} ({human_bytes(r.pack_bytes_before)}) before; deleted {r.packs_deleted} "
        f"({human_bytes(r.packs_deleted_bytes)}), repacked {r.packs_repacked} ({human_bytes(r.packs_repacked_bytes)}) "
        f"into {r.packs_written} ({human_bytes(r.packs_written_bytes)}, {r.chunks_copied} chunks copied)",
        f"index files: {r.index_files_deleted} replaced, {r.index_files_written} written; "
        f"manifests deleted: {r.manifests_deleted} ({human_bytes(r.manifests_deleted_bytes)})",
    ]
    if r.kept_young_packs or r.kept_young_manifests:
        lines.append(f"kept inside the grace period: {r.kept_young_packs} packs, {r.kept_young_manifests} manifests")
    lines.append(f"{verb} {human_bytes(r.freed_bytes)} in {r.seconds:.1f}s" + (" (dry run: nothing changed)"
                                                                         if r.dry_run else ""))
    return lines
