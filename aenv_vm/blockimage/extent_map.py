"""Flattened extent map of a layer stack.

One sorted list of segments covering [0, size) exactly: every byte range
points straight at the chunk that holds it (and where in that chunk) or is an
explicit zero run. Reads are a binary search plus a walk over the few
segments a request spans, never a walk down the layer stack. Building it is a
merge per layer (top layers overlay lower ones); a commit overlays one more.

Segments are kept in parallel Python lists (``bisect`` on ints is faster
than numpy scalar indexing for single lookups, and the lists stay compact
enough: one entry per chunk-sized extent).
"""
from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent

ZERO = -1   # ``src`` of a zero segment


@dataclass(frozen=True)
class Segment:
    """A run [start, end) of the image: zeros (chunk is None) or bytes
    chunk[chunk_offset : chunk_offset + end - start]; ``layer`` is the index
    in the stack of the layer it comes from (0 = bottom)."""

    start: int
    end: int
    chunk: Digest | None
    chunk_offset: int = 0
    layer: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start


# One extent of a layer manifest (gaps between extents mean "from below"): the store's
# own record, not a copy of it
LayerExtent = Extent


def overlay(lower: Sequence[Segment], upper: Sequence[Segment]) -> list[Segment]:
    """``upper`` (sorted, disjoint, possibly with gaps) over ``lower`` (sorted, disjoint)."""
    out: list[Segment] = []
    j = 0
    n = len(upper)
    for seg in lower:
        cur = seg.start
        while j < n and upper[j].end <= cur:
            j += 1
        k = j
        while k < n and upper[k].start < seg.end:
            u = upper[k]
            if u.start > cur:
                out.append(_slice(seg, cur, u.start))
            cur = max(cur, u.end)
            if u.end > seg.end:
                break
            k += 1
        if cur < seg.end:
            out.append(_slice(seg, cur, seg.end))
        j = k
    out.extend(upper)
    out.sort(key=lambda s: s.start)
    return _coalesce_zeros(out)


def _slice(seg: Segment, start: int, end: int) -> Segment:
    if start == seg.start and end == seg.end:
        return seg
    off = seg.chunk_offset + (start - seg.start) if seg.chunk is not None else 0
    return Segment(start, end, seg.chunk, off, seg.layer)


