"""Read-ahead for block images: after two reads in a row that continue where
the previous one ended, the chunks of the next ``window`` bytes are fetched in
the background (into the image's chunk memory and the node cache), so a
sequential reader finds them local. Every sandbox disk a node opens has one
(aenv_vm/machine/bringup.py, ``[vm] readahead_mib``; a build VM's has none).

Trace prefetch (record the chunks a restored sandbox reads first, replay the
list on the next restore) was measured and removed: docs/block-image.md says why.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from aenv_store.formats.ids import Digest

from .extent_map import ExtentMap

if TYPE_CHECKING:
    from .image import BlockImage

log = logging.getLogger(__name__)

PREFETCH_GROUP = 16      # chunks per background fetch task


class Prefetcher:
    def __init__(self, image: "BlockImage", window: int = 4 << 20, workers: int = 2) -> None:
        self.image = image
        self.window = window
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch")
        self._lock = threading.Lock()
        self._next = -1
        self._streak = 0
        self._queued: set[Digest] = set()
        self._ahead_until = 0
        self.fetched = 0
        self._closed = False
        image.add_observer(self)

    def on_read(self, extent_map: ExtentMap, offset: int, length: int) -> None:
        m = extent_map
        with self._lock:
            self._streak = self._streak + 1 if offset == self._next else 0
            self._next = offset + length
            if self._streak < 2 or self._closed:
                return
            start = max(offset + length, self._ahead_until)
            end = min(offset + length + self.window, m.size)
            if end <= start:
                return
            # Only refill when the reader got within half a window of the
            # prefetched edge: keeps the lookup off most reads.
            if self._ahead_until - (offset + length) > self.window // 2:
                return
            self._ahead_until = end
            todo = [c for c in m.chunks_in(start, end - start)
                    if c not in self._queued and c not in self.image.memory]
            self._queued.update(todo)
        self._submit_all(todo)

    def on_chunk(self, cid: Digest) -> None:
        pass

    def _submit_all(self, cids: list[Digest]) -> None:
        # Groups go to the store as one read_chunks call: neighbouring chunks of
        # a pack are then fetched with one range read.
        for i in range(0, len(cids), PREFETCH_GROUP):
            group = cids[i:i + PREFETCH_GROUP]
            try:
                fut = self._pool.submit(self._fetch, group)
            except RuntimeError:        # closed meanwhile
                return
            fut.add_done_callback(lambda f, g=group: self._done(g, f))

    def _fetch(self, group: list[Digest]) -> None:
        if self._closed or self.image.closed:
            return
        todo = [c for c in group if c not in self.image.memory]
        if todo:
            self.image.fetch_chunks(todo)
            self.fetched += len(todo)

    def _done(self, group: list[Digest], fut: "Future[None]") -> None:
        with self._lock:
            self._queued.difference_update(group)
        exc = fut.exception()
        if exc is not None:
            # A failed prefetch is not an error: the demand read retries and reports.
            log.debug("prefetch of %d chunks failed: %s", len(group), exc)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until queued prefetches finished (tests, benchmarks)."""
        done = threading.Event()
        self._pool.submit(done.set)
        done.wait(timeout)
        # workers > 1: the marker can overtake a fetch; drain what is still queued
        for _ in range(int(timeout * 100)):
            with self._lock:
                if not self._queued:
                    return
            threading.Event().wait(0.01)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
