"""Where the node cache's segment files live (``data/<2 hex>/<16 hex>.seg``, one per
fill, format in cache/segments.py) and the two passes that compare them with the
LMDB index: reconcile (after a crash, by the first user) and verify (read-only,
for admins and tests)."""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator

import lmdb
import xxhash

from .index import ENTRIES, USED, Entry, IndexDbs
from .segments import SegmentFormatError, read_header

SUFFIX = ".seg"


@dataclass(frozen=True)
class SegmentFiles:
    data_dir: str

    def path(self, segment: int) -> str:
        return f"{self.data_dir}/{segment >> 56:02x}/{segment:016x}{SUFFIX}"

    def make_shards(self) -> None:
        if not os.path.isdir(f"{self.data_dir}/ff"):  # shards are made in order: ff exists => all do
            for i in range(256):
                os.makedirs(f"{self.data_dir}/{i:02x}", exist_ok=True)

    def scan(self) -> Iterator[tuple[str, str, int | None]]:
        """(shard name, file path, segment id or None for a name that is not one) of every file."""
        with os.scandir(self.data_dir) as shards:
            for shard in shards:
                if not shard.is_dir():
                    continue
                with os.scandir(shard.path) as files:
                    for f in files:
                        segment: int | None = None
                        stem = f.name[:-len(SUFFIX)] if f.name.endswith(SUFFIX) else ""
                        if len(stem) == 16:
                            try:
                                segment = int(stem, 16)
                            except ValueError:
                                segment = None
                        if segment is not None and f.path != self.path(segment):
                            segment = None  # in the wrong shard
                        yield shard.name, f.path, segment


def unlink_all(paths: Iterable[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _fits(path: str, entry: Entry) -> bool:
    try:
        return os.stat(path).st_size >= entry.offset + entry.size
    except FileNotFoundError:
        return False


def reconcile(env: lmdb.Environment, db: IndexDbs, files: SegmentFiles) -> tuple[int, int]:
    """Drop entries whose segment file is missing or too short, delete files no entry
    names. Only for a user that knows nobody else has the directory open.
    Returns (entries dropped, orphan files deleted)."""
    with env.begin(write=True) as txn:
        stale = [digest for digest, entry in db.iter_entries(txn) if not _fits(files.path(entry.segment), entry)]
        for digest in stale:
            db.remove(txn, digest)
        live = {segment for segment, _ in db.iter_members(txn)}
        orphans = [path for _, path, segment in files.scan() if segment is None or segment not in live]
        unlink_all(orphans)
    return len(stale), len(orphans)


def verify(env: lmdb.Environment, db: IndexDbs, files: SegmentFiles, read_data: bool) -> list[str]:
    """Disagreements between index and files (empty = consistent). Exact while nobody
    writes: a put writes its segment just before its entries commit."""
    problems: list[str] = []
    with env.begin() as txn:
        total = count = 0
        by_segment: dict[int, list[tuple[bytes, Entry]]] = defaultdict(list)
        for digest, entry in db.iter_entries(txn):
            total += entry.size
            count += 1
            by_segment[entry.segment].append((digest, entry))
        members = defaultdict(set)
        for segment, digest in db.iter_members(txn):
            members[segment].add(digest)
        for segment, listed in by_segment.items():
            if members.get(segment, set()) != {d for d, _ in listed}:
                problems.append(f"segment {segment:016x}: members table disagrees with its entries")
        for segment in members.keys() - by_segment.keys():
            problems.append(f"segment {segment:016x}: members listed without entries")
        for segment, listed in sorted(by_segment.items()):
            path = files.path(segment)
            try:
                items: dict[bytes, set[tuple[int, int, int]]] = defaultdict(set)
                for i in read_header(path):  # a batch may hold a digest twice (the entry names one)
                    items[i.digest].add((i.offset, i.size, i.checksum))
                size = os.stat(path).st_size
            except FileNotFoundError:
                problems += [f"entry {d.hex()}: segment {segment:016x} missing" for d, _ in listed]
                continue
            except (OSError, SegmentFormatError) as e:
                problems.append(f"segment {segment:016x}: {e}")
                continue
            for digest, entry in listed:
                if (entry.offset, entry.size, entry.checksum) not in items.get(digest, ()):
                    problems.append(f"entry {digest.hex()}: not in its segment's header as indexed")
                elif size < entry.offset + entry.size:
                    problems.append(f"entry {digest.hex()}: segment {segment:016x} has {size} bytes, "
                                    f"the entry ends at {entry.offset + entry.size}")
                elif read_data:
                    with open(path, "rb") as f:
                        if xxhash.xxh3_64_intdigest(os.pread(f.fileno(), entry.size, entry.offset)) != entry.checksum:
                            problems.append(f"entry {digest.hex()}: checksum mismatch")
        used, entries = db.get_u64(txn, USED), db.get_u64(txn, ENTRIES)
        if (total, count) != (used, entries):
            problems.append(f"totals: index says {used} bytes in {entries} entries, "
                            f"entries sum to {total} in {count}")
        problems += db.lru_problems(txn)
        for shard, path, seg in files.scan():
            if seg is None or seg not in by_segment:
                problems.append(f"file {shard}/{os.path.basename(path)}: no index entry")
    return problems
