"""Retries with exponential backoff, as a wrapper around any Backend (restic's
RetryBackend idea): backends stay simple and report failures; the policy of
how often and how long to retry lives here, once.

What is retried: ``BackendError`` (I/O, 5xx, throttling, connection resets),
except ``PermanentError`` (access denied, missing bucket, bad request: asking
again cannot help). ``StoreNotFound``, ``AlreadyExists`` and ``Conflict`` are answers, not
failures, and pass straight through.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, TypeVar

from ...errors import AlreadyExists, BackendError, Conflict, StoreNotFound
from .base import Backend, ObjectInfo

log = logging.getLogger(__name__)

T = TypeVar("T")


class PermanentError(BackendError):
    """A backend failure that retrying cannot fix (access denied, no such bucket, bad request)."""


@dataclass(frozen=True)
class RetryPolicy:
    # Total tries of one operation (1 = no retry).
    attempts: int = 6
    # First backoff; doubles per retry up to max_delay. "Full jitter" (a uniform
    # draw in [0, delay]) keeps many nodes that failed together from retrying in lockstep.
    base_delay: float = 0.05
    max_delay: float = 5.0

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Sleep before each retry (attempts - 1 values)."""
        r = rng or random
        for i in range(self.attempts - 1):
            yield r.uniform(0, min(self.max_delay, self.base_delay * (2 ** i)))

    def call(self, what: str, fn: Callable[[], T], sleep: Callable[[float], None] = time.sleep) -> T:
        """Run ``fn`` until it succeeds, raises a non-retryable error, or attempts run out."""
        delays = self.delays()
        while True:
            try:
                return fn()
            except PermanentError:
                raise
            except BackendError as e:
                delay = next(delays, None)
                if delay is None:
                    raise
                log.info("retrying %s in %.0f ms after: %s", what, delay * 1000, e)
                sleep(delay)


class RetryBackend(Backend):
    """Wraps a backend; every call is retried per ``policy``.

    ``create`` is the delicate one: if an attempt succeeded on the server but its
    answer was lost, the retry sees ``AlreadyExists``. The object then holds our
    own bytes, so an ``AlreadyExists`` on a retry whose stored content equals
    ``data`` counts as success (a rival creator writes different bytes: catalog
    records carry their creation time and content)."""

    def __init__(self, inner: Backend, policy: RetryPolicy | None = None) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()
        self.name = inner.name

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return self.policy.call(what, fn)

    def put(self, key: str, data: bytes) -> None:
        self._call(f"put {key}", lambda: self.inner.put(key, data))

    def put_file(self, key: str, path: Path) -> None:
        self._call(f"put_file {key}", lambda: self.inner.put_file(key, path))

    def move_file(self, key: str, path: Path) -> None:
        # a move that took the file and then failed is not repeated: the retry's copy
        # would find no file (StoreNotFound passes straight through)
        self._call(f"move_file {key}", lambda: self.inner.move_file(key, path))

    def cleanup_tmp(self, older_than: float = 3600.0) -> int:
        return self._call("cleanup_tmp", lambda: self.inner.cleanup_tmp(older_than))

    def create(self, key: str, data: bytes) -> None:
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            try:
                self.inner.create(key, data)
            except AlreadyExists:
                if tries > 1 and self._holds(key, data):
                    return
                raise

        self._call(f"create {key}", attempt)

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.inner.get(key) == data
        except (StoreNotFound, BackendError):
            return False

    def swap(self, key: str, data: bytes, expect: bytes | None) -> None:
        # like create: an attempt that landed but whose answer was lost reads back as a
        # Conflict on the retry, with our own bytes in place
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            try:
                self.inner.swap(key, data, expect)
            except Conflict:
                if tries > 1 and self._holds(key, data):
                    return
                raise

        self._call(f"swap {key}", attempt)

    def get(self, key: str) -> bytes:
        return self._call(f"get {key}", lambda: self.inner.get(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._call(f"get_range {key}", lambda: self.inner.get_range(key, offset, length))

    def open_stream(self, key: str) -> BinaryIO:
        return self._call(f"open_stream {key}", lambda: self.inner.open_stream(key))

    def stat(self, key: str) -> ObjectInfo:
        return self._call(f"stat {key}", lambda: self.inner.stat(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Listing is materialised so a retry restarts it cleanly instead of
        # yielding duplicates from a half-finished first pass.
        return iter(self._call(f"list {prefix}", lambda: list(self.inner.list(prefix))))

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.inner.delete(key))

    def exists(self, key: str) -> bool:
        return self._call(f"exists {key}", lambda: self.inner.exists(key))

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> object:
        # Backend-specific extras (e.g. OssBackend.stats()) stay reachable through the wrapper.
        return getattr(self.inner, name)
