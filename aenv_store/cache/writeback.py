"""Write-behind of the node cache's fills for byte readers.

A reader that takes a fill's chunks as bytes does not need them on disk before
it goes on, and a segment written with O_DIRECT waits for the disk (4 MiB took
8-20 ms here). So such fills are handed to one background thread that writes
and indexes them, then releases their cross-process fetch locks: another
process that wants one of those chunks waits on its lock as before and finds it
cached. Inside the process, a chunk handed over but not yet indexed is served
from memory (``get``), so nobody fetches it twice. At most DEPTH fills wait,
then the reader waits too (the disk sets the pace, memory stays bounded);
``drain`` waits until everything handed over is indexed (close, stats, verify
and the callers that must see this instance's own writes)."""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Sequence

from ..formats.ids import Digest

log = logging.getLogger(__name__)

DEPTH = 4   # fills waiting to be written (a BlobReader's window each: up to 4 x 16 MiB)
# Threads writing fills: an O_DIRECT write waits for the disk with the GIL released, so a
# second writer keeps the disk busy while the first indexes (one writer kept a cold
# sequential reader waiting ~30 % of its time for room in the queue)
WRITERS = 2

Items = Sequence[tuple[Digest, bytes]]


class WriteBehind:
    def __init__(self, store: Callable[[Items], object], name: str) -> None:
        self._store = store
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Items, Callable[[], None]]] = deque()
        self._unwritten: dict[Digest, bytes] = {}
        self._busy = 0          # fills being written now
        self._threads: list[threading.Thread] = []

    def submit(self, items: Items, release: Callable[[], None]) -> None:
        """Store ``items`` in the background, then call ``release`` (also if storing fails)."""
        with self._cond:
            while len(self._queue) >= DEPTH:
                self._cond.wait()
            self._queue.append((items, release))
            for digest, data in items:
                self._unwritten[digest] = data
            if len(self._threads) < min(WRITERS, len(self._queue) + self._busy):
                thread = threading.Thread(target=self._run, name=f"aenv-cache-write-{self._name}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify_all()

    def get(self, digest: Digest) -> bytes | None:
        """The bytes of a chunk handed over and not yet indexed, else None."""
        with self._cond:
            return self._unwritten.get(digest)

    def get_many(self, digests: Sequence[Digest]) -> dict[Digest, bytes]:
        """``get`` of several chunks under one lock: those handed over and not yet indexed."""
        with self._cond:
            if not self._unwritten:
                return {}
            return {d: data for d in digests if (data := self._unwritten.get(d)) is not None}

    def drain(self) -> None:
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def close(self) -> None:
        """Drain and stop the threads."""
        self.drain()
        with self._cond:
            threads, self._threads = self._threads, []
            for _ in threads:
                self._queue.append(((), lambda: None))  # a stop mark per thread: an empty batch
            self._cond.notify_all()
        for thread in threads:
            thread.join()
        with self._cond:
            self._queue.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                items, release = self._queue.popleft()
                if not items:
                    return
                self._busy += 1
                self._cond.notify_all()  # room in the queue
            try:
                self._store(items)
            except Exception:  # noqa: BLE001 - best effort like every put; the reader has its bytes
                log.exception("node cache %s: write-behind of %d chunk(s) failed", self._name, len(items))
            finally:
                try:
                    release()
                finally:
                    with self._cond:
                        for digest, data in items:
                            if self._unwritten.get(digest) is data:
                                del self._unwritten[digest]
                        self._busy -= 1
                        self._cond.notify_all()
