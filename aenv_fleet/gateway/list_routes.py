"""The gateway's merged reads: ``GET /sandboxes`` (v1: running, no pages), ``GET
/v2/sandboxes`` (filters and pages, list_merge.py) and ``GET /sandboxes/metrics``.

Every live node is asked at once; a node that does not answer in time is named in
``X-Aenv-Missing-Nodes`` and its sandboxes are shown from Redis, as are those of nodes
that are down (named in ``X-Aenv-Down-Nodes``) and those released to the repository.
A node being down is never a 5xx."""
from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Any

from aiohttp import web

from aenv_wire.errors import BadToken, error_body
from aenv_wire.headers import API_KEY_HEADER, AUTHORIZATION_HEADER, NEXT_TOKEN_HEADER, TOTAL_RUNNING_HEADER
from aenv_wire.listing import micros_of, parse_metadata_filter
from aenv_wire.team_keys import DEFAULT_TEAM_ID

from ..coord import Binding
from .forward import Answer, NodeClient, NodeFailed, NodeUnreachable
from .list_merge import NodePage, decode_cursor, listed_from_binding, matches, merge, page_after, shown_state
from .state import FleetView
from .team_auth import TEAM_KEY

LIST_TIMEOUT = 10.0
STATES = ("running", "paused", "lost")     # "lost": the gateway's own (what Redis shows of a lost sandbox)
MISSING_HEADER = "X-Aenv-Missing-Nodes"
DOWN_HEADER = "X-Aenv-Down-Nodes"


def _bad(message: str) -> web.Response:
    return web.Response(status=400, text=json.dumps(error_body(400, message)), content_type="application/json")


def _team(b: Binding) -> str:
    return b.info.get("teamID") or DEFAULT_TEAM_ID


def _key_headers(request: web.Request) -> dict[str, str]:
    """The credentials of ``request``, which the nodes check again."""
    wanted = (API_KEY_HEADER.lower(), AUTHORIZATION_HEADER.lower())
    return {k: v for k, v in request.headers.items() if k.lower() in wanted}


