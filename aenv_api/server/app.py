"""The HTTP server: one port for the control plane and the sandbox proxy.

Built on aiohttp (pinned): its HTTP/1.1 server and client already do
chunked bodies both ways, per-write flushing, keep-alive pools and WebSocket
— the parts a reverse proxy must get exactly right — so aenv's code is only
routing, validation and the E2B semantics.

Every request passes one middleware: request id (``X-Request-Id``, taken
from the client when sane, else made), sandbox-traffic detection (→ proxy),
API-key check, body/query validation (→ 400), and the mapping of every
failure to E2B's ``{"code", "message"}`` JSON — a traceback never reaches a
client. One access-log line per request (text, or JSON lines).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import ssl
import time
import zlib
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from aenv_dashboard.serve import PREFIX as DASHBOARD_PREFIX, serve_dashboard
from aenv_http.bodies import is_blank
from aenv_http.runner import MAX_FIELD, MAX_LINE, JsonErrorRunner, bound_port, parser_reason
from aenv_store.errors import ConfigError
from aenv_wire.cluster import ADOPT_ROUTE
from aenv_wire.errors import error_body
from aenv_wire.fleet_auth import NODE_AUTH_HEADER, FleetKeys
from aenv_wire.headers import ACCESS_TOKEN_HEADER, REQUEST_ID_HEADER, RETRY_AFTER_HEADER, SHOULD_RETRY_HEADER
from aenv_wire.routing import (SandboxAddress, has_proxy_prefix, has_routing_header, is_unrouted_envd_call,
                               is_unrouted_signed_url, parse_host)
from envd import ENVD_PORT

from .api import ControlPlane
from .auth import Credentials
from .errors import ApiError
from .keystore import DEFAULT_TEAM_ID, TEAMS_FILE, KeyStore, KeyStoreError
from .lifecycle import Lifecycle
from .metrics import Metrics
from .owners import SNAPSHOT_TEAMS_FILE, VOLUME_TEAMS_FILE, OwnerMap
from .nodes_api import NodeApi
from .proxy import ProxyLimits, SandboxProxy, route_of, signed_files
from .responses import json_response
from .routes import Call, Route, openapi
from .scrub import KeyScrub
from .settings import ServerConfig
from .secret_store import SECRETS_FILE, SecretStore
from .secrets_api import SecretsApi
from .shared_keys import SharedKeyStore, TeamsDocument
from .principal import PRINCIPAL, Principal
from .quota_api import QuotaApi
from .quotas import QuotaGate
from .team_metrics import TeamMetrics
from .teams_api import TeamsApi
from .template_access import owner_of
from .templates_api import TemplateApi
from .volumes_api import VolumeApi

log = logging.getLogger(__name__)
access_log = logging.getLogger("aenv.server.access")

MAX_BODY = 1 << 20  # control-plane bodies; proxied bodies stream and have no limit here
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def error_response(e: ApiError) -> web.Response:
    headers: dict[str, str] = {}
    if e.retry is not None:
        headers[SHOULD_RETRY_HEADER] = "true" if e.retry else "false"
    if e.retry_after is not None:
        headers[RETRY_AFTER_HEADER] = str(e.retry_after)
    return json_response(e.body(), e.status, headers=headers or None)


def _parse_json(raw: bytes) -> Any:
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON: {str(e)[:200]}") from None


def _decoded(raw: bytes, encoding: str) -> bytes:
    """A control-plane body as JSON text. The HTTP server leaves bodies as they came
    (a proxied gzip upload must reach envd still compressed), so gzip is undone here,
    bounded to ``MAX_BODY``."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding != "gzip":
        raise ApiError(415, f"unsupported Content-Encoding {encoding[:40]!r}: send identity or gzip")
    d = zlib.decompressobj(31)
    try:
        out = d.decompress(raw, MAX_BODY + 1)
    except zlib.error as e:
        raise ApiError(400, f"request body is not valid gzip: {e}") from None
    if len(out) > MAX_BODY:
        raise ApiError(413, f"request body over {MAX_BODY} bytes once decompressed")
    if not d.eof:
        raise ApiError(400, "request body is truncated gzip")
    return out


