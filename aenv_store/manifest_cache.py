"""Decoded manifests kept in memory, least recently used out.

Manifests are content addressed and immutable, so a decoded one is valid for as
long as anybody asks for it by that id. Restoring the hundredth sandbox of a
template reads the same disk manifest (tens of thousands of extents, ~40 ms to
fetch, verify and decode) as the first; this keeps it. Bounded by extents
(about 250 bytes of Python objects each), not by entries, since one memory image
manifest can hold a hundred thousand extents and a state manifest two.

A manifest deleted from the repository (gc) may still be answered from here; its
chunks are gone with it, so a reader of it fails at its first chunk as it would
have at the manifest.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from .formats.ids import Digest
from .formats.manifest import Manifest

DEFAULT_MAX_EXTENTS = 1 << 18      # ~64 MiB of decoded extents


class ManifestCache:
    """Thread-safe LRU of decoded manifests by id, at most ``max_extents`` extents in all
    (a manifest bigger than that alone is decoded each time, never kept)."""

    def __init__(self, max_extents: int = DEFAULT_MAX_EXTENTS) -> None:
        self.max_extents = max_extents
        self._entries: OrderedDict[Digest, Manifest] = OrderedDict()
        self._extents = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, mid: Digest, load: Callable[[Digest], Manifest]) -> Manifest:
        """The manifest ``mid``, from memory or ``load(mid)`` (called without the lock:
        two threads missing the same id both load it, and one copy is kept)."""
        key = Digest(mid)
        with self._lock:
            m = self._entries.get(key)
            if m is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return m
            self.misses += 1
        m = load(key)
        size = len(m.extents) + 1
        if size > self.max_extents:
            return m
        with self._lock:
            if key not in self._entries:
                self._entries[key] = m
                self._extents += size
                while self._extents > self.max_extents:
                    _, old = self._entries.popitem(last=False)
                    self._extents -= len(old.extents) + 1
        return m

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def extents(self) -> int:
        """Extents held now (the bound is ``max_extents``)."""
        return self._extents
