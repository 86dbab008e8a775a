"""Per-team quotas on one node (docs/api.md "Quotas"): what the admin sets for a team
(``TeamQuota``, kept with the team in teams.json, keystore.py) and the gate that holds
every sandbox start of the team to it (``QuotaGate``).

The quotas: running sandboxes, paused sandboxes, creates per second (a token bucket of
one second's worth), concurrent template builds, the bytes the team's volumes may
hold (the volumes' own bounds summed: held by the volume API, volumes_api.py) and the
bytes its named snapshots take (each one's own bytes summed: held by the snapshot route,
snapshot_quota.py). ``None``
is unlimited, the default, and a team with no quota set pays nothing: the gate returns
before taking its lock.

Atomicity: the node's API serves on one event loop. A start of a team with a running
quota takes the gate's lock, counts the team's running sandboxes (the sandbox layer's
records), adds the starts of the team still in flight, and reserves its own before the
lock is let go; the reservation ends when the start has its record (or failed). A
sandbox is therefore always counted once or, for the instant between its record and
the end of its reservation, twice: concurrent starts can be refused a moment early,
never let past the quota. The node's own capacity (``max_sandboxes``, the restore gate)
is checked after, by the sandbox layer, as before.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar

from aenv_wire.cluster import FULL_RETRY_AFTER

from .errors import ApiError

MAX_COUNT = 1_000_000           # a running/paused/builds quota's upper bound (a sane number, not a limit)
MAX_RATE = 10_000.0             # creates per second
MAX_BYTES = 1 << 60             # a byte quota's upper bound (an exbibyte)


@dataclass(frozen=True)
class TeamQuota:
    """A team's quotas; None: unlimited."""

    running: int | None = None
    paused: int | None = None
    creates_per_second: float | None = None
    builds: int | None = None
    volume_bytes: int | None = None
    snapshot_bytes: int | None = None

    # wire (and teams.json) names, E2B-style camelCase
    WIRE: ClassVar[dict[str, str]] = {"running": "runningSandboxes", "paused": "pausedSandboxes",
            "creates_per_second": "createsPerSecond", "builds": "concurrentBuilds",
            "volume_bytes": "volumeBytes", "snapshot_bytes": "snapshotBytes"}

    @property
    def unlimited(self) -> bool:
        return self == TeamQuota()

    def wire(self) -> dict[str, Any]:
        return {w: getattr(self, attr) for attr, w in self.WIRE.items()}

    @classmethod
    def from_wire(cls, raw: Any) -> "TeamQuota":
        """ValueError for anything ``wire`` could not have written."""
        if not isinstance(raw, dict) or set(raw) - set(cls.WIRE.values()):
            raise ValueError(f"not a team quota: {raw!r:.200}")
        values: dict[str, Any] = {}
        for attr, w in cls.WIRE.items():
            v = raw.get(w)
            if v is None:
                continue
            if attr == "creates_per_second":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_RATE:
                    raise ValueError(f"{w} must be a number in (0, {MAX_RATE:g}], got {v!r:.40}")
                values[attr] = float(v)
            else:
                bound = MAX_BYTES if attr in ("volume_bytes", "snapshot_bytes") else MAX_COUNT
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= bound:
                    raise ValueError(f"{w} must be an integer in [0, {bound}], got {v!r:.40}")
                values[attr] = v
        return cls(**values)


@dataclass
class TokenBucket:
    """``rate`` tokens a second, at most ``capacity`` held (one second's worth, at least
    one): over any span T it grants at most ``capacity + rate * T``."""

    rate: float
    capacity: float
    tokens: float
    stamp: float

    @classmethod
    def full(cls, rate: float, now: float) -> "TokenBucket":
        capacity = max(1.0, rate)
        return cls(rate, capacity, capacity, now)

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def take(self, n: int, now: float) -> int:
        """Up to ``n`` whole tokens, as many as there are; how many were taken."""
        self._refill(now)
        got = min(n, int(self.tokens + 1e-9))
        self.tokens -= got
        return got

    def wait(self, now: float) -> float:
        """Seconds until one token is there."""
        self._refill(now)
        return max(0.0, (1.0 - self.tokens) / self.rate)


def over_running(limit: int) -> ApiError:
    # E2B's message for its concurrent-sandbox limit, word for word up to the number, then aenv's hint
    return ApiError(429, f"You have reached the maximum number of concurrent E2B sandboxes ({limit}). Kill or "
                         f"pause one of your team's sandboxes, or ask the deployment's admin for a larger quota",
                    retry=False, retry_after=FULL_RETRY_AFTER)


def over_paused(limit: int) -> ApiError:
    return ApiError(429, f"You have reached the maximum number of paused sandboxes ({limit}) of your team's "
                         f"quota: kill a paused one first", retry=False, retry_after=FULL_RETRY_AFTER)


def over_rate(rate: float, wait: float) -> ApiError:
    return ApiError(429, f"Rate limit exceeded: your team's quota allows {rate:g} sandbox creates per second",
                    retry=True, retry_after=max(1, math.ceil(wait)))


def over_builds(limit: int) -> ApiError:
    return ApiError(429, f"You have reached the maximum number of concurrent template builds ({limit}) of your "
                         f"team's quota: wait for one to finish", retry=False, retry_after=FULL_RETRY_AFTER)


