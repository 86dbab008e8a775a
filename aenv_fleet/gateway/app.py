"""``aenv gateway``: the whole E2B API and the sandbox proxy of a fleet on one endpoint.

Design (docs/cluster.md, "Why the gateway routes HTTP"): the gateway does not run a
``SandboxService`` of its own over the nodes; it routes HTTP to them by binding. Every
node already serves the complete E2B API (validation, auth, the API-side records such
as autoResume and proxy rules, envd tokens) for the sandboxes it holds, so the gateway
handles only what needs more than one node -- placement of creates, listing,
cross-node connect/resume, fork beyond one node, drain -- and passes everything else
through, byte for byte and streamed. That keeps it stateless (Redis is its only
state) and keeps the per-sandbox semantics in one place, the node.

Sandbox traffic is recognised as a node does (``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port``
headers, AgentENV's, or ``<port>-<id>.<domain>`` hosts with ``[gateway] domain``; a
host-routed request reaches the node header-routed) and forwarded to the node the
sandbox is bound to.
"""
from __future__ import annotations

import asyncio
import json
import math
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from aenv_dashboard.serve import is_dashboard_path, serve_dashboard
from aenv_http.bodies import is_blank
from aenv_http.runner import MAX_FIELD, MAX_LINE, JsonErrorRunner, bound_port
from aenv_wire.api_key import presented_api_key
from aenv_wire.cluster import PREFIX as CLUSTER_PREFIX
from aenv_wire.headers import (AGENTENV_ID_HEADER, API_KEY_HEADER, AUTHORIZATION_HEADER, REQUEST_ID_HEADER,
                               SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER)
from aenv_wire.routing import is_sdk_connect, is_unrouted_signed_url, parse_host
from aenv_wire.team_keys import DEFAULT_TEAM_ID

from ..config import GatewayConfig
from ..coord import Binding, CoordError, Coordinator, TeamQuotaExceeded
from ..trust import FleetTrust, refuse_open_redis
from .answers import error, json_answer
from .errors import GatewayError, SandboxLost
from .forward import NodeClient, NodeFailed, NodeRefused, NodeUnreachable, forwarded_headers
from .list_merge import listed_from_binding, lost_note, shown_state
from .list_routes import Lists
from .placement import Moves, over_team_quota
from .limits import ClientBuckets
from .signed_urls import SignedOwners
from .state import FleetView
from .volumes import CONTENT as VOLUME_CONTENT, VOLUME, FleetVolumes
from .team_admin import TeamAdmin, is_admin_call as _is_admin_call
from .team_metrics import TEAM_METRICS, FleetTeamMetrics
from .team_auth import TEAM_KEY

log = logging.getLogger(__name__)
access_log = logging.getLogger("aenv.gateway.access")

MAX_BODY = 1 << 20
CLOSE_WAIT = 5.0                # seconds each part of a shutdown may take (close)

_CREATE = re.compile(r"^/(?:v2/)?sandboxes/?$")
_CONNECT = re.compile(r"^/(?:v2/)?sandboxes/([^/]+)/(connect|resume)$")
_FORK = re.compile(r"^/sandboxes/([^/]+)/fork$")
_SNAPSHOT_FORK = re.compile(r"^/snapshots/([^/]+)/fork$")
_SANDBOX = re.compile(r"^/(?:v2/)?sandboxes/([^/]+)(/.*)?$")
_NODE_OP = re.compile(r"^/nodes/([^/]+)/(drain|undrain)$")
_DEPLOYMENT_ONLY = re.compile(r"^/(nodes|cluster/events)(/.*)?$")    # the fleet's operator's, as on a node


