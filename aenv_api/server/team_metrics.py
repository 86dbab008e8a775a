"""E2B's team metrics on one node: ``GET /teams/{teamID}/metrics`` (concurrent sandboxes
and the start rate over time, ``TeamMetric``) and ``GET /teams/{teamID}/metrics/max``
(``MaxTeamMetric``), and the team-labelled Prometheus series.

Recorded here, in the server's memory (a restart starts the series again): every
``interval`` seconds (``[server] team_metrics_interval``, 5 s) a sample per team of its
running sandboxes at that moment and the sandboxes it started since the last sample
(creates, fork children, batches from snapshots, resumes). Each team keeps its newest
``CAPACITY`` samples (12 h at 5 s) in a ring of three fixed arrays: 16 bytes a sample,
~138 KiB a team at most. Teams are made by the admin, so their number (and the Prometheus
label's cardinality) is the deployment's choice.

Answers are bucketed as the sandbox metrics are (metric_series.py ``step_for``: 5 s
buckets under an hour of range, coarser beyond): a bucket's ``concurrentSandboxes`` is the
most seen in it, its ``sandboxStartRate`` the starts in it over its width.
"""
from __future__ import annotations

import asyncio
import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

from aenv_wire.listing import iso

from . import schemas as S
from .errors import ApiError
from .metric_series import step_for
from .metrics import Labels, Metrics
from .principal import principal_of
from .responses import json_response
from .routes import Admin, Call, Reply, Route

log = logging.getLogger(__name__)

CAPACITY = 8640         # samples kept per team
STARTS = "aenv_team_sandbox_starts_total"
METRIC_NAMES = ("concurrent_sandboxes", "sandbox_start_rate")


@dataclass
class TeamSeries:
    """One team's newest samples, a ring: unix second, running sandboxes, starts since the previous."""

    capacity: int = CAPACITY
    stamps: array = field(default_factory=lambda: array("d"))
    running: array = field(default_factory=lambda: array("l"))
    starts: array = field(default_factory=lambda: array("l"))
    head: int = 0           # where the next sample goes once the ring is full

    def add(self, ts: float, running: int, starts: int) -> None:
        if len(self.stamps) < self.capacity:
            self.stamps.append(ts)
            self.running.append(running)
            self.starts.append(starts)
            return
        self.stamps[self.head], self.running[self.head], self.starts[self.head] = ts, running, starts
        self.head = (self.head + 1) % self.capacity

    def between(self, start: float | None, end: float | None) -> list[tuple[float, int, int]]:
        """The samples in ``start``..``end`` (inclusive; None: open), oldest first."""
        n = len(self.stamps)
        order = range(self.head, self.head + n) if n == self.capacity else range(n)
        out = []
        for i in order:
            j = i % n
            ts = self.stamps[j]
            if (start is None or ts >= start) and (end is None or ts <= end):
                out.append((ts, self.running[j], self.starts[j]))
        return out


@dataclass(frozen=True)
class Bucket:
    start: float
    concurrent: int
    rate: float


