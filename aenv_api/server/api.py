"""The control-plane route table: E2B's sandbox-centric API plus /health,
/openapi.json and /metrics, and the fleet's node routes (aenv_wire/cluster.py)."""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from aenv_vm.service import SnapshotInfo
from aenv_wire.cluster import ADOPT_ROUTE, FORCE_PARAM, RELEASE_ROUTE, SIGNED_OWNER_ROUTE
from aenv_wire.headers import AGENTENV_ID_HEADER, NEXT_TOKEN_HEADER, TOTAL_RUNNING_HEADER
from aenv_wire.listing import iso

from envd import signing

from . import idempotency
from . import schemas as S
from .errors import ApiError
from .lifecycle import Lifecycle
from .metric_series import sandbox_ids
from .metrics import Metrics
from .nodes_api import NodeApi
from .owners import SNAPSHOT_TEAMS_FILE, OwnerMap
from .principal import principal_of
from .responses import json_response, no_content
from .routes import Call, Reply, Route
from .sandbox_logs import LogEntry
from .settings import ServerConfig
from .templates_api import TEMPLATE_ID_PATH, TemplateApi
from .templates_legacy import LegacyTemplateApi
from .token_rotation import rotate
from .secret_refs import check_references, references
from .secret_store import SecretStore
from .quotas import TeamQuota
from .snapshot_quota import SnapshotQuota
from .unsupported import not_supported, reject_unsupported
from .views import SandboxView
from .volumes_api import VolumeApi

# /sandboxes/{sandboxID} is not /sandboxes/metrics (whose only method is GET)
SANDBOX_ID_PATH = r"/sandboxes/{sandboxID:(?!metrics$)[^{}/]+}"




def _log_entry(e: "LogEntry") -> dict[str, Any]:
    return {"timestamp": iso(e.timestamp_ms / 1000), "level": e.level, "message": e.message, "fields": e.fields}


