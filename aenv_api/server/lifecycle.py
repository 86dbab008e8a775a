"""The glue between the HTTP API and a ``SandboxService`` (aenv_vm/service.py).

The service owns the sandboxes and their records (state, template, metadata,
env vars, start/end times, access token, TTL); this module turns its
``SandboxInfo`` into what E2B's API shows (views.py) and its errors into API
answers by class (``api_error``). What the API needs beyond the service's
records -- the template alias the client asked for, ``autoResume`` -- is kept
in ``ApiExtras``, a small JSON file in the data dir, so it survives restarts
with the paused sandboxes it belongs to. The service is one node's
(``NodeSandboxService``, wrapped by the fleet agent's ``ObservedService`` on a fleet
node): nothing here touches VM internals. A fleet's gateway is no service under
this module: it routes HTTP to the nodes' APIs (docs/cluster.md).

envd access tokens (access_tokens.py): the guest token is derived from the
sandbox id and handed to the service as that function at create and fork (the
id is known only once the node has picked a pooled or restored VM; envd gets
the token in the same ``/init``); the service's record keeps it. Clients get
the client token, derived from the id and the generation the record keeps;
the proxy checks that one and puts the guest token in its place.

Network (network.py): the egress rules go to the service (its records keep
them); what the proxy applies (``allowPublicTraffic``, ``maskRequestHost``,
``httpsPorts``) is kept in the sandbox's own record (its ``api.extra``
annotation, extras.py) and handed to the proxy as ``ProxyRules``; rules that
cannot be read refuse the sandbox's traffic (fail closed). The traffic access
token is derived from the id (``traffic_token``), never stored.

States: which operation a sandbox allows in which state is the pure table of
aenv_vm/states.py, the one the service consults too. The API asks it before it calls
the service (a refusal is answered with the table's message, word for word: E2B's
where E2B has one), so a node, the gateway and the fake answer alike.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from envd import ENVD_PORT
from envd.signing import SignedRequest
from envd import signing

from aenv_vm.errors import (AdmissionRefused, BadRequest, CapacityError, Conflict, GuestUnresponsive, NodeFenced,
                            NotFound, Unsupported, UnresponsiveSnapshot, VmError)
from aenv_vm.volumes.registry import VolumeNotFound
from aenv_vm.service import CreateRequest, SandboxInfo, SandboxService, SandboxState, SnapshotInfo, TokenMinter
from aenv_vm.states import PAUSED_PHASES, Op, Outcome, Phase, Verdict, phase_of, transition

from aenv_wire.cluster import FULL_RETRY_AFTER, ClusterCode
from aenv_wire.errors import GUEST_UNRESPONSIVE
from aenv_wire.listing import CLIENT_ID, FALLBACK_ENVD_VERSION, parse_metadata_filter, started_at_or_after

from .access_tokens import AccessTokens, SandboxKeys
from .auth import check_token
from .auth import traffic_token as derive_traffic_token
from .errors import ApiError, error_code
from .extras import ANNOTATION, TEAM_ANNOTATION, ApiExtras, Extra, record_extra, team_of
from .keystore import DEFAULT_TEAM_ID
from .metric_series import MAX_SANDBOX_IDS, bucketed, metric_json
from .metrics import Metrics
from .quotas import Grant, QuotaGate
from .team_metrics import TeamMetrics
from .network import PUBLIC, ProxyRules, create_network, egress_choice, network_view, update_policy
from .sandbox_logs import MAX_CONSOLE_BYTES, LogEntry, SandboxLogs
from .schemas import NewSandbox
from .settings import ServerConfig
from .views import SandboxView, page

log = logging.getLogger(__name__)

VISIBLE_STATES = (SandboxState.RUNNING, SandboxState.PAUSED)
# E2B's proxy answer, word for word (its SDKs' tests compare it); the id is in sandboxId
SANDBOX_NOT_FOUND = "The sandbox was not found"


def view_phase(view: SandboxView) -> Phase:
    """Where a sandbox the API shows is in the state table (aenv_vm/states.py)."""
    return phase_of(view.state, view.cold_boot, view.envd_unresponsive)


def info_phase(info: SandboxInfo) -> Phase:
    return phase_of(info.state, info.cold_boot, info.envd_unresponsive)


def guest_unresponsive(sid: str, e: VmError) -> ApiError:
    """E2B's answer to a memory resume of a pause taken while envd did not answer."""
    return ApiError(409, f"Sandbox '{sid}' cannot be resumed with its memory: {e}", error_code=GUEST_UNRESPONSIVE)


def refused(sid: str, e: VmError) -> ApiError:
    """The API answer to a refusal of the state table: the status its class maps to, and
    its message word for word."""
    if isinstance(e, UnresponsiveSnapshot):
        return guest_unresponsive(sid, e)
    err = api_error(e, "")
    err.message = str(e)
    err.args = (str(e),)
    return err