class Gateway:
    def __init__(self, config: GatewayConfig, trust: FleetTrust, coord: Coordinator | None = None) -> None:
        self.config = config
        self.trust = trust
        self.coord = coord or Coordinator(config.redis_url, trust.keys, trust.redis)
        # nothing of Redis is used before it is known to ask for a password (trust.py)
        self.fleet = FleetView(self.coord, verify=lambda: refuse_open_redis(trust, self.coord.redis))
        self.nodes = NodeClient(config.node_timeout, trust.keys, config.websocket_max_message, trust.node_tls)
        self.signed = SignedOwners(self.nodes)
        # a client whose keys keep failing is told to wait (each costs a look at Redis'
        # teams document): 5 a second, 50 saved up
        self.refused_keys = ClientBuckets(5.0, 50.0)
        self.lists = Lists(self.fleet, self.nodes)
        self.volumes = FleetVolumes(self.fleet, self.nodes)
        self.moves = Moves(self.fleet, self.nodes, self.volumes)
        self.admin = TeamAdmin(self.fleet, self.nodes)
        self.team_metrics = FleetTeamMetrics(self.fleet, self.nodes)
        self._runner: JsonErrorRunner | None = None
        self.port: int | None = None

    # --- run -----------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        await self.nodes.start()
        await self.fleet.start()
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = JsonErrorRunner(app, access_log=None, auto_decompress=False, handle_signals=False,
                                       shutdown_timeout=2.0, max_line_size=MAX_LINE, max_field_size=MAX_FIELD)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        self.port = bound_port(site, port)
        return self.port

    async def close(self) -> None:
        """Stop serving and let go of nodes and Redis, each part within CLOSE_WAIT: a
        SIGTERM'd gateway exits even when a connection does not close (seen once: a
        gateway sat idle past 30 s after "shutting down", TLS connections to Redis
        still open; each part's wait is logged when it runs out, to find which)."""
        parts: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        if self._runner is not None:
            parts.append(("HTTP server", self._runner.cleanup))
        parts += [("fleet view", self.fleet.close), ("node connections", self.nodes.close),
                  ("Redis", self.coord.close)]
        for what, close in parts:
            try:
                await asyncio.wait_for(close(), CLOSE_WAIT)
            except asyncio.TimeoutError:
                log.warning("gateway shutdown: %s did not close within %.0f s; going on", what, CLOSE_WAIT)

    # --- dispatch ------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        rid = request.headers.get(REQUEST_ID_HEADER) or secrets.token_hex(8)
        try:
            resp = await self._dispatch(request)
        except GatewayError as e:
            resp = error(e.status, e.message, e.headers, **e.extra)
        except CoordError as e:
            resp = error(503, f"the fleet's Redis is unreachable: {e}")
        except NodeUnreachable as e:
            resp = error(502, f"node unreachable: {e}")
        except NodeFailed as e:
            if request.get("streaming"):
                raise ConnectionResetError(str(e)) from None   # the answer is under way: only a cut is left
            resp = error(502, f"node failed: {e}")
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except web.HTTPException as e:
            resp = error(e.status, e.reason or "error")
        except Exception as e:
            log.exception("gateway request %s %s %s failed", rid, request.method, request.path)
            resp = error(500, f"internal error ({type(e).__name__}); request id {rid}")
        if not resp.prepared:
            resp.headers[REQUEST_ID_HEADER] = rid
        if access_log.isEnabledFor(logging.INFO):
            access_log.info("%s %s %s -> %s %.1f ms", rid, request.method, request.path, resp.status,
                            (time.monotonic() - t0) * 1000)
        return resp

    def _sandbox_target(self, request: web.Request) -> tuple[str, dict[str, str]] | None:
        """``(sandbox id, headers to add)`` of sandbox traffic, else None."""
        sid = request.headers.get(SANDBOX_ID_HEADER) or request.headers.get(AGENTENV_ID_HEADER)
        if sid and not is_sdk_connect(request.method, request.path, request.headers):
            return sid, {}
        if self.config.domain:
            hit = parse_host(request.host, self.config.domain)
            if hit is not None:
                return hit[0], {SANDBOX_ID_HEADER: hit[0], SANDBOX_PORT_HEADER: str(hit[1])}
        return None

    async def _authorized(self, request: web.Request) -> str:
        """The caller's team (GatewayError 401: no key of the fleet)."""
        key = presented_api_key(request.headers.getall(API_KEY_HEADER, []),
                                request.headers.getall(AUTHORIZATION_HEADER, []))
        client = request.remote or "?"
        if (wait := self.refused_keys.wait(client)) > 0:
            raise GatewayError(429, "too many requests with an invalid API key from this client: retry later",
                               {"Retry-After": str(max(1, math.ceil(wait)))})
        team = await self.fleet.team_of(key)
        if team is None:
            self.refused_keys.take(client)
            raise GatewayError(401, "Invalid API key: send the deployment's key or a team's, once, in the "
                                    "X-API-Key header")
        request[TEAM_KEY] = team
        return team

    async def _check_team(self, sid: str, team: str) -> None:
        """Another team's sandbox is answered as one that does not exist (ids are no oracle);
        the team is in the sandbox's binding (agent.info_record) and never changes."""
        b = await self.fleet.binding(sid, cached=True)
        if b is not None and (b.info.get("teamID") or DEFAULT_TEAM_ID) != team:
            raise GatewayError(404, f"sandbox {sid} not found", sandboxId=sid)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if not self.fleet.verified:
            # Redis was down at start: nothing of it is used until it proved to ask for a password
            return error(503, self.fleet.refused or "the fleet's Redis is unreachable (its authentication is "
                                                    "checked before any use)")
        target = self._sandbox_target(request)
        if target is not None:
            return await self._proxy(request, *target)
        path, method = request.path, request.method
        if is_dashboard_path(path):
            return await serve_dashboard(request)     # static files, no credential (the page asks with its key)
        if is_unrouted_signed_url(request.path, request.query):
            return await self._signed_file(request)
        m = VOLUME_CONTENT.match(path)
        if m:       # the volume's token, no API key: its node checks it
            where = await self.volumes.content_node(m.group(1))
            if isinstance(where, web.Response):
                return where
            return await self._to_node(request, where[0], where[1] + request.rel_url.raw_path_qs)
        if path == "/health" and method == "GET":
            return web.Response(status=204) if self.fleet.redis_ok else error(503, "redis unreachable")
        if re.sub("/+", "/", path).startswith(CLUSTER_PREFIX + "/"):
            # the nodes' cluster routes take the fleet's node credential, which the gateway adds
            # to what it forwards: passed through, any API key holder would hold it
            return error(403, "the fleet's cluster routes are for its gateways and nodes, not for clients")
        if method == "GET" and TEAM_METRICS.match(path):
            # the whole fleet's, summed over the nodes (each checks the key or admin credential;
            # a key is the gateway's to check first, so a wrong one is not fanned out)
            if not _is_admin_call(request):
                await self._authorized(request)
            return await self.team_metrics.handle(request)
        if _is_admin_call(request):
            return await self.admin.handle(request)     # the admin credential: the nodes check it
        team = await self._authorized(request)
        if _DEPLOYMENT_ONLY.match(path) and team != DEFAULT_TEAM_ID:
            return error(403, "this route is the fleet's own: only the deployment key (the default team's) may "
                              "call it")
        m = _SANDBOX.match(path) or _SNAPSHOT_FORK.match(path)
        if m and m.group(1) != "metrics":
            await self._check_team(m.group(1), team)
        if _CREATE.match(path):
            if method == "POST":
                return await self.moves.create(request, await self._body(request))
            if method == "GET":
                return await self.lists.list_sandboxes(request, v2=path.startswith("/v2/"))
        if path == "/volumes" and method == "POST":
            return await self.volumes.create(request, await self._body(request), team)
        if path == "/volumes" and method == "GET":
            return await self.volumes.list(request)
        m = VOLUME.match(path)
        if m and method in ("GET", "DELETE"):
            return await self.volumes.one(request, m.group(1))
        if path == "/sandboxes/metrics" and method == "GET":
            return await self.lists.latest_metrics(request)
        if path == "/nodes" and method == "GET":
            await self.fleet.refresh()      # an operator reads Redis now, not the last second's copy
            return json_answer([n.view() for n in sorted(self.fleet.nodes.values(), key=lambda n: n.node_id)])
        if path == "/cluster/events" and method == "GET":
            return json_answer(await self.coord.events(200))
        m = _NODE_OP.match(path)
        if m and method == "POST":
            body = _parse(await self._body(request)) or {}
            migrate = body.get("migrate", False) if isinstance(body, dict) else False
            if not isinstance(migrate, bool):
                raise GatewayError(400, "migrate must be a boolean")
            return json_answer(await self.moves.drain(m.group(1), m.group(2) == "drain", migrate,
                                                      _key_headers(request)))
        m = _CONNECT.match(path)
        if m and method == "POST":
            return await self.moves.connect(request, m.group(1), await self._body(request))
        m = _FORK.match(path)
        if m and method == "POST":
            return await self.moves.fork(request, m.group(1), await self._body(request))
        m = _SNAPSHOT_FORK.match(path)
        if m and method == "POST":
            return await self.moves.fork_snapshot(request, m.group(1), await self._body(request))
        m = _SANDBOX.match(path)
        if m and m.group(1) != "metrics":
            return await self._routed(request, m.group(1), m.group(2) or "")
        return await self._any_node(request)

    async def _body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > MAX_BODY:
            raise GatewayError(413, f"request body over {MAX_BODY} bytes")
        return await request.read()

    # --- routed by binding ---------------------------------------------------------------

    async def _routed(self, request: web.Request, sid: str, rest: str) -> web.StreamResponse:
        b = await self.fleet.binding(sid)
        if b is None:
            return error(404, f"sandbox {sid} not found", sandboxId=sid)
        if b.node_id and await self.fleet.alive_now(b.node_id):
            if request.method == "POST" and rest == "/pause" and b.state == "running":
                return await self._pause(request, b)
            resp = await self._to_node(request, b.node_id, self.fleet.url(b.node_id) + request.rel_url.raw_path_qs)
            if request.method == "DELETE" and rest == "" and resp.status == 404:
                # the node does not hold it: a binding no live node holds is the gateway's to remove
                await self.coord.unbind(sid, b.node_id)
            return resp
        return await self._orphan(request, b, rest)

    async def _pause(self, request: web.Request, b: Binding) -> web.StreamResponse:
        """A pause of a running sandbox on its node, held to its team's pausedSandboxes
        quota across the fleet (docs/cluster.md "Team quotas"): reserved in Redis first, the
        reservation dropped once the node answered (its agent has bound it paused by then)."""
        team = str(b.info.get("teamID") or DEFAULT_TEAM_ID)
        try:
            rid = await self.coord.team_pause(team)
        except TeamQuotaExceeded as e:
            return over_team_quota(e)
        try:
            return await self._to_node(request, b.node_id, self.fleet.url(b.node_id) + request.rel_url.raw_path_qs)
        finally:
            if rid is not None:
                await self.coord.team_paused(team, rid)

    async def _orphan(self, request: web.Request, b: Binding, rest: str) -> web.StreamResponse:
        """A sandbox on a node that is down, or released to the repository: Redis answers."""
        state = shown_state(b, False)
        where = f"its node {b.node_id} is down" if b.node_id else "it is paused in the repository, on no node"
        if request.method == "DELETE" and rest == "":
            if state == "lost":
                await self.coord.unbind(b.sandbox_id)
                self.fleet.forget(b.sandbox_id)
                return web.Response(status=204)
            return await self.moves.kill_orphan(b, _key_headers(request))
        if state == "lost":
            raise SandboxLost(b.sandbox_id, lost_note(b))
        if request.method == "GET" and rest == "":
            detail = listed_from_binding(b, state)
            detail.update({"domain": None, "lifecycle": {"autoResume": False,
                                                         "onTimeout": "pause" if b.info.get("autoPause", True)
                                                         else "kill"}})
            return json_answer(detail)
        if request.method == "POST" and rest == "/pause":
            return error(409, f"sandbox {b.sandbox_id} is already paused ({where})", sandboxId=b.sandbox_id)
        return error(409, f"sandbox {b.sandbox_id} is paused ({where}); connect resumes it on a node",
                     sandboxId=b.sandbox_id)

    async def _to_node(self, request: web.Request, node_id: str, url: str,
                       extra: dict[str, str] | None = None, body: bytes | None = None) -> web.StreamResponse:
        request["streaming"] = True
        headers = forwarded_headers(request, {**(extra or {})})
        if request.headers.get("Upgrade", "").lower() == "websocket" and request.method == "GET":
            try:
                return await self.nodes.websocket(request, url, headers)
            except NodeRefused as e:
                # the node's JSON error body is not readable from a failed handshake: its
                # status and reason are, and are what the client gets
                return error(e.status, f"the sandbox's node refused the WebSocket: {e.message}")
        return await self.nodes.forward(request, url, headers, body)

    async def _any_node(self, request: web.Request) -> web.StreamResponse:
        """Templates, snapshots, volumes and the rest: any live node answers (templates and
        snapshots live in the shared repository)."""
        alive = sorted(self.fleet.alive(), key=lambda n: n.node_id)
        if not alive:
            return error(503, "no node of the fleet is up")
        body = await self._body(request) if request.body_exists else None
        last: Exception | None = None
        for n in alive:
            try:
                return await self._to_node(request, n.node_id, n.url + request.rel_url.raw_path_qs, body=body)
            except NodeUnreachable as e:
                last = e
        return error(502, f"no node answered: {last}")

    # --- sandbox traffic -----------------------------------------------------------------

    async def _signed_file(self, request: web.Request) -> web.StreamResponse:
        """A signed file URL naming no sandbox (the SDK's download_url / upload_url on
        ``E2B_SANDBOX_URL``): only the node holding the sandbox recognises the signature,
        so the nodes are asked which sandbox made it (no body; remembered, limited per
        client: signed_urls.py), then the request is streamed to that node alone."""
        method = "GET" if request.method == "HEAD" else request.method
        got = await self.signed.find(method, request.query, request.remote or "?",
                                     [n.url for n in self.fleet.alive()])
        if got.retry_after:
            return error(429, "too many signed URLs no sandbox is known for, from this client: retry later",
                         headers={"Retry-After": str(got.retry_after)})
        if got.sandbox_id is None:
            return error(401, "invalid signature")
        try:
            resp = await self._proxy(request, got.sandbox_id, {SANDBOX_ID_HEADER: got.sandbox_id})
        except NodeUnreachable:
            self.signed.forget(method, request.query)
            raise
        if resp.status in (401, 404, 502):     # moved, killed or paused since: look again next time
            self.signed.forget(method, request.query)
        return resp

    async def _proxy(self, request: web.Request, sid: str, extra: dict[str, str]) -> web.StreamResponse:
        b = await self.fleet.binding(sid, cached=True)
        if b is None:
            return error(404, "The sandbox was not found", sandboxId=sid)
        if not (b.node_id and self.fleet.is_alive(b.node_id)):
            b = await self.fleet.binding(sid)            # the cache may be behind a move
            if b is None or not (b.node_id and await self.fleet.alive_now(b.node_id)):
                return error(502, f"sandbox {sid} is not on a running node: connect to resume it",
                             sandboxId=sid)
        url = self.fleet.url(b.node_id) + request.rel_url.raw_path_qs
        try:
            return await self._to_node(request, b.node_id, url, extra)
        except NodeUnreachable:
            self.fleet.forget(sid)
            raise


def _parse(body: bytes) -> Any:
    if is_blank(body):
        return None
    try:
        return json.loads(body)
    except ValueError:
        raise GatewayError(400, "request body is not valid JSON") from None


def _key_headers(request: web.Request) -> dict[str, str]:
    key = request.headers.get(API_KEY_HEADER)
    return {API_KEY_HEADER: key} if key else {}
