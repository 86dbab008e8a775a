"""The gateway's operations that choose or change a sandbox's node: create (placed by
the scheduler), connect/resume (on its node when it can, else adopted by another from
the shared repository), fork beyond one node, and drain.

Placement is ``Coordinator.place``: capacity filter, a score preferring nodes whose
cache holds the template, and an atomic slot reservation in Redis that the create's
end releases (scripts.py). A node that answers 429 (full after all) or cannot be
connected to is excluded and the next best one tried.

Moving a paused sandbox uses the nodes' cluster routes (aenv_wire/cluster.py,
docs/cluster.md): ``release`` on the node that holds it (when it is up), ``adopt`` on
the new one; each node's agent moves the binding in Redis as its node changes, and
the normal connect then resumes it there. What a node answered is read by its
``ClusterCode``, never by its message. The gateway writes a binding only when no live
node holds the sandbox (docs/cluster.md, "Who writes a binding").
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import math
from typing import Any, Callable

from aiohttp import web

from aenv_wire.cluster import FULL_RETRY_AFTER, ClusterCode, adopt_path, answer_code, release_path
from aenv_wire.headers import API_KEY_HEADER, AUTHORIZATION_HEADER, RETRY_AFTER_HEADER, SHOULD_RETRY_HEADER
from aenv_wire.team_keys import DEFAULT_TEAM_ID

from ..coord import Binding, CoordError, TeamGrant, TeamQuotaExceeded
from .answers import NODE_HEADER, error, relay
from .errors import GatewayError, SandboxLost
from .forward import Answer, NodeClient, NodeFailed, NodeUnreachable, forwarded_headers
from .list_merge import lost_note, shown_state
from .state import FleetView
from .volumes import FleetVolumes
from .team_auth import TEAM_KEY

log = logging.getLogger(__name__)

PLACE_ATTEMPTS = 4
MAX_FORK = 100               # children per fork call: E2B's bound on count
FORK_CREATES = 16            # children from a snapshot being created at once, over the fleet
IDEMPOTENCY_HEADER = "Idempotency-Key"
HOLDER_BACK_WAIT = 15.0     # a holder that reclaimed its sandbox shows alive again within this (heartbeats)
COMMIT_WAIT = 120.0         # how long a fork snapshot's or a pause's background commit is waited for
# E2B's default team (the nil UUID, what every node calls the deployment key's team)
DEFAULT_TEAM = "00000000-0000-0000-0000-000000000000"


def request_team(request: web.Request) -> str:
    """The team of a request the gateway let in, as its key check found it (app.py
    ``_authorized``, team_auth.py): whose quota a start counts against."""
    return str(request.get(TEAM_KEY) or DEFAULT_TEAM)


def over_team_quota(e: TeamQuotaExceeded) -> web.Response:
    """A team's quota's 429, the node's words (aenv_api/server/quotas.py): E2B's body, no
    ``error_code`` (no other node would take it: the gateway relays it as it is)."""
    if e.kind == "rate":
        return error(429, f"Rate limit exceeded: your team's quota allows {e.limit:g} sandbox creates per second",
                    {SHOULD_RETRY_HEADER: "true", RETRY_AFTER_HEADER: str(max(1, math.ceil(e.wait)))})
    if e.kind == "paused":
        return error(429, f"You have reached the maximum number of paused sandboxes ({e.limit:g}) of your team's "
                         f"quota: kill a paused one first",
                    {SHOULD_RETRY_HEADER: "false", RETRY_AFTER_HEADER: str(FULL_RETRY_AFTER)})
    return error(429, f"You have reached the maximum number of concurrent E2B sandboxes ({e.limit:g}). Kill or "
                     f"pause one of your team's sandboxes, or ask the deployment's admin for a larger quota",
                {SHOULD_RETRY_HEADER: "false", RETRY_AFTER_HEADER: str(FULL_RETRY_AFTER)})


def _refusal_child(e: TeamQuotaExceeded) -> dict[str, Any]:
    """A child a team's quota refused, as a fork's answer lists it."""
    body = json.loads(over_team_quota(e).text or "{}")
    return {"error": {"code": 429, "message": body.get("message", "team quota")}}


def _not_here(a: Answer) -> bool:
    """The node starts nothing now, another may: it is full, or it lost its fleet lease
    (fenced until it renews and recovers)."""
    return answer_code(a.body) in (ClusterCode.FULL, ClusterCode.FENCED)


def _retry_after(a: Answer) -> int | None:
    """A node's 429 that asks to be retried (its restore queue was long): after how long."""
    headers = {k.lower(): v for k, v in a.headers.items()}
    if headers.get(SHOULD_RETRY_HEADER.lower(), "").strip().lower() != "true":
        return None
    value = headers.get(RETRY_AFTER_HEADER.lower(), "").strip()
    return int(value) if value.isdecimal() and len(value) < 6 else None