def _coalesce_zeros(segs: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segs:
        if out and s.chunk is None and out[-1].chunk is None and out[-1].end == s.start:
            prev = out[-1]
            out[-1] = Segment(prev.start, s.end, None, 0, prev.layer)
        else:
            out.append(s)
    return out


def layer_segments(extents: Iterable[LayerExtent], layer: int, size: int) -> list[Segment]:
    """A layer's extents as segments, clipped to ``size``."""
    segs = []
    for e in extents:
        end = min(e.offset + e.length, size)
        if end > e.offset:
            segs.append(Segment(e.offset, end, e.chunk, 0, layer))
    return segs


class ExtentMap:
    """An immutable flattened map (a new one is built on commit)."""

    __slots__ = ("size", "_starts", "_ends", "_chunks", "_offs", "_layers", "_chunk_set")

    def __init__(self, size: int, segments: Sequence[Segment]) -> None:
        self.size = size
        segs = _normalise(size, segments)
        self._starts = [s.start for s in segs]
        self._ends = [s.end for s in segs]
        self._chunks: list[Digest | None] = [s.chunk for s in segs]
        self._offs = [s.chunk_offset for s in segs]
        self._layers = [s.layer for s in segs]
        self._chunk_set: frozenset[Digest] | None = None

    @classmethod
    def empty(cls, size: int) -> "ExtentMap":
        return cls(size, [])

    @classmethod
    def from_layers(cls, size: int, layers: Sequence[Sequence[LayerExtent]]) -> "ExtentMap":
        """``layers`` bottom first."""
        segs: list[Segment] = [Segment(0, size, None, 0, 0)] if size else []
        for i, extents in enumerate(layers):
            segs = overlay(segs, layer_segments(extents, i, size))
        return cls(size, segs)

    def with_layer(self, extents: Sequence[LayerExtent], layer: int, size: int | None = None) -> "ExtentMap":
        size = self.size if size is None else size
        return ExtentMap(size, overlay(list(self.segments()), layer_segments(extents, layer, size)))

    def __len__(self) -> int:
        return len(self._starts)

    def segments(self) -> Iterator[Segment]:
        for i in range(len(self._starts)):
            yield Segment(self._starts[i], self._ends[i], self._chunks[i], self._offs[i], self._layers[i])

    def lookup(self, offset: int, length: int) -> list[tuple[int, int, Digest | None, int]]:
        """Pieces covering [offset, offset+length) as (offset, length, chunk, chunk_offset)."""
        end = min(offset + length, self.size)
        i = bisect.bisect_right(self._starts, offset) - 1
        if end <= self._ends[i]:      # the common case: one segment (hot path, kept short)
            c = self._chunks[i]
            return [(offset, end - offset, c, self._offs[i] + offset - self._starts[i] if c is not None else 0)]
        out = []
        starts, ends, chunks, offs = self._starts, self._ends, self._chunks, self._offs
        pos = offset
        while pos < end:
            s_end = ends[i]
            n = min(s_end, end) - pos
            c = chunks[i]
            out.append((pos, n, c, offs[i] + pos - starts[i] if c is not None else 0))
            pos += n
            i += 1
        return out

    def chunks(self) -> frozenset[Digest]:
        """Every chunk the map reads (computed once: the map is immutable)."""
        if self._chunk_set is None:
            self._chunk_set = frozenset(c for c in self._chunks if c is not None)
        return self._chunk_set

    def chunks_in(self, offset: int, length: int) -> list[Digest]:
        """Distinct chunks touched by a range, in address order."""
        order: list[Digest] = []
        seen: set[Digest] = set()
        for _, _, c, _ in self.lookup(offset, length):
            if c is not None and c not in seen:
                seen.add(c)
                order.append(c)
        return order

    def stats(self) -> dict[str, int]:
        data = sum(e - s for s, e, c in zip(self._starts, self._ends, self._chunks) if c is not None)
        return {"segments": len(self), "data_bytes": data, "zero_bytes": self.size - data,
                "chunks": len(self.chunks())}


def _normalise(size: int, segments: Sequence[Segment]) -> list[Segment]:
    """Clip to [0,size), fill holes with zeros, so the map covers the image exactly."""
    out: list[Segment] = []
    pos = 0
    for s in sorted(segments, key=lambda s: s.start):
        if s.start >= size:
            break
        if s.start < pos:
            raise ValueError(f"overlapping segments at {s.start}")
        if s.start > pos:
            out.append(Segment(pos, s.start, None))
        out.append(_slice(s, s.start, min(s.end, size)))
        pos = min(s.end, size)
    if pos < size:
        out.append(Segment(pos, size, None))
    return _coalesce_zeros(out)


class StackMaps:
    """Flattened maps of committed stacks, least recently used out, at most
    ``max_segments`` segments in all (~80 bytes each). A stack is named by its layers'
    manifest ids, which are content addresses, so a map built once serves every image
    opened on that stack: the hundredth sandbox of a template does not merge its tens of
    thousands of extents again."""

    def __init__(self, max_segments: int = 1 << 18) -> None:
        self.max_segments = max_segments
        self._maps: OrderedDict[tuple[int, tuple[Digest, ...]], ExtentMap] = OrderedDict()
        self._segments = 0
        self._lock = threading.Lock()
        self._building: dict[tuple[int, tuple[Digest, ...]], threading.Lock] = {}

    def get(self, size: int, stack: Sequence[tuple[Digest, Sequence[LayerExtent]]]) -> ExtentMap:
        """The map of ``stack`` ((manifest id, extents) per layer, bottom first) at ``size``."""
        key = (size, tuple(mid for mid, _ in stack))
        while True:
            with self._lock:
                m = self._maps.get(key)
                if m is not None:
                    self._maps.move_to_end(key)
                    return m
                building = self._building.get(key)
                if building is None:        # this thread builds it
                    building = self._building[key] = threading.Lock()
                    building.acquire()
                    break
            # one build per stack: a fork's sixteen children opening at once wait for the first
            with building:
                pass
        try:
            m = ExtentMap.from_layers(size, [extents for _, extents in stack])
            with self._lock:
                if len(m) <= self.max_segments and key not in self._maps:
                    self._maps[key] = m
                    self._segments += len(m)
                    while self._segments > self.max_segments:
                        _, old = self._maps.popitem(last=False)
                        self._segments -= len(old)
            return m
        finally:
            with self._lock:
                del self._building[key]
            building.release()

    def __len__(self) -> int:
        return len(self._maps)
