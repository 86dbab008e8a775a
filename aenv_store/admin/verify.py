"""`aenv repo verify`: an independent checker of a repository.

It reads objects straight from the backend and decodes them with the format
codecs (pack, index, manifest, catalog); it deliberately does not use the
writer's or reader's paths (the merged index, ``Repository.get_manifest``,
``read_chunk``), so a bug there cannot hide itself (restic's checker/archiver
split).

Checks, always (structure):
- every catalog record decodes; every manifest it reaches (records -> manifests
  -> parents) exists, matches its id and decodes;
- every index file matches its name and decodes; every index entry points into
  an existing pack, within its bounds, and agrees with that pack's trailer;
- every pack trailer parses (two range reads) and its checksum holds;
- every chunk a reachable manifest uses is indexed, in a readable pack, with the
  length the manifest expects.
With ``read_data``, the selected packs are streamed whole: pack id = BLAKE3 of
the file, header and trailer valid, every chunk decompresses and hashes to its id.

Every problem names the catalog records (snapshots) whose data it affects.
"""
from __future__ import annotations

import io
import math
import mmap
import os
import random
import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable

import blake3
import zstandard

from ..errors import BackendError, CorruptData, StoreNotFound
from ..formats import pack as packfmt
from ..formats.catalog import ALIAS, CatalogRecord
from ..formats.ids import Digest
from ..formats.index import decode_index
from ..formats.manifest import Manifest
from ..repository.backends.base import ObjectInfo
from ..repository.repository import CATALOG, INDEX, MANIFESTS, PACKS, Repository, id_from_key, manifest_key
from .progress import ProgressFactory, human_bytes, no_progress

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Subset:
    """Which packs ``--read-data`` reads: ``N%`` (a random N percent, at least one
    pack) or ``n/t`` (deterministic: packs whose id's first byte mod t == n-1, so t
    runs with n = 1..t cover every pack exactly once, as restic's ``n/t``)."""

    fraction: float | None = None
    group: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str) -> "Subset":
        text = text.strip()
        m = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
        if m:
            pct = float(m.group(1))
            if not 0 < pct <= 100:
                raise ValueError(f"read-data subset must be in (0%, 100%], got {text!r}")
            return cls(fraction=pct / 100)
        m = re.fullmatch(r"(\d+)/(\d+)", text)
        if m:
            n, t = int(m.group(1)), int(m.group(2))
            if not 1 <= n <= t <= 256:
                raise ValueError(f"read-data subset n/t needs 1 <= n <= t <= 256, got {text!r}")
            return cls(group=(n, t))
        raise ValueError(f"read-data subset must look like '10%' or '1/5', got {text!r}")

    def select(self, pack_ids: list[Digest], rng: random.Random) -> set[Digest]:
        if self.group is not None:
            n, t = self.group
            return {p for p in pack_ids if p[0] % t == n - 1}
        if not pack_ids:
            return set()
        k = max(1, math.ceil(len(pack_ids) * (self.fraction or 1.0)))
        return set(rng.sample(sorted(pack_ids), min(k, len(pack_ids))))


@dataclass(frozen=True)
class Problem:
    severity: str                    # "error" | "warning"
    kind: str                        # short machine-readable class, e.g. "corrupt-chunk"
    object: str                      # repository key (or id) of the object concerned
    message: str
    snapshots: tuple[str, ...] = ()  # catalog records whose data it affects

    def to_json(self) -> dict[str, Any]:
        return {"severity": self.severity, "kind": self.kind, "object": self.object,
                "message": self.message, "snapshots": list(self.snapshots)}


@dataclass(frozen=True)
class VerifyReport:
    problems: tuple[Problem, ...]
    records: int
    manifests: int
    chunks_referenced: int
    index_files: int
    index_entries: int
    packs: int
    pack_bytes: int
    packs_read: int
    bytes_read: int
    chunks_read: int
    unreferenced_packs: int
    unindexed_packs: int
    unreachable_manifests: int
    seconds: float

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def affected_snapshots(self) -> list[str]:
        return sorted({s for p in self.errors for s in p.snapshots})

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "records", "manifests", "chunks_referenced", "index_files", "index_entries", "packs", "pack_bytes",
            "packs_read", "bytes_read", "chunks_read", "unreferenced_packs", "unindexed_packs",
            "unreachable_manifests", "seconds")}
        d["ok"] = self.ok
        d["errors"] = len(self.errors)
        d["warnings"] = len(self.problems) - len(self.errors)
        d["affected_snapshots"] = self.affected_snapshots
        d["problems"] = [p.to_json() for p in self.problems]
        return d


