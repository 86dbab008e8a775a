"""The admin's team routes through a gateway (``/admin/...``, and ``/api-keys`` and a
team's metrics called with the admin credential and ``X-Team-ID``). The fleet's teams live in Redis and every
node serves them (aenv_api/server/shared_keys.py), so any live node answers; the node
checks the admin credential (the gateway holds none). What needs the whole fleet is
the gateway's: deleting a team that still has a sandbox on any node (or released to
the repository) is refused (409), and the running and paused counts are summed over
the nodes."""
from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from aenv_wire.headers import ADMIN_TOKEN_HEADER, API_KEY_HEADER

from .answers import error, relay
from .forward import Answer, NodeClient, NodeFailed, NodeUnreachable, forwarded_headers
from .state import FleetView

_DELETE_TEAM = re.compile(r"^/admin/teams/([^/]+)$")
_TEAM_METRICS = re.compile(r"^/teams/[^/]+/metrics(/max)?$")
RUNNING_COUNTS = "/admin/sandboxes/running-counts"
ADMIN_TIMEOUT = 10.0
_PASSED = ("content-type", "retry-after", "x-should-retry")


def is_admin_call(request: web.BaseRequest) -> bool:
    """A call the admin credential authorises (the node's rule: teams_api.py ``Admin``)."""
    path = request.path
    if path.startswith("/admin/"):
        return True
    return ((path == "/api-keys" or path.startswith("/api-keys/") or bool(_TEAM_METRICS.match(path)))
            and ADMIN_TOKEN_HEADER in request.headers and API_KEY_HEADER not in request.headers)


class TeamAdmin:
    def __init__(self, fleet: FleetView, nodes: NodeClient) -> None:
        self.fleet = fleet
        self.nodes = nodes

    async def _call(self, request: web.Request, method: str, path_qs: str, body: bytes | None) -> Answer | None:
        """The first live node's answer (None: none answered)."""
        headers = forwarded_headers(request)
        for n in sorted(self.fleet.alive(), key=lambda n: n.node_id):
            try:
                return await self.nodes.call(method, n.url + path_qs, body, headers, ADMIN_TIMEOUT)
            except (NodeUnreachable, NodeFailed):
                continue
        return None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read() if request.body_exists else None
        m = _DELETE_TEAM.match(request.path)
        if request.method == "DELETE" and m:
            probe = await self._call(request, "GET", "/admin/teams", None)   # the credential, checked by a node
            if probe is None:
                return error(503, "no node of the fleet answered")
            if probe.status != 200:
                return relay(probe, passed=_PASSED)
            held = await self._sandboxes_of(m.group(1))
            if held:
                return error(409, f"team {m.group(1)} still has {held} sandbox(es) in the fleet (running or "
                                   f"paused): kill them first")
        if request.method == "GET" and request.path == RUNNING_COUNTS:
            return await self._running_counts(request)
        a = await self._call(request, request.method, request.rel_url.raw_path_qs, body)
        return relay(a, passed=_PASSED) if a is not None else error(503, "no node of the fleet answered")

    async def _sandboxes_of(self, team: str) -> int:
        coord = self.fleet.coord
        ids: list[str] = []
        for nid in self.fleet.nodes:
            ids += await coord.node_sandbox_ids(nid)
        ids += await coord.released_ids()
        return sum(1 for b in await coord.bindings(sorted(set(ids)))
                   if b.state in ("running", "paused") and b.info.get("teamID") == team)

    async def _running_counts(self, request: web.Request) -> web.Response:
        """Every live node's counts, summed by team."""
        got = await self.nodes.answers([n.url for n in self.fleet.alive()], "GET", RUNNING_COUNTS,
                                       forwarded_headers(request), ADMIN_TIMEOUT)
        if not got:
            return error(503, "no node of the fleet answered")
        refused = next((a for a in got if a.status != 200), None)
        if refused is not None:
            return relay(refused, passed=_PASSED)
        counts: dict[str, list[int]] = {}
        for a in got:
            body: Any = a.json()
            for row in (body or {}).get("teams", []) if isinstance(body, dict) else []:
                c = counts.setdefault(str(row.get("teamID")), [0, 0])
                c[0] += int(row.get("runningSandboxes", 0))
                c[1] += int(row.get("pausedSandboxes", 0))
        return web.Response(text=json.dumps({"teams": [{"teamID": t, "runningSandboxes": r, "pausedSandboxes": p}
                                                       for t, (r, p) in counts.items()]}),
                            content_type="application/json")
