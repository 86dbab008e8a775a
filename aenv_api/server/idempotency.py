"""``Idempotency-Key`` on sandbox create: a retried create returns the first sandbox.

The SDKs (e2b >= 2.61) send the key on ``POST /v2/sandboxes`` and reuse it
when they retry, so a create whose answer was lost (a timeout, a dropped
connection) does not start a second sandbox. Semantics (E2B's API code for
them is not public; these follow the IETF Idempotency-Key draft):

- the key: 1-255 characters ``[a-z0-9-]`` (what the SDKs allow), else 400;
- within ``window`` seconds of the first use, the same key with the same
  request (path and JSON body) answers the sandbox the first create made,
  again 201, with ``Idempotent-Replayed: true``; a retry that arrives while
  the first create still runs waits for it and gets the same answer;
- the same key with a different request is 422 (a client bug: reusing a key);
- a first create that failed is forgotten, so a retry can succeed;
- keys are kept in memory (bounded, oldest dropped): a server restart
  forgets them.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from .errors import ApiError

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
WINDOW_SECONDS = 3600.0
MAX_KEYS = 10_000
_KEY = re.compile(r"[a-z0-9-]{1,255}")


def parse_key(raw: str | None) -> str | None:
    if raw is None:
        return None
    if not _KEY.fullmatch(raw):
        raise ApiError(400, f"{HEADER} must be 1-255 lowercase letters, digits or hyphens", retry=False)
    return raw


def fingerprint(path: str, body: dict[str, Any]) -> str:
    canon = json.dumps([path, body], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclass
class _Entry:
    fingerprint: str
    expires: float
    result: asyncio.Future[str]     # the sandbox id the first create made


class IdempotentCreates:
    def __init__(self, window: float = WINDOW_SECONDS, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.max_keys = max_keys
        self.clock = clock
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()

    def _expire(self, now: float) -> None:
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires > now and len(self._entries) <= self.max_keys:
                break
            del self._entries[key]

    async def run(self, key: str, fp: str, create: Callable[[], Awaitable[str]]) -> tuple[str, bool]:
        """``(sandbox id, replayed)``: ``create()`` runs once per key and window."""
        now = self.clock()
        self._expire(now)
        entry = self._entries.get(key)
        if entry is not None:
            if entry.fingerprint != fp:
                raise ApiError(422, f"{HEADER} {key!r} was used for a different create request within "
                                    f"{int(self.window)} s", retry=False)
            return await asyncio.shield(entry.result), True
        entry = _Entry(fp, now + self.window, asyncio.get_running_loop().create_future())
        self._entries[key] = entry
        try:
            sid = await create()
        except BaseException as e:
            if self._entries.get(key) is entry:
                del self._entries[key]
            if not entry.result.done():
                entry.result.set_exception(e if isinstance(e, Exception) else ApiError(503, "create cancelled"))
                entry.result.exception()   # retrieved: no "never retrieved" warning without waiters
            raise
        entry.result.set_result(sid)
        return sid, False