@dataclass
class _Issue:
    """A problem before its snapshots are known: what data it touches."""

    severity: str
    kind: str
    object: str
    message: str
    chunks: set[bytes] = field(default_factory=set)
    manifests: set[bytes] = field(default_factory=set)
    records: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Loc:
    pack: bytes
    offset: int
    length: int
    raw_length: int
    index_key: str


@dataclass
class _PackResult:
    key: str
    pack: bytes
    entries: list[packfmt.PackEntry] | None = None
    issues: list[_Issue] = field(default_factory=list)
    bytes_read: int = 0
    chunks_read: int = 0


class Checker:
    """One run of the checker over ``repo`` (read-only; safe next to writers)."""

    def __init__(self, repo: Repository, read_data: bool = False, subset: Subset | None = None,
                 threads: int = 0, progress: ProgressFactory = no_progress, seed: int | None = None) -> None:
        self.repo = repo
        self.backend = repo.backend
        self.read_data = read_data
        self.subset = subset
        self.threads = threads or min(8, os.cpu_count() or 2)
        self.progress = progress
        self.rng = random.Random(seed)
        self.issues: list[_Issue] = []
        self.records: dict[str, CatalogRecord] = {}
        # every manifest looked at, None where it is missing or corrupt (looked at once);
        # its readable ones become ``manifests`` when they are all loaded
        self.looked_up: dict[bytes, Manifest | None] = {}
        self.manifests: dict[bytes, Manifest] = {}
        self.reach: dict[bytes, set[str]] = defaultdict(set)   # manifest -> records reaching it
        self.locs: dict[bytes, list[_Loc]] = defaultdict(list)  # chunk -> index entries
        self.index_files = 0
        self.index_entries = 0
        self.packs: dict[bytes, ObjectInfo] = {}
        self.trailers: dict[bytes, dict[bytes, packfmt.PackEntry]] = {}
        self.packs_read = 0
        self.bytes_read = 0
        self.chunks_read = 0

    # -- phases ---------------------------------------------------------------------

    def run(self) -> VerifyReport:
        t0 = time.monotonic()
        self._load_catalog()
        self._load_manifests()
        self._load_index()
        self._check_packs()
        self._check_index_against_packs()
        referenced = self._check_references()
        problems = self._attribute()
        indexed_packs = {loc.pack for locs in self.locs.values() for loc in locs}
        used_packs = {loc.pack for c in referenced for loc in self.locs.get(c, ())}
        all_manifests = sum(1 for _ in self.backend.list(MANIFESTS))
        return VerifyReport(
            problems=tuple(problems), records=len(self.records), manifests=len(self.manifests),
            chunks_referenced=len(referenced), index_files=self.index_files, index_entries=self.index_entries,
            packs=len(self.packs), pack_bytes=sum(i.size for i in self.packs.values()),
            packs_read=self.packs_read, bytes_read=self.bytes_read, chunks_read=self.chunks_read,
            unreferenced_packs=len(set(self.packs) - used_packs),
            unindexed_packs=len(set(self.packs) - indexed_packs),
            unreachable_manifests=max(0, all_manifests - len(self.manifests)),
            seconds=time.monotonic() - t0,
        )

    def _issue(self, severity: str, kind: str, obj: str, message: str, **touch: Any) -> _Issue:
        issue = _Issue(severity, kind, obj, message, **touch)
        self.issues.append(issue)
        return issue

    def _load_catalog(self) -> None:
        for info in self.backend.list(CATALOG):
            name = info.key[len(CATALOG):]
            try:
                rec = CatalogRecord.decode(self.backend.get(info.key))
            except StoreNotFound:
                continue  # deleted while we listed
            except CorruptData as e:
                self._issue(ERROR, "corrupt-record", info.key, f"catalog record {name!r}: {e}", records={name})
                continue
            if rec.name != name:
                self._issue(ERROR, "corrupt-record", info.key,
                            f"catalog record {name!r} holds a record named {rec.name!r}", records={name})
                continue
            self.records[name] = rec
        for rec in self.records.values():
            if rec.kind == ALIAS and rec.target not in self.records:
                self._issue(WARNING, "dangling-alias", CATALOG + rec.name,
                            f"alias {rec.name!r} points to {rec.target!r}, which does not exist")

    def _get_manifest(self, mid: bytes) -> Manifest | None:
        if mid in self.looked_up:
            return self.looked_up[mid]
        key = manifest_key(mid)
        try:
            data = self.backend.get(key)
        except StoreNotFound:
            self._issue(ERROR, "missing-manifest", key, f"manifest {mid.hex()} is missing", manifests={mid})
            self.looked_up[mid] = None
            return None
        try:
            if blake3.blake3(data).digest() != mid:
                raise CorruptData("content does not match its id")
            m = Manifest.decode(data)
        except CorruptData as e:
            self._issue(ERROR, "corrupt-manifest", key, f"manifest {mid.hex()}: {e}", manifests={mid})
            m = None
        self.looked_up[mid] = m
        return m

    def _load_manifests(self) -> None:
        for name, rec in self.records.items():
            for role, mid in rec.manifests:
                cur: bytes | None = bytes(mid)
                seen: set[bytes] = set()
                while cur is not None and cur not in seen:
                    seen.add(cur)
                    self.reach[cur].add(name)
                    m = self._get_manifest(cur)
                    cur = bytes(m.parent) if m is not None and m.parent is not None else None
                if cur is not None:
                    self._issue(ERROR, "manifest-cycle", manifest_key(cur),
                                f"manifest parent chain of record {name!r} ({role}) loops", manifests={cur})
        self.manifests = {k: v for k, v in self.looked_up.items() if v is not None}

    def _load_index(self) -> None:
        for info in self.backend.list(INDEX):
            iid = id_from_key(info.key)
            self.index_files += 1
            try:
                data = self.backend.get(info.key)
                if iid is None or blake3.blake3(data).digest() != iid:
                    raise CorruptData("content does not match its name")
                f = decode_index(data)
            except StoreNotFound:
                self.index_files -= 1
                continue
            except CorruptData as e:
                # Which chunks it held is unknown; _check_references attributes the
                # referenced chunks that end up in no index to this problem.
                self._issue(ERROR, "corrupt-index", info.key, f"index file {info.key}: {e}")
                continue
            for entry in f.entries():
                self.locs[bytes(entry.chunk)].append(
                    _Loc(bytes(entry.pack), entry.offset, entry.length, entry.raw_length, info.key))
            self.index_entries += len(f)

    def _check_packs(self) -> None:
        for info in self.backend.list(PACKS):
            pid = id_from_key(info.key)
            if pid is None or info.key != f"{PACKS}{pid.hex()[:2]}/{pid.hex()}":
                self._issue(WARNING, "stray-object", info.key, f"unexpected object {info.key} under {PACKS}")
                continue
            self.packs[bytes(pid)] = info
        ids = [Digest(p) for p in self.packs]
        full = set()
        if self.read_data:
            full = {bytes(p) for p in (self.subset.select(ids, self.rng) if self.subset else ids)}
        total = sum(self.packs[p].size for p in full) if full else len(self.packs)
        label, unit = ("read data", "bytes") if full else ("pack trailers", "")
        order = sorted(self.packs, key=lambda p: self.packs[p].key)
        # Trailer reads are two small range reads each: latency-bound on S3, so more threads.
        workers = self.threads if full else max(self.threads, 16)
        with self.progress(label, total, unit) as bar, ThreadPoolExecutor(workers) as pool:
            def one(pid: bytes) -> _PackResult:
                return self._read_pack(pid) if pid in full else self._read_trailer(pid)

            for res in pool.map(one, order):
                for issue in res.issues:
                    self.issues.append(issue)
                if res.entries is not None:
                    self.trailers[res.pack] = {bytes(e.chunk): e for e in res.entries}
                if res.pack in full:
                    self.packs_read += 1
                    self.bytes_read += res.bytes_read
                    self.chunks_read += res.chunks_read
                    bar.advance(self.packs[res.pack].size)
                elif not full:
                    bar.advance(1)

    def _indexed_chunks_of(self, pack: bytes) -> set[bytes]:
        return {c for c, locs in self.locs.items() if any(loc.pack == pack for loc in locs)}

    def _read_trailer(self, pid: bytes) -> _PackResult:
        info = self.packs[pid]
        res = _PackResult(info.key, pid)
        try:
            res.entries = packfmt.read_trailer(lambda off, n: self.backend.get_range(info.key, off, n), info.size)
        except (CorruptData, BackendError) as e:
            res.issues.append(_Issue(ERROR, "corrupt-pack", info.key, f"pack {info.key}: trailer unreadable: {e}",
                                     chunks=self._indexed_chunks_of(pid)))
        except StoreNotFound:
            pass  # deleted while we listed (gc); references to it are reported below
        return res

    def _read_pack(self, pid: bytes) -> _PackResult:
        info = self.packs[pid]
        res = _PackResult(info.key, pid)
        try:
            with self.backend.open_stream(info.key) as f:
                data = _slurp(f)
        except StoreNotFound:
            return res
        except BackendError as e:
            res.issues.append(_Issue(ERROR, "unreadable-pack", info.key, f"pack {info.key}: {e}",
                                     chunks=self._indexed_chunks_of(pid)))
            return res
        res.bytes_read = len(data)
        damaged = blake3.blake3(data, max_threads=1).digest() != pid
        try:
            packfmt.decode_header(data[:packfmt.HEADER_SIZE])
            res.entries = packfmt.read_trailer(lambda off, n: data[off:off + n], len(data))
        except CorruptData as e:
            res.issues.append(_Issue(ERROR, "corrupt-pack", info.key, f"pack {info.key}: {e}",
                                     chunks=self._indexed_chunks_of(pid)))
            return res
        bad: set[bytes] = set()
        dctx = zstandard.ZstdDecompressor()
        view = memoryview(data)
        for entry in res.entries:
            try:
                plain = packfmt.decode_payload(view[entry.offset:entry.offset + entry.length], entry, dctx)
                ok = blake3.blake3(plain).digest() == entry.chunk
                problem = "" if ok else "content does not match its id"
            except CorruptData as err:
                problem = str(err)
            res.chunks_read += 1
            if problem:
                bad.add(bytes(entry.chunk))
                res.issues.append(_Issue(ERROR, "corrupt-chunk", info.key,
                                         f"chunk {entry.chunk.hex()} at offset {entry.offset} in pack {info.key}: {problem}",
                                         chunks={bytes(entry.chunk)}))
        if damaged and not bad:
            # Every chunk checks out but the file does not hash to its name (a flipped
            # header/trailer bit the codecs tolerate): the pack is still damaged.
            res.issues.append(_Issue(ERROR, "corrupt-pack", info.key,
                                     f"pack {info.key}: content does not match its id",
                                     chunks={bytes(entry.chunk) for entry in res.entries}))
        return res

    def _check_index_against_packs(self) -> None:
        missing: dict[bytes, set[bytes]] = defaultdict(set)
        mismatched: dict[bytes, list[tuple[bytes, str]]] = defaultdict(list)
        for chunk, locs in self.locs.items():
            for loc in locs:
                info = self.packs.get(loc.pack)
                if info is None:
                    missing[loc.pack].add(chunk)
                    continue
                trailer = self.trailers.get(loc.pack)
                if trailer is None:
                    continue  # unreadable trailer: already reported with its chunks
                te = trailer.get(chunk)
                if te is None:
                    mismatched[loc.pack].append((chunk, f"chunk {chunk.hex()} (index {loc.index_key}) is not in the pack"))
                elif (te.offset, te.length, te.raw_length) != (loc.offset, loc.length, loc.raw_length):
                    mismatched[loc.pack].append((chunk,
                        f"chunk {chunk.hex()}: index {loc.index_key} says offset {loc.offset} length {loc.length}/"
                        f"{loc.raw_length}, pack trailer says {te.offset} {te.length}/{te.raw_length}"))
        for pack, chunks in missing.items():
            key = f"{PACKS}{pack.hex()[:2]}/{pack.hex()}"
            self._issue(ERROR, "missing-pack", key,
                        f"pack {key} is missing ({len(chunks)} indexed chunks point to it)", chunks=chunks)
        for pack, found in mismatched.items():
            key = self.packs[pack].key
            more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
            self._issue(ERROR, "index-mismatch", key,
                        f"index disagrees with pack {key}: " + "; ".join(m for _, m in found[:3]) + more,
                        chunks={c for c, _ in found})

    def _check_references(self) -> set[bytes]:
        referenced: set[bytes] = set()
        unindexed: set[bytes] = set()
        in_trailers: dict[bytes, bytes] = {}
        for pack, entries in self.trailers.items():
            for chunk in entries:
                in_trailers.setdefault(chunk, pack)
        bad_length: dict[bytes, list[str]] = defaultdict(list)
        for mid, m in self.manifests.items():
            for e in m.extents:
                if e.chunk is None:
                    continue
                c = bytes(e.chunk)
                referenced.add(c)
                locs = self.locs.get(c)
                if not locs:
                    unindexed.add(c)
                elif all(loc.raw_length != e.length for loc in locs):
                    bad_length[mid].append(f"extent at {e.offset} is {e.length} bytes, chunk {c.hex()[:16]} holds "
                                           f"{locs[0].raw_length}")
        for mid, msgs in bad_length.items():
            self._issue(ERROR, "extent-length", manifest_key(mid),
                        f"manifest {mid.hex()}: " + "; ".join(msgs[:3]), manifests={mid})
        corrupt_index = [i for i in self.issues if i.kind == "corrupt-index"]
        for c in sorted(unindexed):
            where = in_trailers.get(c)
            hint = (f"; pack {where.hex()} holds it: run `aenv repo verify --rebuild-index`" if where
                    else "; no pack holds it")
            self._issue(ERROR, "unindexed-chunk", c.hex(), f"chunk {c.hex()} is in no index{hint}", chunks={c})
            for issue in corrupt_index:  # the likely cause of the loss
                issue.chunks.add(c)
        return referenced

    def _attribute(self) -> list[Problem]:
        """Map each issue to the catalog records whose data it touches."""
        by_manifest_chunks: dict[bytes, set[bytes]] | None = None
        children: dict[bytes, set[bytes]] = defaultdict(set)
        for mid, m in self.manifests.items():
            if m.parent is not None:
                children[bytes(m.parent)].add(mid)
        aliases: dict[str, set[str]] = defaultdict(set)
        for rec in self.records.values():
            if rec.kind == ALIAS and rec.target:
                aliases[rec.target].add(rec.name)
        out: list[Problem] = []
        for issue in self.issues:
            mids = set(issue.manifests)
            if issue.chunks:
                if by_manifest_chunks is None:
                    by_manifest_chunks = {mid: {bytes(c) for c in m.chunks} for mid, m in self.manifests.items()}
                mids |= {mid for mid, cs in by_manifest_chunks.items() if cs & issue.chunks}
            names = set(issue.records)
            for mid in mids:
                names |= self.reach.get(mid, set())
            todo = list(names)
            while todo:  # aliases of affected records are affected too
                for a in aliases.get(todo.pop(), ()):
                    if a not in names:
                        names.add(a)
                        todo.append(a)
            out.append(Problem(issue.severity, issue.kind, issue.object, issue.message, tuple(sorted(names))))
        out.sort(key=lambda p: (p.severity != ERROR, p.kind, p.object))
        return out