def api_error(e: VmError, what: str) -> ApiError:
    """The API answer to a sandbox-layer error, by its class (aenv_vm/errors.py); the
    ones a fleet's gateway acts on carry their code (errors.error_code)."""
    if isinstance(e, NotFound):
        return ApiError(404, str(e), **error_code(e))
    if isinstance(e, Conflict):
        return ApiError(409, f"{what}: {e}", **error_code(e))
    if isinstance(e, BadRequest):
        return ApiError(400, f"{what}: {e}")
    if isinstance(e, Unsupported):
        return ApiError(501, f"{what}: {e}", retry=False)
    if isinstance(e, AdmissionRefused):   # the restore queue is long: retry as told
        return ApiError(429, str(e), retry=True, retry_after=e.retry_after, **error_code(e))
    if isinstance(e, NodeFenced):         # lost its fleet lease: back once it renews
        return ApiError(503, str(e), retry=True, retry_after=e.retry_after, **error_code(e))
    if isinstance(e, CapacityError):      # the node is full: no retry by the SDK, a harness may
        return ApiError(429, str(e), retry=False, retry_after=FULL_RETRY_AFTER, **error_code(e))
    return ApiError(500, f"{what} failed: {e}")


class Lifecycle:
    """Sandbox operations as the API sees them. Use from the server's event loop."""

    def __init__(self, service: SandboxService, config: ServerConfig, metrics: Metrics, data_dir: Path,
                 tokens: AccessTokens | None = None, traffic_token: TokenMinter | None = None,
                 node_id: str = CLIENT_ID) -> None:
        """``tokens``: the deployment's envd token derivations (access_tokens.py; default: a
        key of this Lifecycle's own, for library use and unit tests). ``traffic_token``
        (default: a key of this Lifecycle's own) mints the traffic access token of a sandbox
        from its id; it must give the same token for the same id across restarts, as
        ``Credentials.traffic_token`` does. ``node_id`` is what E2B's
        ``clientID`` says of every sandbox here: the node that runs it."""
        self.service = service
        self.node_id = node_id
        self.data_dir = data_dir
        self.tokens = tokens or AccessTokens.ephemeral()
        self.traffic_token = traffic_token or functools.partial(derive_traffic_token, secrets.token_bytes(32))
        self.config = config
        self.metrics = metrics
        self.extras = ApiExtras(data_dir / "api-sandboxes.json")
        self.logs = SandboxLogs(data_dir / "sandbox-logs", config.sandbox_log_mib << 20)
        # Hot path of the proxy: a running sandbox's envd tokens (until it pauses, goes or
        # is given a new client token) and the (host, port) reaching each guest port.
        self._ports: dict[tuple[str, int], tuple[str, int]] = {}
        self._tokens: dict[str, SandboxKeys] = {}
        self._rules: dict[str, ProxyRules] = {}
        self._killing: set[str] = set()     # a kill in progress: not there for the proxy
        self._closing = False
        # per-team quotas and metrics (quotas.py, team_metrics.py), set by the server; None: none
        self.quotas: QuotaGate | None = None
        self.team_metrics: TeamMetrics | None = None

    def _starts(self, team: str, n: int, create: bool) -> contextlib.AbstractAsyncContextManager[Grant]:
        """The team's quota's reservation of ``n`` starts (quotas.py ``QuotaGate.starts``)."""
        if self.quotas is None:
            return contextlib.nullcontext(Grant(n))
        return self.quotas.starts(team, n, create=create)

    def _started(self, team: str, n: int = 1) -> None:
        if self.team_metrics is not None:
            self.team_metrics.started(team, n)

    async def team_counts(self, team: str | None = None) -> dict[str, tuple[int, int]]:
        """(running, paused) sandboxes of each team (``team``: of that one only) on this node."""
        out: dict[str, tuple[int, int]] = {}
        # from the records as they are (no view built: this runs at each start of a team with a quota)
        for i in await self.service.list_sandboxes():
            if i.state not in VISIBLE_STATES:
                continue
            owner = team_of(i.annotations)
            if team is not None and owner != team:
                continue
            running, paused = out.get(owner, (0, 0))
            out[owner] = (running + 1, paused) if i.state is SandboxState.RUNNING else (running, paused + 1)
        return out

    async def start(self) -> None:
        ids = {i.sandbox_id for i in await self.service.list_sandboxes()}
        self.extras.keep_only(ids)
        self.logs.keep_only(ids)
        self.service.on_expiry(self._expired)

    def _expired(self, sid: str, action: str) -> None:
        """A TTL expiry paused or killed ``sid`` below the API."""
        self._forget_ports(sid)
        if action == "killed":
            self.extras.drop([sid])
            self.logs.remove(sid)
        else:
            self.logs.event(sid, "sandbox paused: its timeout expired")

    async def shutdown(self) -> None:
        """Pause every running sandbox (``[server] on_shutdown = "pause"``), else kill it;
        paused sandboxes come back as paused on the next start. A node that cannot pause
        kills."""
        self._closing = True
        for view in await self.list_views():
            if transition(view_phase(view), Op.PAUSE).refused:     # only a running sandbox pauses
                continue
            try:
                if self.config.on_shutdown == "pause":
                    try:
                        await self.pause(view.sandbox_id, within_quota=False)   # a node stopping keeps them
                        continue
                    except ApiError as e:
                        if e.status != 501:
                            raise
                await self.kill(view.sandbox_id)
            except Exception as e:  # keep going: every other sandbox must still stop
                log.warning("shutdown of %s failed: %s", view.sandbox_id, e)

    # --- views ---------------------------------------------------------------

    def check_op(self, view: SandboxView, op: Op) -> Outcome:
        """``_check`` for operations implemented beside this class (token_rotation.rotate)."""
        return self._check(view, op)

    def view_of(self, info: SandboxInfo) -> SandboxView:
        return self._view(info)

    @staticmethod
    def _check(view: SandboxView, op: Op) -> Outcome:
        """What ``op`` does to the sandbox ``view`` shows; the table's refusal as an ApiError."""
        phase = view_phase(view)
        outcome = transition(phase, op)
        if outcome.refused:
            raise refused(view.sandbox_id, outcome.refusal(view.sandbox_id, phase))
        return outcome

    def _extra(self, info: SandboxInfo) -> Extra:
        """The sandbox's API fields: its record's copy (durable), else the extras file's."""
        kept = self.extras.get(info.sandbox_id)
        try:
            extra = record_extra(info.annotations, kept.disk_mb)
        except (ValueError, TypeError) as e:
            log.warning("sandbox %s: unreadable %s annotation: %s", info.sandbox_id, ANNOTATION, e)
            extra = None
        return kept if extra is None else extra

    def _view(self, info: SandboxInfo) -> SandboxView:
        extra = self._extra(info)
        return SandboxView(
            sandbox_id=info.sandbox_id, template_id=info.template_id, alias=extra.alias, started_at=info.started_at,
            end_at=info.end_at, cpu_count=info.vcpus, memory_mb=info.memory_mib,
            disk_size_mb=info.disk_mib or extra.disk_mb, state=info.state.value,
            access_token=self.tokens.client_of(info.sandbox_id, info.annotations) if info.access_token else None,
            guest_token=info.access_token,
            auto_pause=info.auto_pause, auto_resume=extra.auto_resume, metadata=dict(info.metadata),
            allow_internet_access=info.allow_internet_access,
            envd_version=info.envd_version or FALLBACK_ENVD_VERSION,
            traffic_token=None if extra.public_traffic else self.traffic_token(info.sandbox_id),
            network=network_view(info.network, extra),
            cold_boot=info.cold_boot, envd_unresponsive=info.envd_unresponsive,
            volume_mounts=tuple(dict(m) for m in info.volume_mounts), team_id=team_of(info.annotations),
            client_id=self.node_id)

    async def _info(self, sid: str) -> SandboxInfo:
        try:
            return await self.service.get(sid)
        except NotFound:
            raise ApiError(404, f"sandbox {sid!r} not found") from None

    async def get(self, sid: str) -> SandboxView:
        info = await self._info(sid)
        if info.state not in VISIBLE_STATES:
            raise ApiError(404, f"sandbox {sid!r} not found (its state is {info.state.value}; delete it to clean up)")
        return self._view(info)

    async def list_views(self, team: str | None = None) -> list[SandboxView]:
        """The sandboxes the API shows; ``team``: only that team's (None: every team's)."""
        return [self._view(i) for i in await self.service.list_sandboxes()
                if i.state in VISIBLE_STATES and (team is None or team_of(i.annotations) == team)]

    async def owner(self, sid: str) -> str | None:
        """The team that owns ``sid`` on this node (in any state), None when the node has no such sandbox."""
        try:
            return team_of((await self.service.get(sid)).annotations)
        except VmError:
            return None

    # --- create / kill -------------------------------------------------------

    def _template_ref(self, ref: str) -> str:
        return self.config.default_template if ref == "base" else ref

    async def create(self, req: NewSandbox, *, v2: bool, team: str = DEFAULT_TEAM_ID) -> SandboxView:
        if self._closing:
            raise ApiError(503, "the node is shutting down", retry=False)
        timeout = self.config.default_timeout if req.timeout is None else req.timeout
        if req.auto_pause_memory is False and not req.auto_pause:    # E2B's two refusals
            raise ApiError(400, "autoPauseMemory=false only applies when autoPause is true.")
        if req.auto_pause_memory is False and req.auto_resume:
            raise ApiError(400, "autoPauseMemory=false (filesystem-only auto-pause) cannot be combined with "
                                "autoResume: a filesystem-only snapshot cannot be auto-resumed by traffic and "
                                "must be resumed explicitly.")
        net = create_network(req.network, req.allow_internet_access, team)
        # v2 creates are always secured (E2B: "all system communication with the sandbox is always secured").
        token = self.tokens.guest if (v2 or req.secure) else None
        alias = None if req.template_id.startswith("tpl-") else req.template_id
        extra = Extra(alias, bool(req.auto_resume), 0, net.public_traffic, net.mask_request_host, net.https_ports)
        t0 = time.monotonic()
        try:
            async with self._starts(team, 1, create=True):
                info = await self.service.create(CreateRequest(
                    template=self._template_ref(req.template_id), env_vars=dict(req.env_vars or {}),
                    access_token=token, timeout=timeout, metadata=dict(req.metadata or {}),
                    auto_pause=bool(req.auto_pause),
                    allow_internet_access=egress_choice(req.allow_internet_access, net.policy), network=net.policy,
                    pause_memory=req.auto_pause_memory is not False, volume_mounts=tuple(req.volume_mounts or ()),
                    annotations={ANNOTATION: extra.annotation(), TEAM_ANNOTATION: team}))
        except VmError as e:
            self.metrics.inc("aenv_sandbox_create_failures_total", help="sandbox creates that failed")
            if isinstance(e, VolumeNotFound):     # volumeMounts names a volume this node does not have
                raise ApiError(404, f"volumeMounts: {e}", retry=False) from None
            if isinstance(e, NotFound):
                raise ApiError(404, f"template {req.template_id!r} not found") from None
            raise api_error(e, f"sandbox create from template {req.template_id!r}") from None
        except OSError as e:
            self.metrics.inc("aenv_sandbox_create_failures_total", help="sandbox creates that failed")
            raise ApiError(500, f"sandbox create failed: {e}") from None
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "create"),),
                             help="latency of sandbox lifecycle operations")
        self._started(team)
        self.extras.put(info.sandbox_id, dataclasses.replace(extra, disk_mb=info.disk_mib))
        self.logs.event(info.sandbox_id, "sandbox created", template=req.template_id, timeout=timeout,
                        pooled=info.from_pool, secure=token is not None,
                        public_traffic=None if net.public_traffic else False)
        return self._view(info)

    async def kill(self, sid: str) -> None:
        await self._info(sid)
        t0 = time.monotonic()
        # From now on the proxy answers that the sandbox is not there (E2B's 502): a client
        # whose stream breaks as the VM stops checks the health at once, before the kill returns
        self._killing.add(sid)
        self._forget_ports(sid)
        try:
            await self.service.kill(sid)
        except VmError as e:
            raise api_error(e, f"kill of {sid}") from None
        finally:
            self._killing.discard(sid)
        self.extras.drop([sid])
        self.logs.remove(sid)
        self._forget_ports(sid)
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "kill"),))

    # --- moves between nodes (docs/api.md "Moving sandboxes") ---------------------

    async def adopt(self, sid: str, force: bool = False) -> SandboxView:
        """Take over ``sid``, paused by another node into the shared repository."""
        try:
            info = await self.service.adopt(sid, force)
        except VmError as e:
            raise api_error(e, f"adopt of {sid}") from None
        raw = info.annotations.get(ANNOTATION)
        try:   # what the proxy applies to its traffic moves with it (a sandbox made without: defaults)
            extra = Extra.from_annotation(raw, info.disk_mib) if raw is not None else Extra(disk_mb=info.disk_mib)
        except (ValueError, TypeError) as e:
            log.warning("sandbox %s: unreadable %s annotation (%s): proxy rules are the defaults", sid,
                        ANNOTATION, e)
            extra = Extra(disk_mb=info.disk_mib)
        self.extras.put(sid, extra)
        # its log starts here: one of an earlier stay on this node may be left when that
        # stay ended below the API (the fleet agent's release of a stale copy, aenv_fleet/agent.py)
        self.logs.remove(sid)
        self.logs.event(sid, "sandbox adopted from another node", note=info.note or None)
        return self._view(info)

    async def release(self, sid: str) -> None:
        """Forget ``sid`` here (paused, kept in the repository) so that another node adopts it."""
        try:
            await self.service.release(sid)
        except NotFound as e:       # this node does not hold it (the fleet's NOT_HELD)
            raise ApiError(404, str(e), error_code=ClusterCode.NOT_HELD.value) from None
        except VmError as e:
            raise api_error(e, f"release of {sid}") from None
        self._forget_ports(sid)
        self.extras.drop([sid])
        self.logs.remove(sid)

    def forget_tokens(self, sid: str) -> None:
        """The proxy reads ``sid``'s tokens afresh (its client token was rotated)."""
        self._tokens.pop(sid, None)

    def proxy_keys(self, sid: str) -> SandboxKeys | None:
        """The tokens ``target`` found for ``sid`` (None before it ran)."""
        return self._tokens.get(sid)

    def _forget_ports(self, sid: str) -> None:
        for key in [k for k in self._ports if k[0] == sid]:
            del self._ports[key]
        self._tokens.pop(sid, None)
        self._rules.pop(sid, None)

    # --- network -------------------------------------------------------------

    async def update_network(self, sid: str, body: dict[str, Any], team: str = "") -> None:
        """Replace the egress rules of a running sandbox (E2B's ``PUT .../network``). A paused
        sandbox is 409, as E2B answers: the update is for a running sandbox, and resuming
        one behind its owner's back would restart its TTL and its costs."""
        policy = update_policy(body, team)
        self._check(await self.get(sid), Op.UPDATE_NETWORK)   # 409 for a paused one
        try:
            await self.service.update_network(sid, policy)
        except VmError as e:
            raise api_error(e, f"network update of {sid}") from None
        self.logs.event(sid, "network updated", allow_out=",".join(policy.allow_out) or None,
                        deny_out=",".join(policy.deny_out) or None,
                        dns_servers=None if policy.dns_servers is None else ",".join(policy.dns_servers))

    async def proxy_rules(self, sid: str) -> ProxyRules:
        """What the proxy applies to traffic into ``sid``, from the sandbox's own record
        (public for a sandbox the service does not have: the target lookup then answers
        for it). Rules that cannot be known are a 503, never public: an unreadable
        annotation, or a record without one while the extras file was unreadable.
        Hot path: from memory once known."""
        rules = self._rules.get(sid)
        if rules is not None:
            return rules
        try:
            info = await self.service.get(sid)
        except NotFound:
            return PUBLIC
        except VmError as e:
            raise ApiError(503, f"The sandbox {sid}'s traffic rules cannot be read ({e}): its traffic is refused",
                           sandboxId=sid, retry=True) from None
        try:
            extra = record_extra(info.annotations, 0)
        except (ValueError, TypeError) as e:
            log.error("sandbox %s: unreadable %s annotation, its traffic is refused: %s", sid, ANNOTATION, e)
            raise ApiError(503, f"The sandbox {sid}'s traffic rules are unreadable: its traffic is refused",
                           sandboxId=sid, retry=False) from None
        if extra is None:       # a record without rules of its own: the extras file's, if it was read
            extra = self.extras.find(sid)
            if extra is None and self.extras.unreadable is not None:
                raise ApiError(503, f"The sandbox {sid}'s traffic rules are unknown ({self.extras.unreadable}): "
                                    f"its traffic is refused", sandboxId=sid, retry=False)
            if extra is None:
                return PUBLIC
        rules = self._rules[sid] = ProxyRules(
            None if extra.public_traffic else self.traffic_token(sid), extra.mask_request_host,
            frozenset(extra.https_ports))
        return rules

    # --- timeouts ------------------------------------------------------------

    async def set_timeout(self, sid: str, seconds: int) -> SandboxView:
        view = await self.get(sid)
        if view_phase(view) in PAUSED_PHASES:
            # E2B's answer (its paused sandboxes have no TTL), which SDKs rely on: the JS
            # SDK before 2.7 connects by setting the timeout and resumes when that fails
            raise ApiError(404, f"sandbox {sid} is paused: a timeout is for a running sandbox (connect resumes "
                                f"it with one)", sandboxId=sid)
        self._check(view, Op.SET_TIMEOUT)
        try:
            info = await self.service.set_timeout(sid, seconds)
        except VmError as e:
            raise api_error(e, f"timeout of {sid}") from None
        self.logs.event(sid, "timeout set", seconds=seconds)
        return self._view(info)

    # --- list ----------------------------------------------------------------

    async def list_page(self, *, states: tuple[str, ...] | None, metadata: str | None, template: str | None = None,
                   started_after: float | None = None, order: str | None = None, limit: int | None = None,
                   next_token: str | None = None, team: str | None = None
                   ) -> tuple[list[SandboxView], str | None]:
        wanted = parse_metadata_filter(metadata) if metadata else {}
        items = [v for v in await self.list_views(team)
                 if (not states or v.state in states)
                 and all(v.metadata.get(k) == val for k, val in wanted.items())
                 and (template is None or template in (v.template_id, v.alias))
                 and (started_after is None or started_at_or_after(v.started_at, started_after))]
        return page(items, lambda v: (v.started_at, v.sandbox_id), order != "asc", limit, next_token)

    # --- pause / resume / connect -------------------------------------------

    async def pause(self, sid: str, memory: bool = True, require_healthy: bool = False,
                    within_quota: bool = True) -> None:
        """E2B's pause; ``memory=False``: filesystem only (the next connect boots from the
        disk); ``require_healthy`` (the SDK's ``strict``) or ``memory=False``: 503 and the
        sandbox keeps running when its envd does not answer. ``within_quota``: held to its
        team's paused quota (the shutdown's pauses are not: they keep the sandboxes)."""
        view = await self.get(sid)
        self._check(view, Op.PAUSE if memory else Op.PAUSE_FILESYSTEM)   # E2B's 409
        await self._capture_console(sid)   # its VM is about to go away
        t0 = time.monotonic()
        try:
            async with (self.quotas.pausing(view.team_id) if self.quotas is not None and within_quota
                        else contextlib.nullcontext()):
                await self.service.pause(sid, memory=memory, require_healthy=require_healthy)
        except GuestUnresponsive as e:
            raise ApiError(503, f"Sandbox '{sid}' was not paused: its guest agent is not responding ({e})",
                           retry=False) from None
        except VmError as e:
            raise api_error(e, f"pause of {sid}") from None
        self.logs.event(sid, "sandbox paused", seconds=f"{time.monotonic() - t0:.3f}",
                        memory=None if memory else False)
        self._forget_ports(sid)
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "pause"),))

    async def resume(self, sid: str, timeout: int | None = None, memory: bool = True) -> SandboxView:
        """Resume a paused sandbox: from its memory, or (``memory=False``, the SDK's
        ``on_resume="reboot"``, and always after a filesystem-only pause) booted from its
        disk. 409 for a running one (E2B's deprecated ``/resume``)."""
        op = Op.RESUME if memory else Op.RESUME_BOOT
        outcome = self._check(await self.get(sid), op)
        view = await self._resume(sid, timeout, memory, outcome)
        if view is None:    # another call resumed it first
            raise refused(sid, transition(Phase.RUNNING, op).refusal(sid, Phase.RUNNING))
        return view

    async def _resume(self, sid: str, timeout: int | None, memory: bool, outcome: Outcome) -> SandboxView | None:
        """The resume the table allowed (``outcome``); None when another call resumed the
        sandbox meanwhile (the service then refused: it is running)."""
        t0 = time.monotonic()
        team = await self.owner(sid) or DEFAULT_TEAM_ID
        try:
            # a resume is a start of its team
            async with (self.quotas.resume(team, sid, functools.partial(self._running_now, sid))
                        if self.quotas is not None else contextlib.nullcontext()):
                info = await self.service.resume(sid, timeout, memory=memory)
        except UnresponsiveSnapshot as e:
            raise guest_unresponsive(sid, e) from None
        except VmError as e:
            if isinstance(e, Conflict) and await self._running_now(sid):
                return None
            self.logs.event(sid, "resume failed", level="error", error=str(e))
            raise api_error(e, f"resume of {sid}") from None
        self.logs.event(sid, "sandbox booted from its disk" if outcome.boot else "sandbox resumed",
                        seconds=f"{time.monotonic() - t0:.3f}")
        self._forget_ports(sid)  # a new VM: its port forwards are made afresh
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "resume"),))
        self._started(team)
        return self._view(info)

    async def _running_now(self, sid: str) -> bool:
        try:
            return info_phase(await self.service.get(sid)) is Phase.RUNNING
        except VmError:
            return False

    async def connect(self, sid: str, timeout: int | None, memory: bool = True) -> tuple[SandboxView, bool]:
        """The sandbox, resumed if it was paused (``True``; ``memory=False``: booted from its
        disk); a running one's TTL is only extended."""
        view = await self.get(sid)
        outcome = self._check(view, Op.CONNECT if memory else Op.CONNECT_BOOT)
        if outcome.verdict is Verdict.ALLOWED:
            resumed = await self._resume(sid, timeout, memory, outcome)
            if resumed is not None:
                return resumed, True
            view = await self.get(sid)      # another call resumed it: connect to the running one
        if timeout is not None and time.time() + timeout > view.end_at:
            view = await self.set_timeout(sid, timeout)
        return view, False

    # --- snapshots and forks -------------------------------------------------

    async def snapshot(self, sid: str, name: str | None, team: str = DEFAULT_TEAM_ID) -> dict[str, Any]:
        """A named snapshot of ``sid`` whose record names ``team`` as its owner."""
        await self.get(sid)
        t0 = time.monotonic()
        try:
            snap = await self.service.snapshot(sid, name, team)
        except VmError as e:
            raise api_error(e, f"snapshot of {sid}") from None
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "snapshot"),))
        self.logs.event(sid, "snapshot taken", snapshot=snap.snapshot_id, names=",".join(snap.names) or None)
        return {"snapshotID": snap.snapshot_id, "names": list(snap.names)}

    async def list_snapshots(self, *, sandbox_id: str | None, name: str | None, limit: int | None,
                             next_token: str | None, keep: Callable[[SnapshotInfo], bool] | None = None
                             ) -> tuple[list[dict[str, Any]], str | None]:
        """``keep``: only the snapshots it accepts (the caller's team's)."""
        items = [s for s in await self.snapshots()
                 if (keep is None or keep(s))
                 and (sandbox_id is None or s.sandbox_id == sandbox_id)
                 and (name is None or name == s.snapshot_id or name in s.names)]
        out, token = page(items, lambda s: (float(s.created), s.snapshot_id), True, limit, next_token)
        return [{"snapshotID": s.snapshot_id, "names": list(s.names)} for s in out], token

    async def snapshots(self) -> list[SnapshotInfo]:
        """Every named snapshot the repository holds, oldest first."""
        try:
            return await self.service.list_snapshots()
        except VmError as e:
            raise api_error(e, "listing snapshots") from None

    async def named_snapshot(self, ref: str) -> SnapshotInfo | None:
        """The named snapshot ``ref`` is the id or a name of, None if none is."""
        return next((s for s in await self.snapshots() if ref == s.snapshot_id or ref in s.names), None)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        try:
            await self.service.delete_snapshot(snapshot_id)
        except NotFound:
            raise ApiError(404, f"snapshot {snapshot_id!r} not found") from None
        except BadRequest as e:
            raise ApiError(400, f"{e}: it is not deleted through this API") from None
        except VmError as e:
            raise api_error(e, f"deleting snapshot {snapshot_id}") from None

    async def fork_snapshot(self, snapshot_id: str, count: int, timeout: int | None,
                            metadata: dict[str, str] | None, team: str = DEFAULT_TEAM_ID) -> list[dict[str, Any]]:
        """``count`` sandboxes from named snapshot ``snapshot_id`` (its id or a name), or from
        the last pause of paused sandbox ``snapshot_id``, side by side, each a create of its
        own (so each passes capacity and the restore gate, and fails alone): E2B's RFC
        ``POST /snapshots/{snapshotID}/fork``. A snapshot outlives the sandbox it was taken
        of, so the batch does not need it; a paused sandbox stays paused and untouched, and
        its pause is named as a hidden snapshot for the batch (the service's
        ``pause_snapshot``) that lives on with the new sandboxes, whatever becomes of it."""
        found = [s for s in await self.snapshots() if snapshot_id == s.snapshot_id or snapshot_id in s.names]
        if found:
            return await self._batch(found[0].snapshot_id, count, timeout, metadata, snapshot_id, team)
        try:
            async with self.service.pause_snapshot(snapshot_id) as snap:
                out = await self._batch(snap.snapshot_id, count, timeout, metadata, snapshot_id, team)
        except NotFound:
            raise ApiError(404, f"snapshot {snapshot_id!r} not found (neither a snapshot's id or name nor a "
                                f"paused sandbox's id)") from None
        except UnresponsiveSnapshot as e:
            raise guest_unresponsive(snapshot_id, e) from None
        except VmError as e:
            raise api_error(e, f"sandboxes from the pause of {snapshot_id}") from None
        made = [r["sandbox"]["sandboxID"] for r in out if "sandbox" in r]
        if self.extras.find(snapshot_id) is not None:   # a paused sandbox of this node: its log says so
            self.logs.event(snapshot_id, "sandboxes started from its pause", children=",".join(made) or None,
                            failed=(len(out) - len(made)) or None)
        return out

    async def _batch(self, template_id: str, count: int, timeout: int | None, metadata: dict[str, str] | None,
                     source: str, team: str = DEFAULT_TEAM_ID) -> list[dict[str, Any]]:
        """``count`` v2 creates from ``template_id`` at once, one result each."""
        req = NewSandbox(template_id=template_id, timeout=timeout, metadata=metadata, secure=True)
        results = await asyncio.gather(*(self.create(req, v2=True, team=team) for _ in range(count)), return_exceptions=True)
        out: list[dict[str, Any]] = []
        for r in results:
            if isinstance(r, SandboxView):
                out.append({"sandbox": r.sandbox(self.config.domain)})
            elif isinstance(r, ApiError):
                out.append({"error": {"code": r.status, "message": r.message}})
            elif isinstance(r, Exception):
                log.error("a sandbox from snapshot %s failed: %r", source, r)
                out.append({"error": {"code": 500, "message": f"sandbox create failed: {r}"}})
            else:
                raise r
        return out

    async def fork(self, sid: str, count: int, timeout: int | None) -> list[dict[str, Any]]:
        view = await self.get(sid)
        self._check(view, Op.FORK)      # 409 for a paused one
        t0 = time.monotonic()
        try:
            # each child is a start of the parent's team: as many as its quota leaves room for
            async with self._starts(view.team_id, count, create=True) as grant:
                results: list[Any] = await self.service.fork(sid, grant.granted, timeout,
                                                             access_token=self.tokens.guest)
        except VmError as e:
            raise api_error(e, f"fork of {sid}") from None
        if grant.refusal is not None:
            results += [grant.refusal] * (count - grant.granted)
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "fork"),))
        parent_extra = self.extras.get(sid)
        out: list[dict[str, Any]] = []
        children = [c for c in results if isinstance(c, SandboxInfo)]
        for child in results:
            if not isinstance(child, SandboxInfo):   # E2B's Error, its code the status the error has alone
                err = api_error(child, "fork child") if isinstance(child, VmError) else \
                    child if isinstance(child, ApiError) else None
                out.append({"error": {"code": err.status if err else 500,
                                      "message": str(child) or type(child).__name__}})
                continue
            # the child's record carries the parent's annotation (the sandbox layer copies it)
            self.extras.put(child.sandbox_id, dataclasses.replace(self._extra(child), disk_mb=parent_extra.disk_mb))
            self.logs.event(child.sandbox_id, "sandbox forked", parent=sid)
            out.append({"sandbox": self._view(child).sandbox(self.config.domain)})
        self._started(view.team_id, len(children))
        self.logs.event(sid, "sandbox forked", count=count, children=",".join(c.sandbox_id for c in children),
                        failed=(len(results) - len(children)) or None)
        return out

    # --- logs ----------------------------------------------------------------

    async def _capture_console(self, sid: str) -> None:
        """Append the console lines the sandbox wrote since the last capture to its log."""
        source, offset = self.logs.console_position(sid)
        try:
            read = await self.service.console(sid, source, offset, MAX_CONSOLE_BYTES)
        except VmError:     # not running (paused, lost): nothing new on a console
            return
        self.logs.add_console(sid, read.source, read.start, read.data, read.skipped)

    async def sandbox_logs(self, sid: str, *, since_ms: int | None, limit: int, forward: bool = True,
                           min_level: str | None = None, search: str | None = None) -> list[LogEntry]:
        view = await self.get(sid)
        if not transition(view_phase(view), Op.CONSOLE).refused:
            await self._capture_console(sid)
        # off the loop: a query streams up to [server] sandbox_log_mib of files
        return await asyncio.to_thread(self.logs.query, sid, since_ms=since_ms, limit=limit, forward=forward,
                                       min_level=min_level, search=search)

    # --- metrics and proxy targets ------------------------------------------

    async def sandbox_metrics(self, sid: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """The sandbox's samples between ``start`` and ``end`` (unix seconds; open: its
        whole life so far) in E2B's buckets (metric_series.py); kept across pauses."""
        if start is not None and end is not None and start > end:
            raise ApiError(400, "Invalid time range for metrics: start time cannot be after end time")
        await self.get(sid)     # 404 for a sandbox the API does not show
        try:
            samples = await self.service.metrics(sid, start, end)
        except VmError as e:
            raise api_error(e, "metrics") from None
        return [metric_json(s) for s in bucketed(samples, start, end)]

    async def sandboxes_metrics(self, ids: list[str], team: str | None = None) -> dict[str, Any]:
        """The newest sample of each listed sandbox that has one (E2B's ``SandboxesWithMetrics``)."""
        if len(ids) > MAX_SANDBOX_IDS:
            raise ApiError(400, f"Too many sandboxes requested, maximum is {MAX_SANDBOX_IDS}")
        visible = {v.sandbox_id for v in await self.list_views(team)}
        latest = await self.service.latest_metrics([i for i in ids if i in visible])
        return {"sandboxes": {sid: metric_json(s) for sid, s in latest.items()}}

    async def signed_sandbox(self, signed: SignedRequest) -> str:
        """The sandbox a signed ``/files`` URL with no sandbox in it is for: the secured
        sandbox whose envd token the signature was made with (the SDK's URL on
        ``E2B_SANDBOX_URL`` names no sandbox; only the signature binds it to one).
        ApiError 401 with envd's "invalid signature" when none matches. One SHA-256 per
        secured sandbox, running or paused."""
        for view in await self.list_views():
            if view.access_token and signed.matches(view.access_token):
                return view.sandbox_id
        raise ApiError(401, signing.INVALID)

    async def token_sandbox(self, token: str, wake: bool = False) -> str:
        """The secured sandbox whose envd token is ``token`` (an envd call that names no
        sandbox: ``aenv_wire.routing.is_unrouted_envd_call``). The running sandboxes the
        proxy knows are looked at first, then every sandbox (running or paused: a paused
        one with autoResume wakes as any proxied call wakes it; ``wake``: any paused one is
        resumed as a connect would, for SDKs whose connect never calls the server, the
        E2B SDK's debug mode). ApiError 401 with the proxy's message when none has it, so
        an unknown token learns nothing."""
        for sid, known in list(self._tokens.items()):
            if known.accepts(token):
                return sid
        for view in await self.list_views():
            if view.access_token and check_token(view.access_token, token):
                if wake and view_phase(view) in PAUSED_PHASES:
                    await self.connect(view.sandbox_id, None)
                return view.sandbox_id
        raise ApiError(401, "missing or invalid X-Access-Token for this sandbox")

    async def target(self, sid: str, port: int, access_token: str | None,
                     signed: SignedRequest | None = None) -> tuple[str, int]:
        """The ``(host, port)`` that reaches ``sid``'s guest ``port`` (the namespace's
        address and the forward in user mode, its veth address in tap mode), resuming a
        paused sandbox created with autoResume. ``access_token``: the X-Access-Token the
        request presented; for envd's port of a secured sandbox a wrong or missing one is
        401 *before* anything is resumed (a stranger cannot wake a sandbox), unless the
        request is a ``/files`` one whose URL signature (``signed``) is valid; a paused
        sandbox without autoResume is 502 to anyone, as E2B's proxy answers. ApiError
        502 in E2B's shapes otherwise.

        Hot path of every proxied request: a running sandbox whose token and endpoint
        are known is answered from memory (forgotten when it pauses or goes)."""
        if sid in self._killing:
            raise ApiError(502, SANDBOX_NOT_FOUND, sandboxId=sid)
        where = self._ports.get((sid, port))
        if where is not None and sid in self._tokens:
            self._check_envd_token(self._tokens[sid].client, port, access_token, signed)
            return where
        if sid not in self._tokens:
            try:
                info = await self.service.get(sid)
            except NotFound:
                raise ApiError(502, SANDBOX_NOT_FOUND, sandboxId=sid) from None
            view = self._view(info)
            phase = view_phase(view)
            if phase in PAUSED_PHASES and not view.auto_resume:    # E2B's proxy answer, whoever asks
                raise ApiError(502, f"The sandbox {sid} was not found: it is paused and autoResume is off "
                                    f"(connect to resume it)", sandboxId=sid)
            outcome = transition(phase, Op.AUTO_RESUME)     # traffic never reboots a sandbox
            if outcome.refused:
                e = outcome.refusal(sid, phase)
                raise ApiError(502, SANDBOX_NOT_FOUND if isinstance(e, NotFound) else str(e), sandboxId=sid)
            if outcome.verdict is Verdict.ALLOWED:
                self._check_envd_token(view.access_token, port, access_token, signed)
                await self._resume(sid, None, True, outcome)   # None: another request resumed it first
            self._tokens[sid] = SandboxKeys(view.access_token, view.guest_token)
        self._check_envd_token(self._tokens[sid].client, port, access_token, signed)
        try:
            where = await self.service.endpoint(sid, port)
        except NotFound:
            self._forget_ports(sid)
            raise ApiError(502, SANDBOX_NOT_FOUND, sandboxId=sid) from None
        except VmError as e:
            raise ApiError(502, f"The sandbox {sid} is running but port {port} is not open: {e}",
                           sandboxId=sid) from None
        self._ports[(sid, port)] = where
        return where

    @staticmethod
    def _check_envd_token(expected: str | None, port: int, given: str | None,
                          signed: SignedRequest | None = None) -> None:
        if not expected or port != ENVD_PORT:
            return
        if signed is not None:  # a /files request: the token or a valid signature, E2B's messages
            reason = signing.check(signed, expected, given)
            if reason is not None:
                raise ApiError(401, reason)
        elif not check_token(expected, given):
            raise ApiError(401, "missing or invalid X-Access-Token for this sandbox")

    async def counts(self, team: str | None = None) -> dict[str, int]:
        out = {s.value: 0 for s in VISIBLE_STATES}
        for v in await self.list_views(team):
            out[v.state] += 1
        return out
