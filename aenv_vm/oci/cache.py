"""The node's layer cache: compressed layer blobs kept by digest, so a second pull
of an image sharing a base layer downloads nothing of it.

``<cache>/blobs/sha256/<hex>``, each file complete and verified (downloads land
as ``.part`` files and are renamed only once their digest and size check out).
A blob's mtime is its last use. After a pull the cache is pruned to its
capacity, least recently used first, never touching what the pull just used nor
anything used in the last ``PRUNE_GRACE`` seconds (another pull may be reading it).
"""
from __future__ import annotations

import os
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from .reference import check_digest

PRUNE_GRACE = 600.0
PART_MAX_AGE = 24 * 3600.0


@dataclass(frozen=True)
class CacheStats:
    blobs: int
    bytes: int
    removed: int


class LayerCache:
    def __init__(self, root: Path, capacity: int) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self.blob_dir = self.root / "blobs" / "sha256"

    def path(self, digest: str) -> Path:
        return self.blob_dir / check_digest(digest)[len("sha256:"):]

    def prepare(self) -> None:
        self.blob_dir.mkdir(parents=True, exist_ok=True)

    def lookup(self, digest: str, size: int) -> Path | None:
        """The cached blob (marked used now), or None. A file of the wrong size is
        dropped (its content is verified when written, its size is cheap to recheck)."""
        p = self.path(digest)
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        if st.st_size != size:
            p.unlink(missing_ok=True)
            return None
        os.utime(p)
        return p

    def prune(self, keep: AbstractSet[str] = frozenset(), now: float | None = None) -> CacheStats:
        now = time.time() if now is None else now
        entries = []
        removed = 0
        if not self.blob_dir.is_dir():
            return CacheStats(0, 0, 0)
        for p in self.blob_dir.iterdir():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if ".part" in p.name:
                if now - st.st_mtime > PART_MAX_AGE:     # left by a pull that died
                    p.unlink(missing_ok=True)
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for mtime, size, p in sorted(entries):
            if total <= self.capacity:
                break
            if "sha256:" + p.name in keep or now - mtime < PRUNE_GRACE:
                continue
            p.unlink(missing_ok=True)
            total -= size
            removed += 1
        return CacheStats(len(entries) - removed, total, removed)
