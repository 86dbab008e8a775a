"""Batched LRU touches and counter deltas of one NodeCache instance.

A hit must not cost a write transaction, so the access time it produces and the
counters it bumps are queued in memory and written to LMDB in batches (every
TOUCH_BATCH hits or TOUCH_INTERVAL seconds, with a put's transaction, and before
this process evicts): LRU order across processes lags by at most that much."""
from __future__ import annotations

import logging
import threading
import time

import lmdb

from .index import COUNTERS, IndexDbs

log = logging.getLogger(__name__)

TOUCH_BATCH = 512       # queued LRU touches that trigger a flush
TOUCH_INTERVAL = 1.0    # seconds: queued touches/counters are flushed at least this often (on activity)


class Pending:
    """Thread-safe queue of touches (digest -> newest access ns) and counter deltas."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._touches: dict[bytes, int] = {}
        self._deltas: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._last_flush = time.monotonic()

    def note(self, digest: bytes, counter: str | None = None) -> bool:
        """Queue an access (and a counter bump); True if a flush is due."""
        with self._lock:
            self._touches[digest] = time.time_ns()
            if counter:
                self._deltas[counter] += 1
            return (len(self._touches) >= TOUCH_BATCH
                    or time.monotonic() - self._last_flush >= TOUCH_INTERVAL)

    def count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self._deltas[counter] += n

    def take(self) -> tuple[dict[bytes, int], dict[str, int]]:
        with self._lock:
            touches, self._touches = self._touches, {}
            deltas, self._deltas = self._deltas, dict.fromkeys(COUNTERS, 0)
            self._last_flush = time.monotonic()
        return touches, deltas

    def restore(self, touches: dict[bytes, int], deltas: dict[str, int]) -> None:
        """Put back what a failed transaction took."""
        with self._lock:
            for d, t in touches.items():
                self._touches[d] = max(t, self._touches.get(d, 0))
            for k, v in deltas.items():
                self._deltas[k] += v

    @staticmethod
    def apply(txn: lmdb.Transaction, db: IndexDbs, touches: dict[bytes, int], deltas: dict[str, int]) -> None:
        for digest, when in touches.items():
            db.touch(txn, digest, when)
        for name, delta in deltas.items():
            db.add_u64(txn, name.encode(), delta)

    def flush(self, env: lmdb.Environment, db: IndexDbs, path: object) -> None:
        touches, deltas = self.take()
        if not touches and not any(deltas.values()):
            return
        try:
            with env.begin(write=True) as txn:
                self.apply(txn, db, touches, deltas)
        except lmdb.Error as e:
            self.restore(touches, deltas)
            log.warning("node cache %s: cannot record accesses: %s", path, e)