def _slurp(f: Any) -> Any:
    """The whole stream: a read-only mmap when it is a local file (no copy through
    Python; closed by refcounting once the last slice is gone), else its bytes."""
    try:
        fd = f.fileno()
        if os.fstat(fd).st_size > 0:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    return f.read()


def verify(repo: Repository, read_data: bool = False, subset: Subset | None = None, threads: int = 0,
           progress: ProgressFactory = no_progress, seed: int | None = None) -> VerifyReport:
    """Check ``repo``; see the module docstring. Never modifies the repository."""
    return Checker(repo, read_data, subset, threads, progress, seed).run()


def format_report(report: VerifyReport, read_data: bool) -> Iterable[str]:
    """Human-readable summary lines (the CLI prints them)."""
    def from_pct(n: int, d: int) -> str:
        return f"{100.0 * n / d:.0f}%" if d else "0%"

    yield (f"checked {report.records} catalog records, {report.manifests} manifests, "
           f"{report.chunks_referenced} referenced chunks")
    yield (f"index: {report.index_files} files, {report.index_entries} entries; "
           f"packs: {report.packs} ({human_bytes(report.pack_bytes)})")
    if read_data:
        rate = report.bytes_read / report.seconds / 1e6 if report.seconds > 0 else 0.0
        yield (f"read data: {report.packs_read}/{report.packs} packs ({from_pct(report.packs_read, report.packs)}), "
               f"{human_bytes(report.bytes_read)}, {report.chunks_read} chunks re-hashed, {rate:.0f} MB/s")
    if report.unreferenced_packs or report.unindexed_packs or report.unreachable_manifests:
        yield (f"garbage (gc removes it): {report.unreferenced_packs} packs without referenced chunks "
               f"({report.unindexed_packs} not indexed), {report.unreachable_manifests} unreachable manifests")
    for p in report.problems:
        snaps = f" [affects: {', '.join(p.snapshots)}]" if p.snapshots else ""
        yield f"{p.severity}: {p.kind}: {p.message}{snaps}"
    errors, warnings = len(report.errors), len(report.problems) - len(report.errors)
    if report.ok:
        yield f"no errors found ({warnings} warnings) in {report.seconds:.1f}s"
    else:
        affected = report.affected_snapshots
        yield (f"{errors} errors, {warnings} warnings; affected snapshots ({len(affected)}): "
               f"{', '.join(affected) if affected else 'none named'}")


__all__ = ["Checker", "Problem", "Subset", "VerifyReport", "verify", "format_report"]
