"""Fixed, aligned chunking helpers shared by the writers and readers."""
from __future__ import annotations

from functools import lru_cache
from typing import Iterator

import blake3

from .manifest import Extent


@lru_cache(maxsize=64)
def zero_digest(length: int) -> bytes:
    """BLAKE3 of ``length`` zero bytes: a chunk hashing to this is all zeros
    (so zero detection costs nothing beyond the hash we compute anyway)."""
    return blake3.blake3(bytes(length)).digest()


@lru_cache(maxsize=8)
def zeros(length: int) -> bytes:
    return bytes(length)


def pieces(offset: int, length: int, chunk_size: int) -> Iterator[tuple[int, int, int]]:
    """Split [offset, offset+length) at chunk boundaries: (chunk index, offset
    within the chunk, piece length)."""
    pos, end = offset, offset + length
    while pos < end:
        k, within = divmod(pos, chunk_size)
        n = min(chunk_size - within, end - pos)
        yield k, within, n
        pos += n


def merge_zero_runs(extents: list[Extent]) -> list[Extent]:
    """Coalesce adjacent zero extents (canonical manifests keep one run)."""
    out: list[Extent] = []
    for e in extents:
        if e.chunk is None and out and out[-1].chunk is None and out[-1].end == e.offset:
            out[-1] = Extent(out[-1].offset, out[-1].length + e.length, None)
        else:
            out.append(e)
    return out


def add_range(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """Union of sorted disjoint [a, b) ranges with [start, end) (touching ranges merge)."""
    out: list[tuple[int, int]] = []
    placed = False
    for a, b in ranges:
        if b < start:
            out.append((a, b))
        elif a > end:
            if not placed:
                out.append((start, end))
                placed = True
            out.append((a, b))
        else:
            start, end = min(a, start), max(b, end)
    if not placed:
        out.append((start, end))
    return out