def buckets(samples: list[tuple[float, int, int]], start: float | None, end: float | None) -> list[Bucket]:
    """``samples`` in E2B's buckets (module doc), each stamped with its start."""
    if not samples:
        return []
    lo = samples[0][0] if start is None else start
    hi = samples[-1][0] if end is None else end
    step = step_for(max(0.0, hi - lo))
    out: dict[int, list[int]] = {}
    for ts, running, starts in samples:
        b = out.setdefault(int((ts - lo) // step), [0, 0])
        b[0] = max(b[0], running)
        b[1] += starts
    return [Bucket(lo + k * step, v[0], v[1] / step) for k, v in sorted(out.items())]


# every team's (running, paused) sandboxes on the node now
TeamCounts = Callable[[], Awaitable[dict[str, tuple[int, int]]]]


class TeamMetrics:
    """The samples of every team, the sampler that takes them, and the routes that answer them."""

    def __init__(self, metrics: Metrics, interval: float = 5.0) -> None:
        self.interval = interval
        self.metrics = metrics
        self._series: dict[str, TeamSeries] = {}
        self._starts: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}
        metrics.gauge("aenv_team_sandboxes", self._gauge,
                      "sandboxes on this node by team and state, as of the last team sample")

    def started(self, team: str, n: int = 1) -> None:
        """``team`` started ``n`` sandboxes just now (create, fork children, resume)."""
        if n < 1:
            return
        self._starts[team] = self._starts.get(team, 0) + n
        self.metrics.inc(STARTS, (("team", team),), n, help="sandboxes started (created, forked, resumed) by team")

    def sample(self, now: float, counts: dict[str, tuple[int, int]]) -> None:
        self._last = counts
        starts, self._starts = self._starts, {}
        for team in set(counts) | set(starts) | set(self._series):
            series = self._series.get(team)
            if series is None:
                series = self._series[team] = TeamSeries()
            series.add(now, counts.get(team, (0, 0))[0], starts.get(team, 0))

    def samples(self, team: str, start: float | None = None,
                end: float | None = None) -> list[tuple[float, int, int]]:
        """``team``'s samples in ``start``..``end``: (unix second, running, starts since the previous)."""
        series = self._series.get(team)
        return series.between(start, end) if series is not None else []

    def _gauge(self) -> list[tuple[Labels, float]]:
        return [((("team", team), ("state", state)), float(c[i]))
                for team, c in sorted(self._last.items()) for i, state in enumerate(("running", "paused"))]

    async def run(self, counts: TeamCounts) -> None:
        """Sample every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                got = await counts()
            except Exception as e:  # noqa: BLE001 - a sample missed must not end the sampler
                log.warning("team metrics: no sample this round: %s", e)
                continue
            self.sample(time.time(), got)

    # --- E2B's routes ----------------------------------------------------------

    def _samples(self, request: web.Request, call: Call) -> tuple[list[tuple[float, int, int]], int | None,
                                                                  int | None]:
        team = call.path["teamID"]
        if principal_of(request).team_id != team:
            # the same answer for another team's id and one that does not exist: ids are no oracle
            raise ApiError(403, f"team {team[:64]!r} is not the team of your API key")
        start, end = call.query["start"], call.query["end"]
        if start is not None and end is not None and start > end:
            raise ApiError(400, "Invalid time range for metrics: start time cannot be after end time")
        return self.samples(team, start, end), start, end

    async def series(self, request: web.Request, call: Call) -> web.Response:
        samples, start, end = self._samples(request, call)
        return json_response([{"timestamp": iso(b.start), "timestampUnix": int(b.start),
                               "concurrentSandboxes": b.concurrent, "sandboxStartRate": b.rate}
                              for b in buckets(samples, start, end)])

    async def maximum(self, request: web.Request, call: Call) -> web.Response:
        samples, start, end = self._samples(request, call)
        best: tuple[float, float] | None = None     # (value, when)
        if call.query["metric"] == "concurrent_sandboxes":
            for ts, running, _ in samples:
                if best is None or running > best[0]:
                    best = (float(running), ts)
        else:
            for b in buckets(samples, start, end):
                if best is None or b.rate > best[0]:
                    best = (b.rate, b.start)
        # no sample in the range: 0, stamped with its end (now at most: an end far off names no time)
        value, when = best if best is not None else (0.0, min(float(end if end is not None else 2**62), time.time()))
        return json_response({"timestamp": iso(when), "timestampUnix": int(when), "value": value})

    def routes(self) -> list[Route]:
        tags = ("auth",)
        forbidden = Reply(403, "not the team of the caller's key", "Error")
        return [
            Route("GET", "/teams/{teamID}/metrics", self.series,
                  "the team's concurrent sandboxes and start rate over time, on this node",
                  (Reply(200, "the samples, bucketed", "TeamMetric[]"), forbidden), query=S.METRICS_QUERY,
                  admin=Admin.ALSO, tags=tags),
            Route("GET", "/teams/{teamID}/metrics/max", self.maximum,
                  "the most of one team metric in the interval, on this node",
                  (Reply(200, "the maximum and when", "MaxTeamMetric"), forbidden), query=S.TEAM_METRICS_MAX,
                  admin=Admin.ALSO, tags=tags),
        ]