class ApiServer:
    def __init__(self, lifecycle: Lifecycle, creds: Credentials, config: ServerConfig, metrics: Metrics,
                 version: str, templates: TemplateApi | None = None, volumes: VolumeApi | None = None,
                 nodes: NodeApi | None = None, fleet_keys: FleetKeys | None = None,
                 key_store: KeyStore | None = None, secrets_doc: TeamsDocument | None = None) -> None:
        """``fleet_keys``: the fleet secret's ([cluster] fleet_secret_file); the cluster
        routes take only a request credential made with it (None: they refuse everyone).
        ``key_store``: the teams and keys (default: ``<data-dir>/teams.json``; a fleet
        node's is its Redis', shared_keys.py). ``secrets_doc``: a fleet node's secrets
        document (its Redis', aenv_fleet/teams_doc.py; default: ``<data-dir>/secrets.json``)."""
        self.lifecycle = lifecycle
        self.creds = creds
        self.fleet_keys = fleet_keys
        self.config = config
        self.metrics = metrics
        self.version = version
        self.proxy = SandboxProxy(lifecycle, metrics, ProxyLimits.of(config), KeyScrub(creds.api_key))
        self.control = ControlPlane(lifecycle, metrics, config, templates, volumes, nodes,
                                    OwnerMap(lifecycle.data_dir / SNAPSHOT_TEAMS_FILE))
        self.key_store = keystore = key_store or KeyStore(lifecycle.data_dir / TEAMS_FILE, creds.api_key)
        self.teams = TeamsApi(keystore, creds.admin_token, lifecycle)
        # a fleet node keeps its secrets where every node reads them (its Redis); one
        # without that document refuses them (501) rather than keep them on itself alone
        unshared = isinstance(keystore, SharedKeyStore) and secrets_doc is None
        self.secret_store = None if creds.secrets_key is None or unshared else \
            SecretStore(lifecycle.data_dir / SECRETS_FILE, creds.secrets_key, shared=secrets_doc)
        self._secrets_task: asyncio.Task[None] | None = None
        self.secrets = SecretsApi(self.secret_store, unshared)
        self.teams.secret_store = self.control.secret_store = self.secret_store
        self._keys_task: asyncio.Task[None] | None = None
        # per-team quotas and metrics (quotas.py, team_metrics.py)
        if volumes is not None:
            volumes.owners = OwnerMap(lifecycle.data_dir / VOLUME_TEAMS_FILE)
            volumes.quota_of = keystore.quota
        self.quotas = QuotaApi(keystore)
        self.team_metrics = TeamMetrics(metrics, config.team_metrics_interval)
        lifecycle.quotas = QuotaGate(keystore.quota, self._team_count)
        lifecycle.team_metrics = self.team_metrics
        if templates is not None:
            templates.quotas = lifecycle.quotas
            builds = templates.builds
            self.teams.templates_of = lambda team: [v.template_id for v in builds.list_templates()
                                                    if v.owner == owner_of(team)]
        self._sampler: asyncio.Task[None] | None = None
        self.routes = self.teams.routes() + self.secrets.routes() + self.quotas.routes() + self.team_metrics.routes() + self.control.routes()
        self._runner: JsonErrorRunner | None = None
        self._site: web.TCPSite | None = None
        self._tls_site: web.TCPSite | None = None
        self.tls_port: int | None = None        # where HTTPS is served ([server] tls_cert)
        self._debug_site: web.TCPSite | None = None
        self.envd_debug_port: int | None = None     # sandbox traffic only, on loopback ([server] envd_debug_port)
        self.port: int | None = None

    async def _team_count(self, team: str) -> tuple[int, int]:
        return (await self.lifecycle.team_counts(team)).get(team, (0, 0))

    # --- assembly ------------------------------------------------------------

    def _wrap(self, route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            if route.node_auth:
                self._check_node_credential(request)
            if route.auth:
                principal = request[PRINCIPAL] = await self._authenticate(request, route)
                if route.deployment and principal.team_id != DEFAULT_TEAM_ID:
                    raise ApiError(403, "this route is the node's own: only the deployment key (the default "
                                        "team's) may call it")
                sid = request.match_info.get("sandboxID")
                if sid is not None and route.path != ADOPT_ROUTE:
                    await self._check_owner(principal, sid)
            body: dict[str, Any] = {}
            if route.body is not None:
                raw = _decoded(await request.read(), request.headers.get("Content-Encoding", ""))
                if not is_blank(raw):
                    body = route.body.parse_body(_parse_json(raw))
                elif route.body_required:
                    raise ApiError(400, "a JSON request body is required")
                else:
                    body = route.body.parse_body({})
            query = route.query.parse_query(request.query) if route.query is not None else {}
            request["route"] = route.path
            return await route.handler(request, Call(dict(request.match_info), body, query))
        return handler

    async def _authenticate(self, request: web.Request, route: Route) -> Principal:
        try:
            return self._principal(request, route)
        except ApiError as e:
            # a fleet's key (or team, X-Team-ID) made on another node since this one last
            # read Redis: read it now
            if e.status not in (401, 404) or not isinstance(self.key_store, SharedKeyStore) \
                    or not await self.key_store.refreshed():
                raise
            return self._principal(request, route)

    def _principal(self, request: web.Request, route: Route) -> Principal:
        try:
            return self.teams.authenticate(request, route)
        except KeyStoreError as e:      # a fleet's copy of its keys too old to trust (shared_keys.py)
            raise ApiError(e.status, str(e), retry=True, retry_after=1) from None

    async def _check_owner(self, principal: Principal, sid: str) -> None:
        """Another team's sandbox is answered as if it did not exist: 404 with the lifecycle's
        own message for an unknown id (ids are no oracle). A sandbox this node does not hold
        goes on to the handler, which answers for it as before (the fleet's codes)."""
        owner = await self.lifecycle.owner(sid)
        if owner is not None and owner != principal.team_id:
            raise ApiError(404, f"sandbox {sid!r} not found")

    def _check_node_credential(self, request: web.Request) -> None:
        """The fleet's own routes: a gateway's or peer node's credential for exactly this
        request (aenv_wire/fleet_auth.py), never the API key, which every client holds."""
        if self.fleet_keys is None:
            raise ApiError(403, "this node has no fleet secret ([cluster] fleet_secret_file): its cluster routes "
                                "are closed")
        if not self.fleet_keys.request_ok(request.headers.get(NODE_AUTH_HEADER), request.method, request.raw_path,
                                          time.time()):
            raise ApiError(403, f"the cluster routes are the fleet's own: they take a gateway's or node's "
                                f"{NODE_AUTH_HEADER} credential (made with the fleet secret), not an API key")

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._front], client_max_size=MAX_BODY)
        for r in self.routes:
            app.router.add_route(r.method, r.router_path or r.path, self._wrap(r))
        # the dashboard's static files (no credential: they hold none; the page asks the API with the user's key)
        app.router.add_route("*", DASHBOARD_PREFIX, _dashboard)
        app.router.add_route("*", DASHBOARD_PREFIX + "/{path:.*}", _dashboard)
        self.control.openapi_doc = openapi(self.routes, self.version)
        return app

    @web.middleware
    async def _front(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        return await self._answer(request, handler)

    def _pre_route(self, app_handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
                   ) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        """Sandbox traffic is answered before aiohttp's router and middleware chain: the
        router would first resolve every proxied path to a 404 (an exception object and
        a match-info per request, a measurable share of the proxy's CPU). Control-plane
        requests go on to the app as before."""
        domain = self.config.domain

        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            if self.envd_debug_port is not None and _local_port(request) == self.envd_debug_port:
                return await self._answer(request, _sandbox_traffic_only,  # type: ignore[arg-type]  # a Request
                                          token_routes_any=True)
            if has_routing_header(request.headers) or (domain and parse_host(request.host, domain)) or (
                    is_unrouted_signed_url(request.path, request.query) or has_proxy_prefix(request.path)
                    or is_unrouted_envd_call(request.path, request.headers)):
                # aiohttp's low-level handler is typed for BaseRequest; the app's server hands it a Request
                return await self._answer(request, app_handler)  # type: ignore[arg-type]
            return await app_handler(request)
        return handler

    async def _answer(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                      token_routes_any: bool = False) -> web.StreamResponse:
        """Request id, routing (proxy or control plane), the JSON error shape, metrics, log line."""
        t0 = time.monotonic()
        given = request.headers.get(REQUEST_ID_HEADER, "")
        rid = given if _REQUEST_ID.match(given) else secrets.token_hex(8)
        kind = "api"
        sandbox = None
        try:
            target = route_of(request, self.config.domain)
            if target is None and is_unrouted_signed_url(request.path, request.query):
                signed = signed_files(request)
                assert signed is not None
                target = SandboxAddress(await self.lifecycle.signed_sandbox(signed), ENVD_PORT)
            elif target is None and (is_unrouted_envd_call(request.path, request.headers) or (
                    token_routes_any and request.headers.get(ACCESS_TOKEN_HEADER))):
                token = request.headers[ACCESS_TOKEN_HEADER]
                target = SandboxAddress(await self.lifecycle.token_sandbox(token, wake=token_routes_any), ENVD_PORT)
            if target is not None:
                kind, sandbox = "proxy", target[0]
                resp = await self.proxy.handle(request, *target, rid)
            else:
                resp = await handler(request)
        except ApiError as e:
            resp = error_response(e)
        except HttpProcessingError as e:  # a body the parser found malformed while it was read (bad chunking)
            resp = json_response(error_body(400, f"malformed request body: {parser_reason(e)}"), 400)
            resp.force_close()  # where the next request would start is unknown
        except web.HTTPException as e:  # aiohttp's own: unknown path 404, wrong method 405, body too large 413
            if e.status < 400:
                raise
            resp = json_response(error_body(e.status, e.reason or "error"), e.status)
            if e.status == 405:
                resp.headers["Allow"] = e.headers.get("Allow", "")
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:
            log.exception("request %s %s %s failed", rid, request.method, request.path)
            resp = json_response(error_body(500, f"internal error ({type(e).__name__}); request id {rid}"), 500)
        if not resp.prepared:
            resp.headers[REQUEST_ID_HEADER] = rid
        elapsed = time.monotonic() - t0
        route = request.get("route", "proxy" if kind == "proxy" else "unmatched")
        self.metrics.inc("aenv_http_requests_total", (("kind", kind), ("route", route),
                                                      ("status", str(resp.status))),
                         help="HTTP requests answered, by route and status")
        if kind == "api":
            self.metrics.observe("aenv_http_request_seconds", elapsed, (("route", route),),
                                 help="control-plane request latency")
        self._log(rid, request, resp.status, elapsed, kind, sandbox)
        return resp

    def _log(self, rid: str, request: web.Request, status: int, elapsed: float, kind: str,
             sandbox: str | None) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        if self.config.log_format == "json":
            line = json.dumps({"ts": round(time.time(), 3), "request_id": rid, "kind": kind,
                               "method": request.method, "path": request.path, "status": status,
                               "ms": round(elapsed * 1000, 2), "sandbox": sandbox, "remote": request.remote})
        else:
            where = f" sandbox={sandbox}" if sandbox else ""
            line = f"{rid} {kind} {request.method} {request.path} -> {status} {elapsed * 1000:.1f} ms{where}"
        access_log.info(line)

    def _log_reject(self, rid: str, status: int, message: str) -> None:
        self.metrics.inc("aenv_http_requests_total", (("kind", "rejected"), ("route", "unparsed"),
                                                      ("status", str(status))))
        if not access_log.isEnabledFor(logging.INFO):
            return
        if self.config.log_format == "json":
            line = json.dumps({"ts": round(time.time(), 3), "request_id": rid, "kind": "rejected",
                               "status": status, "message": message})
        else:
            line = f"{rid} rejected -> {status} {message}"
        access_log.info(line)

    # --- run -----------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (``port`` 0 picks a free one)."""
        # Requests the HTTP parser itself refuses are answered in JSON too (aenv_http/runner.py).
        # auto_decompress off: aiohttp would otherwise inflate a gzip request body and the
        # proxy would forward it inflated under its Content-Encoding: gzip header (envd then
        # fails to gunzip plain bytes). Control-plane bodies are inflated by _decoded.
        self._runner = JsonErrorRunner(self.build_app(), on_reject=self._log_reject, access_log=None,
                                       auto_decompress=False,
                                       handle_signals=False, shutdown_timeout=self.config.shutdown_grace,
                                       max_line_size=MAX_LINE, max_field_size=MAX_FIELD)
        await self._runner.setup()
        self._sampler = asyncio.ensure_future(self.team_metrics.run(self.lifecycle.team_counts))
        server = self._runner.server
        assert server is not None
        server.request_handler = self._pre_route(server.request_handler)  # read by each new connection
        self._site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await self._site.start()
        self.port = bound_port(self._site, port)
        if isinstance(self.key_store, SharedKeyStore):
            self._keys_task = asyncio.ensure_future(self.key_store.run())
        if self.secret_store is not None and self.secret_store.shared:
            self._secrets_task = asyncio.ensure_future(self.secret_store.run())
        if self.config.tls_cert:
            # the same application behind TLS: control plane and proxy (host-routed or not)
            self._tls_site = web.TCPSite(self._runner, host, self.config.tls_port, reuse_address=True,
                                         ssl_context=tls_context(self.config.tls_cert, self.config.tls_key))
            await self._tls_site.start()
            self.tls_port = bound_port(self._tls_site, self.config.tls_port)
        if self.config.envd_debug_port:
            self._debug_site = web.TCPSite(self._runner, "127.0.0.1", self.config.envd_debug_port, reuse_address=True)
            await self._debug_site.start()
            self.envd_debug_port = bound_port(self._debug_site, self.config.envd_debug_port)
        return self.port

    async def stop_accepting(self) -> None:
        for site in (self._site, self._tls_site, self._debug_site):
            if site is not None:
                await site.stop()
        self._site = self._tls_site = self._debug_site = None

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        await self.stop_accepting()
        for task in (self._keys_task, self._secrets_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._keys_task = self._secrets_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.proxy.close()


def _local_port(request: web.BaseRequest) -> int | None:
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return sock[1] if isinstance(sock, tuple) and len(sock) >= 2 else None


async def _dashboard(request: web.Request) -> web.StreamResponse:
    request["route"] = DASHBOARD_PREFIX     # one metrics label for every file
    return await serve_dashboard(request)


async def _sandbox_traffic_only(request: web.Request) -> web.StreamResponse:
    """The envd debug listener's answer to a request that names no sandbox."""
    raise ApiError(401, "this port serves sandbox traffic only: send the sandbox's X-Access-Token "
                        "(or its E2b-Sandbox-Id header); the API is on the server's main port")


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The server side of TLS from PEM files; ConfigError when they do not load."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"server.tls_cert / server.tls_key do not load: {e}") from None
    return ctx