def no_room(message: str, queued_retry_after: int | None) -> web.Response:
    """The gateway's 429 when no node took a sandbox: retried by the SDK after the soonest
    ``Retry-After`` of a node whose queue was long; not retried when every node was full
    (room comes only when somebody kills a sandbox), with a hint for harnesses that poll."""
    if queued_retry_after is not None:
        headers = {SHOULD_RETRY_HEADER: "true", RETRY_AFTER_HEADER: str(queued_retry_after)}
    else:
        headers = {SHOULD_RETRY_HEADER: "false", RETRY_AFTER_HEADER: str(FULL_RETRY_AFTER)}
    return error(429, message, headers, error_code=ClusterCode.FULL.value)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body.strip() else {}
    except ValueError:
        return None


class Moves:
    def __init__(self, fleet: FleetView, nodes: NodeClient, volumes: FleetVolumes) -> None:
        self.fleet = fleet
        self.nodes = nodes
        self.volumes = volumes          # a create with volumeMounts goes to its volumes' node
        self.team_of: Callable[[web.Request], str] = request_team   # whose quota a start counts against

    async def _settle(self, team: str, grant: TeamGrant, answers: list[Any]) -> None:
        """The starts ``grant`` reserved made the sandboxes in ``answers`` (a create's answer, a
        fork's children): each counted for ``team`` (Redis: TEAM_SETTLE); the rest let go."""
        made = [a["sandboxID"] for a in answers if isinstance(a, dict) and isinstance(a.get("sandboxID"), str)]
        for i, sid in enumerate(made[:grant.granted]):
            await self.fleet.coord.team_settle(team, grant.member(i), sid)
        if len(made) < grant.granted:
            await self.fleet.coord.team_unreserve(team, grant.rid, grant.granted)

    # --- create --------------------------------------------------------------------------

    async def place_and_call(self, template: str, method: str, path: str, body: bytes, headers: dict[str, str],
                             exclude: tuple[str, ...] = (), team: str = "") -> tuple[str, Answer] | web.Response:
        """Reserve a node, call it, release the reservation; next node on 429 or when
        it cannot be reached. ``team``: a create of that team, whose quota the first
        placement checks and reserves in the same Redis step (a refusal: its 429); the
        sandbox made is then counted for the team."""
        held: list[TeamGrant] = []     # the team's start, once the first placement reserved it
        try:
            got = await self._place_and_call(template, method, path, body, headers, exclude, team, held)
        except TeamQuotaExceeded as e:
            return over_team_quota(e)
        except BaseException:
            if held:
                await self.fleet.coord.team_unreserve(team, held[0].rid)
            raise
        if held:
            answer = got[1].json() if isinstance(got, tuple) and got[1].status == 201 else None
            await self._settle(team, held[0], [answer])
        return got

    async def _place_and_call(self, template: str, method: str, path: str, body: bytes, headers: dict[str, str],
                              exclude: tuple[str, ...], team: str,
                              held: list[TeamGrant]) -> tuple[str, Answer] | web.Response:
        tried = list(exclude)
        soonest: int | None = None      # the soonest Retry-After of a node whose restore queue was long
        for _ in range(PLACE_ATTEMPTS):
            if team and not held:
                got = await self.fleet.coord.place(template, 0, tuple(tried), team=team)
                if got is not None:     # the team's start is reserved with this first slot
                    held.append(TeamGrant(got[1], 1, None))
            else:
                got = await self.fleet.coord.place(template, 0, tuple(tried))
            if got is None:
                break
            node, rid = got
            url = self.fleet.url(node)
            try:
                if not url:     # Redis placed it, but no record of it carries the fleet's signature
                    log.warning("gateway: placement chose node %r, whose record is not signed: passed over", node)
                    tried.append(node)
                    continue
                a = await self.nodes.call(method, url + path, body, headers)
            except NodeUnreachable:
                tried.append(node)
                continue
            finally:
                await self.fleet.coord.unreserve(node, rid)
            if _not_here(a):
                tried.append(node)
                after = _retry_after(a)
                if after is not None:
                    soonest = after if soonest is None else min(soonest, after)
                continue
            return node, a
        up = len(self.fleet.alive())
        return no_room(f"no node has room for a sandbox ({up} node(s) up; full, busy, drained, or tried: "
                       f"{', '.join(tried) or 'none'})", soonest)

    async def create(self, request: web.Request, body: bytes) -> web.Response:
        req = _json(body)
        if not isinstance(req, dict):
            return error(400, "request body must be a JSON object")
        template = req.get("templateID") or req.get("template_id") or ""
        if not isinstance(template, str):
            return error(400, "templateID must be a string")
        headers = forwarded_headers(request)
        pinned = await self.volumes.mounts_node(req.get("volumeMounts"))
        if isinstance(pinned, web.Response):
            return pinned
        # placed only on the node of its volumes: every other node is passed over
        exclude = tuple(n.node_id for n in self.fleet.alive() if n.node_id != pinned) if pinned else ()
        given = request.headers.get(IDEMPOTENCY_HEADER)
        # per team, as on a node: another team's same key is another create
        key = f"{request.get(TEAM_KEY, DEFAULT_TEAM_ID)}:{given}" if given else None
        if key:
            # a retried create must reach the node that has the first one (it replays it)
            first = await self.fleet.coord.claim_idempotency(key)
            if first == "pending":
                return error(409, f"a create with this {IDEMPOTENCY_HEADER} is in progress; retry shortly")
            if first is not None and self.fleet.is_alive(first):
                a = await self.nodes.call("POST", self.fleet.url(first) + request.rel_url.raw_path_qs, body,
                                          headers)
                return relay(a, first)
        try:
            got = await self.place_and_call(template, "POST", request.rel_url.raw_path_qs, body, headers,
                                            exclude, team=self.team_of(request))
        except BaseException:
            if key:
                await self.fleet.coord.settle_idempotency(key, None)
            raise
        if isinstance(got, web.Response) or got[1].status >= 400:
            if key:
                await self.fleet.coord.settle_idempotency(key, None)
            return got if isinstance(got, web.Response) else relay(got[1], got[0])
        node, a = got
        if key:
            await self.fleet.coord.settle_idempotency(key, node)
        return relay(a, node)

    # --- connect / resume ----------------------------------------------------------------

    async def connect(self, request: web.Request, sid: str, body: bytes) -> web.Response:
        b = await self.fleet.binding(sid)
        if b is None:
            return error(404, f"sandbox {sid} not found", sandboxId=sid)
        if b.state != "paused":
            return await self._connect(request, b, body)
        # resuming is a start of the team: its running quota holds it (no creates-per-second token)
        team = self.team_of(request)
        grant = await self.fleet.coord.team_reserve(team, 1, create=False)
        if grant.granted < 1 and grant.refusal is not None:
            return over_team_quota(grant.refusal)
        resp: web.Response | None = None
        try:
            resp = await self._connect(request, b, body)
        finally:
            await self._settle(team, grant, [{"sandboxID": sid}] if resp is not None and resp.status in (200, 201)
                               else [])
        return resp

    async def _connect(self, request: web.Request, b: Binding, body: bytes) -> web.Response:
        sid = b.sandbox_id
        path = request.rel_url.raw_path_qs
        headers = forwarded_headers(request)
        old = b.node_id
        if old and await self.fleet.alive_now(old):
            n = self.fleet.nodes[old]
            fits = not n.drained and n.mem_avail_mib >= max(n.sandbox_mem_mib, 1)
            if b.state == "running" or fits:
                a = await self.nodes.call("POST", n.url + path, body, headers)
                if not _not_here(a) or b.state == "running":
                    return relay(a, old)
            # full or drained: hand it to another node (its agent records the release)
            r = await self.nodes.call("POST", n.url + release_path(sid), None, _keys(headers))
            code = answer_code(r.body)
            if code in (ClusterCode.NOT_PAUSED, ClusterCode.NOT_MOVABLE):     # running after all: it stays
                return relay(await self.nodes.call("POST", n.url + path, body, headers), old)
            if code is ClusterCode.NOT_HELD:   # the node has no copy: nobody holds it, the gateway records it
                await self.fleet.coord.release(sid, old)
            elif r.status != 204:
                return relay(r, old)
        elif shown_state(b, False) == "lost":
            raise SandboxLost(sid, lost_note(b))
        answer = await self._adopt_and_connect(b, path, body, headers)
        if old and answer.status == 409 and isinstance(answer.body, bytes) \
                and answer_code(answer.body) is ClusterCode.RESUMED_ELSEWHERE \
                and await self._back_again(old):
            # the holder renewed its lease and reclaimed the sandbox while the adopter waited
            # for its self-fence (docs/cluster.md, "Fencing"): it runs there, the client goes there
            fresh = await self.fleet.binding(sid)
            if fresh is not None and fresh.node_id == old:
                return await self._connect(request, fresh, body)
        return answer

    async def _back_again(self, node_id: str, wait: float = HOLDER_BACK_WAIT) -> bool:
        """Whether ``node_id`` is (or within ``wait`` seconds becomes) alive to this gateway."""
        deadline = time.monotonic() + wait
        while not self.fleet.is_alive(node_id):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.25)
        return True

    async def _adopt_and_connect(self, b: Binding, path: str, body: bytes,
                                 headers: dict[str, str]) -> web.Response:
        got = await self.adopt(b, headers)
        if isinstance(got, web.Response):
            return got
        return relay(await self.nodes.call("POST", self.fleet.url(got) + path, body, headers), got)

    async def kill_orphan(self, b: Binding, headers: dict[str, str]) -> web.Response:
        """Kill a paused sandbox no live node holds (released, or its node is down): a node
        adopts it and kills it, so its pause record leaves the repository too (and that
        node's agent its binding)."""
        try:
            got = await self.adopt(b, headers)
        except SandboxLost:     # nothing in the repository to remove: only its binding goes
            await self.fleet.coord.unbind(b.sandbox_id)
            self.fleet.forget(b.sandbox_id)
            return web.Response(status=204)
        if isinstance(got, web.Response):
            return got
        a = await self.nodes.call("DELETE", self.fleet.url(got) + f"/sandboxes/{b.sandbox_id}", None,
                                  _keys(headers))
        if a.status == 404:      # the adopter does not hold it after all: nobody does
            await self.fleet.coord.unbind(b.sandbox_id, got)
        if a.status in (204, 404):
            self.fleet.forget(b.sandbox_id)
        return relay(a, got)

    async def adopt(self, b: Binding, headers: dict[str, str]) -> str | web.Response:
        """A node that adopted ``b`` from the repository (its agent bound it there), or the
        answer saying why none could; SandboxLost when the repository has no pause of it
        (then marked lost in Redis)."""
        sid = b.sandbox_id
        template = str(b.info.get("templateID", ""))
        exclude = (b.node_id,) if b.node_id else ()
        # its node is gone (not released by it): the repository's pause record may say it
        # was resumed there since; the fleet knows that copy is dead, so the last pause wins
        force = bool(b.node_id) and not self.fleet.is_alive(b.node_id)
        # a pause is committed to the repository in the background: until then adopt is
        # 404, so a recent pause is waited for (a node that died inside the commit never
        # finishes it: then the wait ends and the sandbox is lost)
        wait_until = (b.paused_at or 0) + COMMIT_WAIT
        while True:
            got = await self.place_and_call(template, "POST", adopt_path(sid, force), b"", _keys(headers),
                                            exclude)
            if isinstance(got, web.Response):
                return got
            node, a = got
            code = answer_code(a.body)
            if code is not ClusterCode.NOT_COMMITTED or time.time() > wait_until:
                break
            await asyncio.sleep(1.0)
        if code is ClusterCode.NOT_COMMITTED:
            note = (f"its node {b.node_id or '?'} is gone and the repository holds no committed pause of it "
                    f"(adopt by {node}: {a.body.decode(errors='replace')[:200]})")
            await self.fleet.coord.mark_lost(sid, note)
            raise SandboxLost(sid, note)
        if a.status != 200 and code is not ClusterCode.ALREADY_HELD:
            return relay(a, node)      # cannot move (volume mounts, template gone, ...): the node says why
        self.fleet.forget(sid)
        log.info("gateway: %s adopted by %s (was on %s)", sid, node, b.node_id or "the repository")
        return node

    # --- fork ----------------------------------------------------------------------------

    async def fork(self, request: web.Request, sid: str, body: bytes) -> web.Response:
        parsed = _fork_request(body)
        if isinstance(parsed, web.Response):
            return parsed
        req, count = parsed
        b = await self.fleet.binding(sid)
        if b is None:
            return error(404, f"sandbox {sid} not found", sandboxId=sid)
        if not (b.node_id and self.fleet.is_alive(b.node_id)):
            return error(409, f"sandbox {sid} is not running on a node that is up; only a running sandbox is forked")
        parent = self.fleet.nodes[b.node_id]
        headers = forwarded_headers(request)
        # on the parent's node as many as it has room for: they share its memory; the rest
        # (and those its restore queue refused, 429 each) start elsewhere from the fork's
        # snapshot. Its room is read from Redis now (the cached view is as old as the last
        # refresh, and misses e.g. the parent itself when it was just made); the node stays
        # the judge: a 429 from it sends every child the snapshot way.
        try:
            free = await self.fleet.coord.free_slots(parent.node_id)
        except CoordError:
            free = parent.free_slots
        here = min(count, max(free or 0, 0))
        if b.info.get("volumes"):
            # its volumes are directories of its node: a child elsewhere could not mount them
            # (its template drops the mounts). All go to its node, which makes those it has
            # room for and answers 429 for each other child
            here = count
        team = self.team_of(request)
        results: list[dict[str, Any]] = []
        snapshot_id: str | None = None
        if here > 0:
            # each child is a start of the team: the parent's node makes as many as its quota leaves
            # room for (reserved here); the others, placed one by one, are checked by their placement
            grant = await self.fleet.coord.team_reserve(team, here, create=True)
            if grant.granted < 1 and grant.refusal is not None:
                return over_team_quota(grant.refusal)
            here = grant.granted
            a: Answer | None = None
            try:
                # the children beyond the parent's node start from this fork's own snapshot
                # (a fork child's template), committed by the parent's node in the background
                a = await self.nodes.call_json("POST", parent.url + f"/sandboxes/{sid}/fork", dict(req, count=here),
                                               headers)
            finally:
                made = a.json() if a is not None and a.status == 201 else None
                await self._settle(team, grant, [r.get("sandbox") for r in made if isinstance(r, dict)]
                                   if isinstance(made, list) else [])
            if answer_code(a.body) is ClusterCode.FULL and not b.info.get("volumes"):
                log.info("gateway: fork of %s: its node %s has no room for %d, all %d children go elsewhere",
                         sid, parent.node_id, here, count)
            elif a.status != 201 or b.info.get("volumes"):
                return relay(a, parent.node_id)
            else:
                answered = a.json() or []
                results += [r for r in answered if not _refused_child(r)]
                if len(results) == count:
                    return relay(a, parent.node_id)
                snapshot_id = next((r["sandbox"].get("templateID") for r in results if "sandbox" in r), None)
        rest = count - len(results)
        if snapshot_id is None:
            # no room on the parent's node (or every fork there failed): a snapshot of the parent
            snap = await self.nodes.call_json("POST", parent.url + f"/sandboxes/{sid}/snapshots", {},
                                              _keys(headers))
            snapshot_id = (snap.json() or {}).get("snapshotID") if snap.status == 201 else None
            if snapshot_id is None:
                return relay(snap, parent.node_id)
        create = {"templateID": snapshot_id, "metadata": dict(b.info.get("metadata") or {}), "secure": True}
        if req.get("timeout") is not None:
            create["timeout"] = req["timeout"]
        create_body = json.dumps(create).encode()
        sem = asyncio.Semaphore(FORK_CREATES)
        snap_id = snapshot_id

        async def child() -> dict[str, Any]:
            async with sem:
                deadline = time.monotonic() + COMMIT_WAIT
                while True:
                    try:
                        got = await self.place_and_call(snap_id, "POST", "/v2/sandboxes", create_body,
                                                        {**_keys(headers), "Content-Type": "application/json"},
                                                        exclude=(parent.node_id,) if here else (), team=team)
                    except NodeFailed as e:
                        return {"error": {"code": 502, "message": f"node failed: {e}"}}
                    if isinstance(got, web.Response):
                        return {"error": json.loads(got.text or "{}")}
                    _node, a = got
                    # 404: the fork snapshot's commit has not reached the repository yet
                    if a.status != 404 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(1.0)
                if a.status == 201:
                    return {"sandbox": a.json()}
                err = a.json()
                return {"error": err if isinstance(err, dict) else {"code": a.status, "message": "create failed"}}

        results += await asyncio.gather(*(child() for _ in range(rest)))
        return web.Response(status=201, text=json.dumps(results), content_type="application/json",
                            headers={NODE_HEADER: parent.node_id, "X-Aenv-Fork-Snapshot": snapshot_id})

    async def fork_snapshot(self, request: web.Request, snapshot_id: str, body: bytes) -> web.Response:
        """``POST /snapshots/{snapshotID}/fork`` over the fleet: the batch is split over the
        live nodes with room (by free slots), each node creating its share from the shared
        repository; children a node refused (429: full, or its restore queue long) are
        offered to the others. The first node's answer to a bad request (400, 404) is the
        fleet's."""
        parsed = _fork_request(body)
        if isinstance(parsed, web.Response):
            return parsed
        req, asked = parsed
        # each child is a start of the team: as many as its quota leaves room for
        team = self.team_of(request)
        grant = await self.fleet.coord.team_reserve(team, asked, create=True)
        if grant.granted < 1 and grant.refusal is not None:
            return over_team_quota(grant.refusal)
        resp: web.Response | None = None
        try:
            resp = await self._fork_batch(request, snapshot_id, req, grant.granted)
        finally:
            made = json.loads(resp.text or "[]") if resp is not None and resp.status == 201 else []
            await self._settle(team, grant, [r.get("sandbox") for r in made if isinstance(r, dict)])
        if resp.status != 201 or grant.refusal is None:
            return resp
        refused = [_refusal_child(grant.refusal)] * (asked - grant.granted)
        return web.Response(status=201, text=json.dumps(made + refused), content_type="application/json")

    async def _fork_batch(self, request: web.Request, snapshot_id: str, req: dict[str, Any],
                          count: int) -> web.Response:
        headers = forwarded_headers(request)
        path = request.rel_url.raw_path_qs
        results: list[dict[str, Any]] = []
        refused: dict[str, Any] | None = None        # the last child refusal, for children nobody took
        tried: set[str] = set()
        wrong: tuple[Answer, str] | None = None     # a node's answer that was not a list of children
        # a paused sandbox's id: its node goes first and alone (it waits for the pause's
        # background commit; the others see only what the repository holds so far)
        b = await self.fleet.binding(snapshot_id)
        first = b.node_id if b is not None and b.node_id and self.fleet.is_alive(b.node_id) else None
        for _ in range(PLACE_ATTEMPTS):
            pending = count - len(results)
            if pending <= 0:
                break
            await self.fleet.refresh()
            nodes = sorted((n for n in self.fleet.alive() if n.node_id not in tried and not n.drained
                            and (n.free_slots or 0) > 0
                            and (first is None or n.node_id == first)), key=lambda n: -(n.free_slots or 0))
            if first is not None:
                tried.add(first)
                first = None
                if not nodes:       # no room on its node: the others read the repository
                    continue
            if not nodes:
                break
            shares: list[tuple[Any, int]] = []
            left = pending
            for i, n in enumerate(nodes):
                share = min(left, n.free_slots or 0, -(-left // (len(nodes) - i)))
                if share > 0:
                    shares.append((n, share))
                    left -= share
            answers = await asyncio.gather(*(self.nodes.call_json("POST", n.url + path, dict(req, count=share),
                                                                  headers)
                                             for n, share in shares), return_exceptions=True)
            for (n, share), a in zip(shares, answers):
                if isinstance(a, BaseException):
                    if not isinstance(a, (NodeUnreachable, NodeFailed)):
                        raise a
                    tried.add(n.node_id)
                    continue
                if _not_here(a):
                    tried.add(n.node_id)
                    continue
                if a.status != 201:
                    wrong = wrong or (a, n.node_id)
                    tried.add(n.node_id)
                    continue
                for r in a.json() or []:
                    if _refused_child(r):
                        refused = r
                        tried.add(n.node_id)
                    else:
                        results.append(r)
            if wrong is not None and not results:
                return relay(*wrong)       # the request itself is wrong (or not found): every node says so
        missing = count - len(results)
        if missing > 0:
            why = refused or {"error": {"code": 429, "message": "no node had room for this child"}}
            results += [why] * missing
        return web.Response(status=201, text=json.dumps(results), content_type="application/json")

    # --- drain ---------------------------------------------------------------------------

    async def drain(self, node_id: str, drained: bool, migrate: bool, headers: dict[str, str]) -> dict[str, Any]:
        if not await self.fleet.coord.set_drained(node_id, drained):
            raise GatewayError(404, f"no node {node_id!r} in the fleet")
        await self.fleet.refresh()
        out: dict[str, Any] = {"nodeID": node_id, "drained": drained, "migrated": [], "failed": []}
        if not (drained and migrate):
            return out
        n = self.fleet.nodes.get(node_id)
        if n is None or not self.fleet.is_alive(node_id):
            # a node that is down holds nothing it could pause: its paused sandboxes are
            # already adoptable, its running ones shown paused or lost
            out["note"] = "the node is down: its sandboxes move on their next connect"
            return out
        for b in await self.fleet.coord.bindings(await self.fleet.coord.node_sandbox_ids(node_id)):
            sid = b.sandbox_id
            try:
                if b.state == "running":
                    a = await self.nodes.call_json("POST", n.url + f"/sandboxes/{sid}/pause", {}, headers)
                    if a.status not in (204, 409):
                        out["failed"].append({"sandboxID": sid, "error": a.body.decode(errors="replace")[:300]})
                        continue
                r = await self.nodes.call("POST", n.url + release_path(sid), None, headers)
                if answer_code(r.body) is ClusterCode.NOT_HELD:     # no copy there: the gateway records it
                    await self.fleet.coord.release(sid, node_id)
                elif r.status != 204:
                    out["failed"].append({"sandboxID": sid, "error": r.body.decode(errors="replace")[:300]})
                    continue
                self.fleet.forget(sid)
                out["migrated"].append(sid)
            except (NodeUnreachable, NodeFailed) as e:
                out["failed"].append({"sandboxID": sid, "error": str(e)})
        return out


def _fork_request(body: bytes) -> tuple[dict[str, Any], int] | web.Response:
    """A fork's body and its ``count`` (E2B's 1-100), or the 400 saying what is wrong."""
    req = _json(body)
    if not isinstance(req, dict):
        return error(400, "request body must be a JSON object")
    count = req.get("count", 1)
    if count is None:
        count = 1
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_FORK:
        return error(400, f"count must be an integer in [1, {MAX_FORK}]")
    return req, count


def _refused_child(r: Any) -> bool:
    """A fork's child the node refused for want of room or queue (429): another node may take it."""
    return isinstance(r, dict) and isinstance(r.get("error"), dict) and r["error"].get("code") == 429


def _keys(headers: dict[str, str]) -> dict[str, str]:
    wanted = (API_KEY_HEADER.lower(), AUTHORIZATION_HEADER.lower())
    return {k: v for k, v in headers.items() if k.lower() in wanted}
