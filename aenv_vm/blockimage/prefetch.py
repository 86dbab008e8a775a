"""Read-ahead and trace prefetch for block images.

* Read-ahead: after two reads in a row that continue where the previous one
  ended, the chunks of the next ``window`` bytes are fetched in the
  background (into the image's chunk memory and the node cache), so a
  sequential reader finds them local.
* Access trace (overlaybd's trace prefetch): while a sandbox boots from a
  template, the order in which chunks were first needed is recorded; a later
  image opened from the same template replays that list as prefetch, so the
  boot's chunks arrive before the guest asks for them.

Trace file layout (little endian): magic ``AENVTRC1``, u32 version (1),
u32 count, then ``count`` 32-byte chunk ids in first-access order.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from aenv_store.errors import CorruptData
from aenv_store.formats.ids import DIGEST_SIZE, Digest

from .extent_map import ExtentMap

if TYPE_CHECKING:
    from .image import BlockImage

log = logging.getLogger(__name__)

TRACE_MAGIC = b"AENVTRC1"
TRACE_VERSION = 1
_TRACE_HEAD = struct.Struct("<8sII")
MAX_TRACE = 1 << 20
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

    def replay(self, chunks: Iterable[Digest]) -> int:
        """Fetch ``chunks`` (a recorded trace) in order in the background; returns how many were queued."""
        wanted = self.image.extent_map.chunks()
        with self._lock:
            todo = list(dict.fromkeys(c for c in chunks if c in wanted and c not in self._queued))
            self._queued.update(todo)
        self._submit_all(todo)
        return len(todo)

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


class TraceRecorder:
    """Records first-access order of an image's chunks (an observer of the image)."""

    def __init__(self, image: "BlockImage", path: Path, limit: int = MAX_TRACE) -> None:
        self.path = Path(path)
        self.limit = limit
        self._seen: set[Digest] = set()
        self.order: list[Digest] = []
        self._lock = threading.Lock()
        image.add_observer(self)

    def on_read(self, extent_map: ExtentMap, offset: int, length: int) -> None:
        pass

    def on_chunk(self, cid: Digest) -> None:
        self.record(cid)

    def close(self) -> None:
        pass

    def record(self, cid: Digest) -> None:
        with self._lock:
            if cid not in self._seen and len(self.order) < self.limit:
                self._seen.add(cid)
                self.order.append(cid)

    def save(self) -> Path:
        with self._lock:
            save_trace(self.path, self.order)
        return self.path


def save_trace(path: Path, chunks: list[Digest]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(_TRACE_HEAD.pack(TRACE_MAGIC, TRACE_VERSION, len(chunks)) + b"".join(chunks))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_trace(path: Path) -> list[Digest]:
    raw = Path(path).read_bytes()
    try:
        magic, version, count = _TRACE_HEAD.unpack_from(raw)
    except struct.error:
        raise CorruptData(f"{path}: truncated trace") from None
    if magic != TRACE_MAGIC or version != TRACE_VERSION or count > MAX_TRACE:
        raise CorruptData(f"{path}: not an access trace v{TRACE_VERSION}")
    body = raw[_TRACE_HEAD.size:]
    if len(body) != count * DIGEST_SIZE:
        raise CorruptData(f"{path}: trace length does not match its count")
    return [Digest(body[i:i + DIGEST_SIZE]) for i in range(0, len(body), DIGEST_SIZE)]