def over_volume_bytes(limit: int, held: int, asked: int) -> ApiError:
    # waiting does not help (volumes keep their bounds until deleted): no Retry-After
    return ApiError(507, f"Your team's volumes may hold {limit} bytes (volumeBytes quota); its volumes' bounds "
                         f"already sum to {held} bytes, so a volume of {asked} more bytes is refused: delete a "
                         f"volume, make a smaller one (maxBytes) or ask the deployment's admin for a larger quota",
                    retry=False)


@dataclass(frozen=True)
class Grant:
    """What a team's quota lets of ``n`` starts asked for: ``granted`` of them, and the
    answer for the rest (None when all were granted)."""

    granted: int
    refusal: ApiError | None = None


# a team's (running, paused) sandboxes on the node now
Counts = Callable[[str], Awaitable[tuple[int, int]]]


@dataclass
class QuotaGate:
    """Holds each team's starts, pauses and builds to its quota (module doc)."""

    quota_of: Callable[[str], TeamQuota]
    counts: Counts
    clock: Callable[[], float] = time.monotonic
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _starting: dict[str, int] = field(default_factory=dict)
    _pausing: dict[str, int] = field(default_factory=dict)
    _buckets: dict[str, TokenBucket] = field(default_factory=dict)
    _builds: dict[str, set[str]] = field(default_factory=dict)
    # sandbox id -> (the lock its resumes pass one at a time, how many hold or wait for it)
    _resume_locks: dict[str, tuple[asyncio.Lock, int]] = field(default_factory=dict)

    def _bucket(self, team: str, rate: float) -> TokenBucket:
        b = self._buckets.get(team)
        if b is None or b.rate != rate:     # a new quota: a bucket at its rate, no more tokens than it had
            fresh = TokenBucket.full(rate, self.clock())
            if b is not None:
                b._refill(self.clock())
                fresh.tokens = min(fresh.capacity, b.tokens)
            b = self._buckets[team] = fresh
        return b

    @contextlib.asynccontextmanager
    async def resume(self, team: str, sandbox_id: str,
                     running_now: Callable[[], Awaitable[bool]]) -> AsyncIterator[Grant]:
        """A resume of ``sandbox_id``: one start of ``team``, held until the block ends.
        Resumes of one sandbox pass one at a time (the sandbox layer runs them so anyway);
        one that finds it running already (``running_now``: another resumed it) is no new
        start, so it is not refused for the sandbox the first one started."""
        if self.quota_of(team).running is None:     # no quota: no lock, no count
            yield Grant(1)
            return
        lock, users = self._resume_locks.get(sandbox_id, (asyncio.Lock(), 0))
        self._resume_locks[sandbox_id] = (lock, users + 1)
        try:
            async with lock:
                if await running_now():
                    yield Grant(1)
                else:
                    async with self.starts(team, 1, create=False) as grant:
                        yield grant
        finally:
            lock, users = self._resume_locks[sandbox_id]
            if users > 1:
                self._resume_locks[sandbox_id] = (lock, users - 1)
            else:
                del self._resume_locks[sandbox_id]

    @contextlib.asynccontextmanager
    async def starts(self, team: str, n: int, *, create: bool) -> AsyncIterator[Grant]:
        """Reserve up to ``n`` sandbox starts of ``team`` (a fork's children: as many as its
        quota leaves room for; the 429 ApiError when not one), held until the block ends.
        ``create``: new sandboxes (creates, fork children), which also take tokens of the
        creates-per-second bucket; a resume takes none."""
        q = self.quota_of(team)
        rate = q.creates_per_second if create else None
        if q.running is None and rate is None:
            yield Grant(n)
            return
        async with self._lock:
            k, refusal = n, None
            if q.running is not None:
                running, _ = await self.counts(team)
                room = q.running - running - self._starting.get(team, 0)
                if room < n:
                    refusal = over_running(q.running)
                    if room < 1:
                        raise refusal
                    k = room
            if rate is not None:
                bucket = self._bucket(team, rate)
                got = bucket.take(k, self.clock())
                if got < k:
                    refusal = over_rate(rate, bucket.wait(self.clock()))
                    if got < 1:
                        raise refusal
                    k = got
            self._starting[team] = self._starting.get(team, 0) + k
        try:
            yield Grant(k, refusal)
        finally:
            self._starting[team] -= k

    @contextlib.asynccontextmanager
    async def pausing(self, team: str) -> AsyncIterator[None]:
        """Hold a pause of ``team``'s sandbox to its paused quota (429 at it)."""
        limit = self.quota_of(team).paused
        if limit is None:
            yield
            return
        async with self._lock:
            _, paused = await self.counts(team)
            if paused + self._pausing.get(team, 0) >= limit:
                raise over_paused(limit)
            self._pausing[team] = self._pausing.get(team, 0) + 1
        try:
            yield
        finally:
            self._pausing[team] -= 1

    def build_started(self, team: str, build: str, active: Callable[[str], bool]) -> None:
        """Count build ``build`` of ``team`` against its concurrent-builds quota (429 at it);
        ``active(build)`` says whether one counted before still runs."""
        limit = self.quota_of(team).builds
        mine = self._builds.setdefault(team, set())
        mine.intersection_update({b for b in mine if active(b)})
        if limit is not None and len(mine) >= limit:
            raise over_builds(limit)
        mine.add(build)