class Lists:
    def __init__(self, fleet: FleetView, nodes: NodeClient) -> None:
        self.fleet = fleet
        self.nodes = nodes

    async def _ask_all(self, path_qs: dict[str, str], headers: dict[str, str]
                       ) -> tuple[dict[str, Answer], list[str]]:
        """``path_qs`` node id -> path and query; (answers by node, nodes that failed)."""
        async def one(nid: str, pq: str) -> tuple[str, Answer | None]:
            try:
                a = await self.nodes.call("GET", self.fleet.url(nid) + pq, headers=headers, timeout=LIST_TIMEOUT)
                return nid, a
            except (NodeUnreachable, NodeFailed):
                return nid, None
        got = await asyncio.gather(*(one(n, pq) for n, pq in path_qs.items()))
        answers = {n: a for n, a in got if a is not None and a.status == 200}
        failed = sorted(n for n, a in got if a is None or a.status >= 500)
        return answers, failed

    async def _redis_shown(self, node_ids: list[str]) -> list[tuple[Binding, str]]:
        """Sandboxes Redis shows: those bound to ``node_ids`` (down or not answering) and
        those released to the repository, with the state each is shown in."""
        ids: list[str] = []
        for nid in node_ids:
            ids += await self.fleet.coord.node_sandbox_ids(nid)
        ids += await self.fleet.coord.released_ids()
        # a node that is up but did not answer: its sandboxes as last recorded; one that is
        # down: paused when a pause was committed, else lost (listing.shown_state)
        return [(b, shown_state(b, self.fleet.is_alive(b.node_id)))
                for b in await self.fleet.coord.bindings(sorted(set(ids)))]

    def _headers(self, missing: list[str], down: list[str]) -> dict[str, str]:
        h = {}
        if missing:
            h[MISSING_HEADER] = ",".join(missing)
        if down:
            h[DOWN_HEADER] = ",".join(down)
        return h

    async def list_sandboxes(self, request: web.Request, v2: bool) -> web.Response:
        q = request.query
        headers = _key_headers(request)
        raw_states = [s for part in q.getall("state", []) for s in part.split(",") if s]
        if any(s not in STATES for s in raw_states):
            return _bad(f"state must be among {', '.join(STATES)}")
        states = tuple(raw_states) if v2 else ("running",)
        metadata_raw = q.get("metadata")
        try:
            metadata = parse_metadata_filter(metadata_raw) if metadata_raw else {}
        except ValueError:
            return _bad("metadata is not a valid filter")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            return _bad("order must be asc or desc")
        desc = order == "desc"
        template = q.get("template")
        started_after = None
        if q.get("startedAfter"):
            try:
                started_after = micros_of(q["startedAfter"])
            except ValueError:
                return _bad("startedAfter must be an RFC 3339 date-time")
        limit = 100
        if v2 and q.get("limit") is not None:
            try:
                limit = int(q["limit"])
            except ValueError:
                return _bad("limit must be an integer")
            if not 1 <= limit <= 100:
                return _bad("limit must be in 1..100")
        try:
            cursor = decode_cursor(q["nextToken"]) if v2 and q.get("nextToken") else None
        except BadToken as e:
            return _bad(str(e))
        node_states = [s for s in (states or ("running", "paused")) if s != "lost"]
        alive = sorted(n.node_id for n in self.fleet.alive())
        down = sorted(n for n in self.fleet.nodes if n not in alive)
        pages: list[NodePage] = []
        missing: list[str] = []
        running: dict[str, int] = {}     # node id -> its X-Total-Running
        if node_states:
            params: dict[str, str] = {}
            if metadata_raw:
                params["metadata"] = metadata_raw
            if v2:
                params.update(state=",".join(node_states), order=order, limit=str(limit))
                if template:
                    params["template"] = template
                if q.get("startedAfter"):
                    params["startedAfter"] = q["startedAfter"]
            base = "/v2/sandboxes?" if v2 else "/sandboxes?"

            async def one(nid: str) -> NodePage | None:
                async def fetch(token: str | None) -> tuple[list[dict[str, Any]], str | None]:
                    pq = base + urllib.parse.urlencode({**params, **({"nextToken": token} if token else {})})
                    a = await self.nodes.call("GET", self.fleet.url(nid) + pq, headers=headers,
                                              timeout=LIST_TIMEOUT)
                    items = a.json()
                    if a.status != 200 or not isinstance(items, list):
                        raise NodeFailed(f"{nid} answered {a.status}")
                    if TOTAL_RUNNING_HEADER in a.headers:   # the node's count of the caller's team
                        running[nid] = int(a.headers[TOTAL_RUNNING_HEADER])
                    return items, a.headers.get(NEXT_TOKEN_HEADER) or None
                try:
                    return await page_after(fetch, cursor if v2 else None, desc)
                except (NodeUnreachable, NodeFailed):
                    return None

            got = await asyncio.gather(*(one(n) for n in alive))
            pages = [p for p in got if p is not None]
            missing = sorted(n for n, p in zip(alive, got) if p is None)
        wanted = tuple(states) if states else ("running", "paused")
        team = request.get(TEAM_KEY, DEFAULT_TEAM_ID)     # Redis' records show every team's: the caller's only
        extra = [item for b, st in await self._redis_shown(sorted(set(down) | set(missing)))
                 if _team(b) == team
                 for item in [listed_from_binding(b, st)]
                 if matches(item, wanted, metadata, template, started_after)]
        if "lost" in wanted:
            extra += await self._lost_on_live_nodes(alive, metadata, template, started_after, team)
        out, token = merge(pages, extra, cursor, desc, limit if v2 else 10**9)
        h = self._headers(missing, [d for d in down if await self.fleet.coord.node_sandbox_ids(d)])
        if token:
            h[NEXT_TOKEN_HEADER] = token
        if v2 and (not states or "running" in states):
            # the caller's team's running sandboxes, as each live node counted them now
            h[TOTAL_RUNNING_HEADER] = str(sum(running.values()))
        return web.Response(status=200, text=json.dumps(out), content_type="application/json", headers=h)

    async def _lost_on_live_nodes(self, alive: list[str], metadata: dict[str, str], template: str | None,
                                  started_after: int | None, team: str) -> list[dict[str, Any]]:
        """Lost sandboxes a live node reported (found dead at its restart): Redis keeps
        them with their note. Only read when ``state=lost`` is asked for."""
        ids: list[str] = []
        for nid in alive:
            ids += await self.fleet.coord.node_sandbox_ids(nid)
        return [item for b in await self.fleet.coord.bindings(ids) if b.state == "lost" and _team(b) == team
                for item in [listed_from_binding(b, "lost")] if matches(item, ("lost",), metadata, template,
                                                                        started_after)]

    async def latest_metrics(self, request: web.Request) -> web.Response:
        headers = _key_headers(request)
        pq = request.rel_url.raw_path_qs
        answers, missing = await self._ask_all({n.node_id: pq for n in self.fleet.alive()}, headers)
        merged: dict[str, Any] = {}
        for a in answers.values():
            body = a.json()
            if isinstance(body, dict) and isinstance(body.get("sandboxes"), dict):
                merged.update(body["sandboxes"])
            elif a.status != 200:
                return web.Response(status=a.status, body=a.body, content_type="application/json")
        return web.Response(status=200, text=json.dumps({"sandboxes": merged}), content_type="application/json",
                            headers=self._headers(missing, []))
