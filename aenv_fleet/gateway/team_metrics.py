"""A team's metrics through a gateway: E2B's ``GET /teams/{teamID}/metrics`` and
``/metrics/max`` for the whole fleet, not one node.

Every node samples its own sandboxes of each team (aenv_api/server/team_metrics.py) and
buckets them from the range's start, in a width that depends on the range's length.
The gateway asks every live node for the same explicit range, so all of them answer on
one grid of buckets, and adds them up bucket by bucket: a bucket's concurrent sandboxes
is the sum of each node's most in it (an upper bound when two nodes peak at different
moments of one bucket), its start rate the sum of the nodes' rates. A range the caller
left open is closed first: one round asks each node for its series as it would answer
it, and the earliest bucket any node has (and now) make the range of the second.

The nodes check the credential (a team's key, or the admin's with ``X-Team-ID``): the
first refusal is relayed as it came. A node that does not answer is left out of the sum
(its samples live in its memory only); none answering is 503."""
from __future__ import annotations

import json
import math
import re
import time
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from aenv_wire.errors import error_body
from aenv_wire.listing import iso

from .answers import error, relay
from .forward import NodeClient, forwarded_headers
from .state import FleetView

TEAM_METRICS = re.compile(r"^/teams/([^/]+)/metrics(/max)?$")
METRICS_TIMEOUT = 10.0
METRIC_NAMES = ("concurrent_sandboxes", "sandbox_start_rate")
_PASSED = ("content-type", "retry-after", "x-should-retry")


def _bound(value: str | None, name: str) -> int | None:
    """A range bound as the node's schema takes it (an integer 0..2^62), or 400."""
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps(error_body(400, f"{name} must be an integer")),
                                 content_type="application/json") from None
    if not 0 <= n <= 2**62:
        raise web.HTTPBadRequest(text=json.dumps(error_body(400, f"{name} must be in [0, 2^62]")),
                                 content_type="application/json")
    return n


def merged(answers: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The nodes' series on one grid, summed bucket by bucket (module doc)."""
    sums: dict[int, list[float]] = {}
    for series in answers:
        for b in series:
            s = sums.setdefault(int(b["timestampUnix"]), [0, 0.0])
            s[0] += int(b["concurrentSandboxes"])
            s[1] += float(b["sandboxStartRate"])
    return [{"timestamp": iso(float(ts)), "timestampUnix": ts, "concurrentSandboxes": int(c), "sandboxStartRate": r}
            for ts, (c, r) in sorted(sums.items())]


def maximum(series: list[dict[str, Any]], metric: str, end: int | None) -> dict[str, Any]:
    """E2B's MaxTeamMetric of a merged series: the bucket with the most of ``metric``
    (no bucket: 0, stamped with the range's end, now at most)."""
    key = "concurrentSandboxes" if metric == "concurrent_sandboxes" else "sandboxStartRate"
    best = max(series, key=lambda b: b[key], default=None)
    if best is None:
        when = min(float(end if end is not None else 2**62), time.time())
        return {"timestamp": iso(when), "timestampUnix": int(when), "value": 0.0}
    return {"timestamp": best["timestamp"], "timestampUnix": best["timestampUnix"], "value": float(best[key])}


class FleetTeamMetrics:
    def __init__(self, fleet: FleetView, nodes: NodeClient) -> None:
        self.fleet = fleet
        self.nodes = nodes

    async def _series(self, request: web.Request, team: str, start: int | None,
                      end: int | None) -> list[list[dict[str, Any]]] | web.Response:
        """Every live node's ``/teams/{team}/metrics`` for the range; a refusal as the
        response to give."""
        query = urlencode({k: v for k, v in (("start", start), ("end", end)) if v is not None})
        path = f"/teams/{team}/metrics" + (f"?{query}" if query else "")
        got = await self.nodes.answers([n.url for n in self.fleet.alive()], "GET", path, forwarded_headers(request),
                                       METRICS_TIMEOUT)
        if not got:
            return error(503, "no node of the fleet answered")
        refused = next((a for a in got if a.status != 200), None)
        if refused is not None:
            return relay(refused, passed=_PASSED)
        out: list[list[dict[str, Any]]] = []
        for a in got:
            body = a.json()
            if not isinstance(body, list):
                return error(502, "a node answered the team's metrics with something that is not a list")
            out.append(body)
        return out

    async def handle(self, request: web.Request) -> web.Response:
        m = TEAM_METRICS.match(request.path)
        assert m is not None
        team, is_max = m.group(1), m.group(2) is not None
        try:
            start, end = _bound(request.query.get("start"), "start"), _bound(request.query.get("end"), "end")
        except web.HTTPBadRequest as e:
            return web.Response(status=400, text=e.text, content_type="application/json")
        if start is not None and end is not None and start > end:
            return error(400, "Invalid time range for metrics: start time cannot be after end time")
        metric = request.query.get("metric")
        if is_max and metric not in METRIC_NAMES:
            return error(400, f"metric must be one of {', '.join(METRIC_NAMES)}")
        got = await self._series(request, team, start, end)
        if isinstance(got, web.Response):
            return got
        if start is None or end is None:
            # one grid for every node: the range closed where the earliest node's series starts
            firsts = [int(s[0]["timestampUnix"]) for s in got if s]
            if firsts:
                lo = start if start is not None else min(firsts)
                hi = end if end is not None else math.ceil(time.time())
                again = await self._series(request, team, lo, max(lo, hi))
                if isinstance(again, web.Response):
                    return again
                got = again
        series = merged(got)
        body: Any = maximum(series, str(metric), end) if is_max else series
        return web.Response(text=json.dumps(body), content_type="application/json")
