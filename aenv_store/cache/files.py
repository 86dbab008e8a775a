"""The node cache's chunk files (``data/<2 hex>/<64 hex>``, exactly the chunk's
bytes): reading one back checked against its index entry, and the two passes
that compare them with the LMDB index: reconcile (after a crash, by the first
user) and verify (read-only, for admins and tests)."""
from __future__ import annotations

import enum
import mmap
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import lmdb
import xxhash

from .index import ENTRIES, USED, IndexDbs

# A chunk as a reader gets it: bytes, or a read-only mapping of its cache file.
ChunkData = bytes | mmap.mmap


class Found(enum.Enum):
    OK = "ok"
    GONE = "gone"           # no file (evicted by another process between two steps, or a crash)
    CORRUPT = "corrupt"     # a file whose size or xxh3 is not the index entry's


def read_checked(path: str, size: int, checksum: int, mapped: bool) -> tuple[Found, ChunkData | None]:
    """A chunk file checked against its index entry (size and xxh3, a mapping too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Found.GONE, None
    data: ChunkData | None = None
    try:
        if not mapped or not size:
            data = os.read(fd, size + 1)
        elif os.fstat(fd).st_size == size:
            # the cache replaces files by rename and never rewrites one, so a checked
            # mapping stays valid (even after the file is evicted)
            data = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if data is None or len(data) != size or xxhash.xxh3_64_intdigest(data) != checksum:
        if isinstance(data, mmap.mmap):
            data.close()
        return Found.CORRUPT, None
    return Found.OK, data


def map_exact(path: str, size: int) -> mmap.mmap | None:
    """A read-only mapping of a file this process has just written and verified (only its
    size is checked); None if it is gone already or has another size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size and os.fstat(fd).st_size == size else None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ChunkFiles:
    data_dir: str

    def path(self, digest: bytes) -> str:
        h = digest.hex()
        return f"{self.data_dir}/{h[:2]}/{h}"

    def make_shards(self) -> None:
        if not os.path.isdir(f"{self.data_dir}/ff"):  # shards are made in order: ff exists => all do
            for i in range(256):
                os.makedirs(f"{self.data_dir}/{i:02x}", exist_ok=True)

    def scan(self) -> Iterator[tuple[str, str, bytes | None]]:
        """(shard name, file path, digest or None for a name that is not one) of every file."""
        with os.scandir(self.data_dir) as shards:
            for shard in shards:
                if not shard.is_dir():
                    continue
                with os.scandir(shard.path) as files:
                    for f in files:
                        try:
                            digest: bytes | None = bytes.fromhex(f.name)
                        except ValueError:
                            digest = None
                        if digest is not None and len(digest) != 32:
                            digest = None
                        yield shard.name, f.path, digest


def write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def unlink_all(paths: Iterable[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def reconcile(env: lmdb.Environment, db: IndexDbs, files: ChunkFiles) -> tuple[int, int]:
    """Drop entries whose file is missing or has the wrong size, delete files without an
    entry. Only for a user that knows nobody else has the directory open.
    Returns (entries dropped, orphan files deleted)."""
    with env.begin(write=True) as txn:
        stale = []
        for digest, entry in db.iter_entries(txn):
            try:
                ok = os.stat(files.path(digest)).st_size == entry.size
            except FileNotFoundError:
                ok = False
            if not ok:
                stale.append(digest)
        for digest in stale:
            db.remove(txn, digest)
        unlink_all(files.path(d) for d in stale)
        for digest, _pid in list(db.iter_dying(txn)):
            db.clear_dying(txn, digest)  # their entries are gone; the files go with the orphans
        orphans = [path for _, path, digest in files.scan()
                   if digest is None or txn.get(digest, db=db.entries) is None]
        unlink_all(orphans)
    return len(stale), len(orphans)


def verify(env: lmdb.Environment, db: IndexDbs, files: ChunkFiles, read_data: bool) -> list[str]:
    """Disagreements between index and files (empty = consistent). Exact while nobody
    writes: a put renames its file just before its entry commits."""
    problems: list[str] = []
    with env.begin() as txn:
        total = count = 0
        for digest, entry in db.iter_entries(txn):
            total += entry.size
            count += 1
            path = files.path(digest)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                problems.append(f"entry {digest.hex()}: file missing")
                continue
            if size != entry.size:
                problems.append(f"entry {digest.hex()}: file has {size} bytes, index says {entry.size}")
            elif read_data:
                with open(path, "rb") as f:
                    if xxhash.xxh3_64_intdigest(f.read()) != entry.checksum:
                        problems.append(f"entry {digest.hex()}: checksum mismatch")
        used, entries = db.get_u64(txn, USED), db.get_u64(txn, ENTRIES)
        if (total, count) != (used, entries):
            problems.append(f"totals: index says {used} bytes in {entries} entries, "
                            f"entries sum to {total} in {count}")
        problems += db.lru_problems(txn)
        dying = {digest for digest, _ in db.iter_dying(txn)}
        problems += [f"eviction of {d.hex()} not finished" for d in sorted(dying)]
        for shard, path, digest in files.scan():
            if digest is None or (digest not in dying and txn.get(digest, db=db.entries) is None):
                problems.append(f"file {shard}/{os.path.basename(path)}: no index entry")
    return problems