class ControlPlane:
    """Handlers bound to one node's lifecycle; ``routes()`` is the served table."""

    def __init__(self, lifecycle: Lifecycle, metrics: Metrics, config: ServerConfig,
                 templates: TemplateApi | None = None, volumes: VolumeApi | None = None,
                 nodes: NodeApi | None = None, snapshot_owners: OwnerMap | None = None) -> None:
        """``snapshot_owners``: which team owns each named snapshot recorded before records
        named their team (the server reads the node's map at start, so a torn file stops it
        there; None: read from the data dir on first use)."""
        self.lc = lifecycle
        self.nodes = nodes
        self.templates = templates
        self.volumes = volumes
        self.metrics = metrics
        self.config = config
        self.openapi_doc: dict[str, Any] = {}
        self.creates = idempotency.IdempotentCreates()
        self._snapshot_owners = snapshot_owners
        self.secret_store: SecretStore | None = None     # set by the server (secret_refs.py checks against it)
        # each team's snapshotBytes quota; the quotas are the lifecycle's gate's (set by the server)
        self.snapshot_quota = SnapshotQuota(
            lambda team: self.lc.quotas.quota_of(team) if self.lc.quotas is not None else TeamQuota(),
            lambda: self.lc.snapshots(), self.snapshot_team, lambda sid: self.lc.delete_snapshot(sid))

    @property
    def snapshot_owners(self) -> OwnerMap:
        if self._snapshot_owners is None:
            self._snapshot_owners = OwnerMap(self.lc.data_dir / SNAPSHOT_TEAMS_FILE)
        return self._snapshot_owners

    @property
    def domain(self) -> str:
        return self.config.domain

    # --- sandboxes -----------------------------------------------------------

    async def create_v1(self, request: web.Request, call: Call) -> web.Response:
        return await self._create(request, call, v2=False)

    async def create_v2(self, request: web.Request, call: Call) -> web.Response:
        return await self._create(request, call, v2=True)

    def _refuse_new(self) -> None:
        """While an operator drains this node (nodes_api.py), it makes no new sandboxes."""
        if self.nodes is not None:
            self.nodes.refuse_new()

    async def _create(self, request: web.Request, call: Call, v2: bool) -> web.Response:
        req = S.NewSandbox(**call.body)
        reject_unsupported(req)
        key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
        team = principal_of(request).team_id
        check_references(self.secret_store, team, references(req.env_vars, req.network), req.network)
        # another team's private template or named snapshot is no template to this one: the
        # answer to an unknown template. An E2B template is judged by its owner (its build's
        # frozen VM is also listed among the snapshots, with no snapshot owner recorded)
        if self.templates is not None and self.templates.access.is_template(req.template_id):
            try:
                self.templates.access.check_read(req.template_id, team)
            except ApiError:
                raise ApiError(404, f"template {req.template_id!r} not found") from None
        else:
            await self._own_snapshot(request, req.template_id, f"template {req.template_id!r} not found")
        foreign = self.volumes.foreign_mount(req.volume_mounts or [], team) if self.volumes is not None else None
        if foreign is not None:     # what a volume that does not exist gets (lifecycle.create)
            raise ApiError(404, f"volumeMounts: Volume {foreign[:64]!r} not found", retry=False)

        async def create() -> SandboxView:
            if self.templates is not None:
                await self.templates.await_first_build(req.template_id)
            if self.nodes is None:
                return await self.lc.create(req, v2=v2, team=team)
            self.nodes.refuse_new()
            with self.nodes.creating():
                return await self.lc.create(req, v2=v2, team=team)

        if key is None:
            rec = await create()
            return json_response(rec.sandbox(self.domain), 201, headers={AGENTENV_ID_HEADER: rec.sandbox_id})

        async def create_id() -> str:
            return (await create()).sandbox_id

        # scoped by team: one team's Idempotency-Key never replays (nor blocks) another's create
        sid, replayed = await self.creates.run(f"{team}/{key}", idempotency.fingerprint(request.path, call.body),
                                               create_id)
        try:
            rec = await self.lc.get(sid)
        except ApiError as e:
            if e.status != 404 or not replayed:
                raise
            raise ApiError(409, f"the sandbox {sid} created with this {idempotency.HEADER} no longer exists; "
                                f"use a new key to create another", sandboxId=sid, retry=False) from None
        headers = {AGENTENV_ID_HEADER: rec.sandbox_id}   # AgentENV's clients route by it
        if replayed:
            headers[idempotency.REPLAYED_HEADER] = "true"
        return json_response(rec.sandbox(self.domain), 201, headers=headers)

    async def get_info(self, request: web.Request, call: Call) -> web.Response:
        return json_response((await self.lc.get(call.path["sandboxID"])).detail(self.domain))

    async def kill(self, request: web.Request, call: Call) -> web.Response:
        await self.lc.kill(call.path["sandboxID"])
        return no_content()

    async def set_timeout(self, request: web.Request, call: Call) -> web.Response:
        await self.lc.set_timeout(call.path["sandboxID"], call.body["timeout"])
        return no_content()

    async def update_network(self, request: web.Request, call: Call) -> web.Response:
        team = principal_of(request).team_id
        check_references(self.secret_store, team, references(None, call.body), call.body)
        await self.lc.update_network(call.path["sandboxID"], call.body, team)
        return no_content()

    async def rotate_token(self, request: web.Request, call: Call) -> web.Response:
        return json_response((await rotate(self.lc, call.path["sandboxID"])).sandbox(self.domain))

    async def refresh(self, request: web.Request, call: Call) -> web.Response:
        rec = await self.lc.get(call.path["sandboxID"])
        duration = call.body.get("duration")
        if rec.state == "running":  # a paused sandbox has no clock running
            await self.lc.connect(rec.sandbox_id, self.config.default_timeout if duration is None else duration)
        return no_content()

    async def list_v1(self, request: web.Request, call: Call) -> web.Response:
        page, _ = await self.lc.list_page(states=("running",), metadata=call.query["metadata"], limit=10**9,
                                          team=principal_of(request).team_id)
        return json_response([r.listed() for r in page])

    async def list_v2(self, request: web.Request, call: Call) -> web.Response:
        q = call.query
        team = principal_of(request).team_id
        page, token = await self.lc.list_page(states=q["state"], metadata=q["metadata"], template=q["template"],
                                   started_after=q["started_after"], order=q["order"], limit=q["limit"],
                                   next_token=q["next_token"], team=team)
        headers = {NEXT_TOKEN_HEADER: token} if token else {}
        if not q["state"] or "running" in q["state"]:
            headers[TOTAL_RUNNING_HEADER] = str((await self.lc.counts(team))["running"])
        return json_response([r.listed() for r in page], headers=headers)

    async def connect(self, request: web.Request, call: Call) -> web.Response:
        rec, resumed = await self.lc.connect(call.path["sandboxID"], call.body.get("timeout"),
                                             call.body.get("memory") is not False)
        return json_response(rec.sandbox(self.domain), 201 if resumed else 200)

    async def resume(self, request: web.Request, call: Call) -> web.Response:
        rec = await self.lc.resume(call.path["sandboxID"], call.body.get("timeout"),
                                   call.body.get("memory") is not False)
        return json_response(rec.sandbox(self.domain), 201)

    async def pause(self, request: web.Request, call: Call) -> web.Response:
        await self.lc.pause(call.path["sandboxID"], memory=call.body.get("memory") is not False,
                            require_healthy=call.body.get("require_healthy_guest") is True)
        return no_content()

    async def snapshot(self, request: web.Request, call: Call) -> web.Response:
        if call.body.get("memory") is False:
            raise not_supported("memory: false (a filesystem-only snapshot)",
                                "aenv's snapshots always keep memory; pause(mode=\"filesystem\") is supported")
        # its owner is written into its record, which every node sharing the repository reads
        # (not into this node's map: another node of a fleet would not know it)
        team = principal_of(request).team_id
        snap = await self.snapshot_quota.take(
            team, lambda: self.lc.snapshot(call.path["sandboxID"], call.body.get("name"), team))
        return json_response(snap, 201)

    async def list_snapshots(self, request: web.Request, call: Call) -> web.Response:
        q = call.query
        team = principal_of(request).team_id
        page, token = await self.lc.list_snapshots(sandbox_id=q["sandbox_id"], name=q["name"], limit=q["limit"],
                                                   next_token=q["next_token"],
                                                   keep=lambda snap: self.snapshot_team(snap) == team)
        return json_response(page, headers={NEXT_TOKEN_HEADER: token} if token else None)

    async def delete_template(self, request: web.Request, call: Call) -> web.Response:
        tid = call.path["templateID"]
        if self.templates is not None and await self.templates.delete_template(tid, principal_of(request).team_id):
            return no_content()
        snap = await self._own_snapshot(request, tid)
        await self.lc.delete_snapshot(tid)
        if snap is not None and snap.team is None:      # an entry of the fallback map
            await asyncio.to_thread(self.snapshot_owners.drop, snap.snapshot_id)
        return no_content()

    def snapshot_team(self, snap: SnapshotInfo) -> str:
        """The team that owns a named snapshot: the one its record names, for a snapshot
        recorded before records named their team the one this node's map has (the default
        team when it has none), so no existing snapshot changes owner."""
        return snap.team if snap.team is not None else self.snapshot_owners.owner(snap.snapshot_id)

    async def _own_snapshot(self, request: web.Request, ref: str, message: str = "") -> SnapshotInfo | None:
        """The named snapshot ``ref`` is the id or a name of (None: none is); another team's
        is answered as if there were none: 404 with ``message`` (default: the lifecycle's for
        an unknown snapshot). The default team's caller looks too: in a fleet this node's map
        says nothing of the snapshots other nodes made."""
        snap = await self.lc.named_snapshot(ref)
        if snap is not None and self.snapshot_team(snap) != principal_of(request).team_id:
            raise ApiError(404, message or f"snapshot {ref!r} not found")
        return snap

    async def fork(self, request: web.Request, call: Call) -> web.Response:
        self._refuse_new()
        count = call.body.get("count") or 1
        return json_response(await self.lc.fork(call.path["sandboxID"], count, call.body.get("timeout")), 201)

    async def fork_snapshot(self, request: web.Request, call: Call) -> web.Response:
        self._refuse_new()
        b = call.body
        team = principal_of(request).team_id
        source = call.path["snapshotID"]
        # another team's paused sandbox or named snapshot: what one that does not exist gets
        unknown = f"snapshot {source!r} not found (neither a snapshot's id or name nor a paused sandbox's id)"
        owner = await self.lc.owner(source)
        if owner is not None and owner != team:
            raise ApiError(404, unknown)
        await self._own_snapshot(request, source, unknown)
        return json_response(await self.lc.fork_snapshot(source, b.get("count") or 1,
                                                         b.get("timeout"), b.get("metadata"), team), 201)

    async def adopt(self, request: web.Request, call: Call) -> web.Response:
        self._refuse_new()
        return json_response((await self.lc.adopt(call.path["sandboxID"], call.query[FORCE_PARAM] is True)).listed())

    async def release(self, request: web.Request, call: Call) -> web.Response:
        await self.lc.release(call.path["sandboxID"])
        return no_content()

    async def signed_owner(self, request: web.Request, call: Call) -> web.Response:
        try:
            signed = signing.parse(str(call.query["method"]), request.query)
        except signing.BadExpiration as e:
            raise ApiError(400, str(e)) from None
        return json_response({"sandboxID": await self.lc.signed_sandbox(signed)})

    async def sandbox_metrics(self, request: web.Request, call: Call) -> web.Response:
        start, end = call.query["start"], call.query["end"]
        return json_response(await self.lc.sandbox_metrics(call.path["sandboxID"], start, end))

    async def sandboxes_metrics(self, request: web.Request, call: Call) -> web.Response:
        return json_response(await self.lc.sandboxes_metrics(sandbox_ids(call.query["sandbox_ids"]),
                                                             principal_of(request).team_id))

    async def logs_v1(self, request: web.Request, call: Call) -> web.Response:
        q = call.query
        limit = 1000 if q["limit"] is None else q["limit"]
        entries = await self.lc.sandbox_logs(call.path["sandboxID"], since_ms=q["start"], limit=limit)
        return json_response({"logs": [{"timestamp": iso(e.timestamp_ms / 1000), "line": e.message}
                                       for e in entries],
                              "logEntries": [_log_entry(e) for e in entries]})

    async def logs_v2(self, request: web.Request, call: Call) -> web.Response:
        q = call.query
        entries = await self.lc.sandbox_logs(call.path["sandboxID"], since_ms=q["cursor"],
                                       limit=1000 if q["limit"] is None else q["limit"],
                                       forward=q["direction"] != "backward", min_level=q["level"], search=q["search"])
        return json_response({"logs": [_log_entry(e) for e in entries]})

    # --- node ----------------------------------------------------------------

    async def health(self, request: web.Request, call: Call) -> web.Response:
        return no_content()

    async def openapi(self, request: web.Request, call: Call) -> web.Response:
        return json_response(self.openapi_doc)

    async def prometheus(self, request: web.Request, call: Call) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"}, charset="utf-8")

    def routes(self) -> list[Route]:
        cfg = self.config
        mt, mf = cfg.max_timeout, cfg.max_forks
        new = S.new_sandbox_schema(mt)
        created = Reply(201, "the sandbox was created", "Sandbox")
        gone = Reply(404, "no such sandbox", "Error")
        nc = lambda d: Reply(204, d)  # noqa: E731
        sbx = ("sandboxes",)
        # the template API first: its literal paths (/templates/tags) before /templates/{templateID}
        templates = [] if self.templates is None else (
            self.templates.routes() + LegacyTemplateApi(self.templates.builds, self.templates.admit_build).routes())
        nodes = self.nodes.routes() if self.nodes is not None else []
        return templates + nodes + (
            self.volumes.routes() if self.volumes is not None else []) + [
            Route("GET", "/health", self.health, "health check (no auth)", (nc("healthy"),), auth=False),
            Route("GET", "/openapi.json", self.openapi, "this API's OpenAPI document (no auth)",
                  (Reply(200, "the document", None),), auth=False),
            Route("GET", "/metrics", self.prometheus, "Prometheus metrics of the node",
                  (Reply(200, "metrics in Prometheus text format", "text"),), content_type="text/plain",
                  deployment=True),
            Route("POST", "/sandboxes", self.create_v1, "create a sandbox (SDK <= 2.50)", (created,),
                  body=new, body_required=True, tags=sbx),
            Route("POST", "/v2/sandboxes", self.create_v2, "create a sandbox (always secured)", (created,),
                  body=new, body_required=True, tags=sbx),
            Route("GET", "/sandboxes", self.list_v1, "list running sandboxes",
                  (Reply(200, "running sandboxes", "ListedSandbox[]"),), query=S.LIST_V1, tags=sbx),
            Route("GET", "/v2/sandboxes", self.list_v2, "list sandboxes (filters, pagination)",
                  (Reply(200, "sandboxes; next page token in X-Next-Token", "ListedSandbox[]",
                         ("X-Next-Token", "X-Total-Running")),), query=S.LIST_V2, tags=sbx),
            Route("GET", "/sandboxes/metrics", self.sandboxes_metrics, "the newest sample of each listed sandbox",
                  (Reply(200, "by sandbox id", "SandboxesWithMetrics"),), query=S.METRICS_LIST, tags=sbx),
            Route("GET", "/sandboxes/{sandboxID}", self.get_info, "sandbox details",
                  (Reply(200, "the sandbox", "SandboxDetail"), gone), tags=sbx, router_path=SANDBOX_ID_PATH),
            Route("DELETE", "/sandboxes/{sandboxID}", self.kill, "kill a sandbox", (nc("killed"), gone), tags=sbx,
                  router_path=SANDBOX_ID_PATH),
            Route("POST", "/sandboxes/{sandboxID}/timeout", self.set_timeout, "set the time to live from now",
                  (nc("timeout set"), gone), body=S.timeout_schema(mt), body_required=True, tags=sbx),
            Route("PUT", "/sandboxes/{sandboxID}/network", self.update_network,
                  "replace the egress rules of a running sandbox (an omitted field is cleared)",
                  (nc("updated"), gone, Reply(409, "the sandbox is paused", "Error")), body=S.NETWORK_UPDATE,
                  body_required=True, tags=sbx),
            Route("POST", "/sandboxes/{sandboxID}/rotate-token", self.rotate_token,
                  "a new envdAccessToken for a running sandbox: the old one is refused from now on",
                  (Reply(200, "the sandbox with its new envdAccessToken", "Sandbox"), gone,
                   Reply(409, "the sandbox is paused, or not secured", "Error")), tags=sbx),
            Route("POST", "/sandboxes/{sandboxID}/refreshes", self.refresh, "extend the time to live",
                  (nc("refreshed"), gone), body=S.REFRESH, tags=sbx),
            Route("POST", "/sandboxes/{sandboxID}/connect", self.connect, "connect (resumes a paused sandbox)",
                  (Reply(200, "was running", "Sandbox"), Reply(201, "was resumed", "Sandbox"), gone),
                  body=S.connect_schema(mt), body_required=True, tags=sbx),
            Route("POST", "/v2/sandboxes/{sandboxID}/connect", self.connect, "connect (resumes a paused sandbox)",
                  (Reply(200, "was running", "Sandbox"), Reply(201, "was resumed", "Sandbox"), gone),
                  body=S.connect_schema(mt), body_required=True, tags=sbx),
            Route("POST", "/sandboxes/{sandboxID}/resume", self.resume, "resume a paused sandbox (deprecated)",
                  (Reply(201, "resumed", "Sandbox"), gone, Reply(409, "not paused", "Error")),
                  body=S.connect_schema(mt), tags=sbx),
            Route("POST", "/sandboxes/{sandboxID}/pause", self.pause, "pause a sandbox",
                  (nc("paused"), gone, Reply(409, "already paused", "Error")), body=S.PAUSE, tags=sbx),
            Route("POST", "/sandboxes/{sandboxID}/snapshots", self.snapshot, "snapshot a running sandbox",
                  (Reply(201, "the snapshot", "SnapshotInfo"), gone,
                   Reply(507, "the team's snapshots hold its snapshotBytes quota", "Error")), body=S.SNAPSHOT, tags=sbx),
            Route("POST", "/snapshots/{snapshotID}/fork", self.fork_snapshot,
                  "count new sandboxes from a named snapshot, whether or not its sandbox still exists, "
                  "or from a paused sandbox's last pause (it stays paused)",
                  (Reply(201, "one result per sandbox", "SandboxForkResult[]"),
                   Reply(404, "no such snapshot or paused sandbox", "Error"),
                   Reply(409, "the sandbox is running, or its pause kept no memory", "Error")),
                  body=S.snapshot_fork_schema(mt, mf),
                  tags=("snapshots",)),
            Route("GET", "/snapshots", self.list_snapshots, "list snapshots",
                  (Reply(200, "snapshots", "SnapshotInfo[]", ("X-Next-Token",)),), query=S.SNAPSHOT_LIST,
                  tags=("snapshots",)),
            Route("DELETE", "/templates/{templateID}", self.delete_template, "delete a template or a snapshot",
                  (nc("deleted"), Reply(404, "no such template or snapshot", "Error"),
                   Reply(409, "sandboxes use it", "Error")), tags=("snapshots", "templates"),
                  router_path=TEMPLATE_ID_PATH),
            Route("POST", "/sandboxes/{sandboxID}/fork", self.fork, "fork a running sandbox into count children",
                  (Reply(201, "one result per fork", "SandboxForkResult[]"), gone), body=S.fork_schema(mt, mf),
                  tags=sbx),
            Route("GET", "/sandboxes/{sandboxID}/logs", self.logs_v1, "sandbox logs (lifecycle events, console)",
                  (Reply(200, "the logs", "SandboxLogs"), gone), query=S.LOGS_V1, tags=sbx),
            Route("GET", "/v2/sandboxes/{sandboxID}/logs", self.logs_v2, "sandbox logs, filtered",
                  (Reply(200, "the logs", "SandboxLogsV2Response"), gone), query=S.LOGS_V2, tags=sbx),
            Route("GET", "/sandboxes/{sandboxID}/metrics", self.sandbox_metrics, "resource use of a sandbox",
                  (Reply(200, "samples", "SandboxMetric[]"), gone), query=S.METRICS_QUERY, tags=sbx),
            # between the nodes of a fleet sharing one repository (docs/api.md "Moving sandboxes"); a
            # refusal carries its error_code (aenv_wire/cluster.py ClusterCode), which the gateway reads
            Route("POST", ADOPT_ROUTE, self.adopt,
                  "take over a sandbox another node paused into the shared repository",
                  (Reply(200, "adopted: paused on this node", "ListedSandbox"),
                   Reply(404, "no committed pause of it in the repository (sandbox_pause_not_committed)", "Error"),
                   Reply(409, "this node already holds it (sandbox_already_held), it was resumed elsewhere "
                              "(sandbox_resumed_elsewhere; force), or it cannot move (sandbox_not_movable)",
                         "Error"),
                   Reply(429, "this node is full (sandbox_capacity_unavailable)", "Error")),
                  query=S.ADOPT, tags=("cluster",), auth=False, node_auth=True),
            Route("GET", SIGNED_OWNER_ROUTE, self.signed_owner,
                  "which sandbox of this node made a signed /files URL that names none",
                  (Reply(200, "the sandbox", "SignedOwner"),
                   Reply(401, "no sandbox here made this signature", "Error")),
                  query=S.SIGNED_OWNER, tags=("cluster",), auth=False, node_auth=True),
            Route("POST", RELEASE_ROUTE, self.release,
                  "forget a paused sandbox here, keeping it in the repository for another node",
                  (nc("released"), Reply(404, "this node does not hold it (sandbox_not_held)", "Error"),
                   Reply(409, "not paused: running or lost (sandbox_not_paused), or it cannot move "
                              "(sandbox_not_movable)", "Error")), tags=("cluster",), auth=False, node_auth=True),
        ]
