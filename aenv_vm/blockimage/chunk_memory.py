"""In-memory chunk contents of a block image (what reads use without touching
the store): mappings of node-cache files and private bytes, both LRU."""
from __future__ import annotations

import mmap
import threading
from collections import OrderedDict

from aenv_store.formats.ids import Digest


class ChunkMemory:
    """Chunk contents an image's readers can use without touching the store,
    so hot reads are answered on the event loop.

    Two kinds of entries: read-only mappings of node-cache files (the page
    cache holds the bytes, shared by every image and process on the node;
    bounded by ``max_maps``) and private ``bytes`` (when no cache file exists;
    bounded by ``capacity`` bytes). Both are LRU. A mapping stays valid even if
    the cache later evicts the file (the cache replaces files by rename and
    never rewrites them; chunk contents never change).
    """

    def __init__(self, capacity: int, max_maps: int = 16384) -> None:
        self.capacity = capacity
        self.max_maps = max_maps
        self.used = 0
        self.maps = 0
        self._d: OrderedDict[Digest, bytes | mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, cid: Digest) -> bytes | mmap.mmap | None:
        # move_to_end under a lock: called from the event loop and pool threads at once
        with self._lock:
            data = self._d.get(cid)
            if data is not None:
                self._d.move_to_end(cid)
            return data

    def __contains__(self, cid: Digest) -> bool:
        return cid in self._d

    def put(self, cid: Digest, data: bytes | mmap.mmap) -> None:
        is_map = isinstance(data, mmap.mmap)
        if not is_map and len(data) > self.capacity:
            return
        with self._lock:
            old = self._d.pop(cid, None)
            if old is not None:
                self._account(old, -1)
            self._d[cid] = data
            self._account(data, 1)
            if self.used > self.capacity or self.maps > self.max_maps:
                for key in list(self._d):
                    if self.used <= self.capacity and self.maps <= self.max_maps:
                        break
                    victim = self._d[key]
                    if (isinstance(victim, mmap.mmap) and self.maps > self.max_maps) or \
                            (not isinstance(victim, mmap.mmap) and self.used > self.capacity):
                        del self._d[key]
                        self._account(victim, -1)

    def _account(self, data: bytes | mmap.mmap, sign: int) -> None:
        if isinstance(data, mmap.mmap):
            self.maps += sign
        else:
            self.used += sign * len(data)

    def clear(self) -> None:
        with self._lock:
            # mappings are not closed explicitly: a reader may still be slicing
            # one; they are unmapped when the last reference goes.
            self._d.clear()
            self.used = 0
            self.maps = 0
