"""The glue between the HTTP API and the node's ``SandboxManager``.

The manager owns the sandboxes and their records (LMDB: state, template,
metadata, env vars, start/end times, access token, TTL — aenv_vm/records.py);
this module turns those records into what E2B's API shows and manager errors
into API answers. What the API needs beyond the manager's record — the
template alias the client asked for, ``autoResume``, the disk size — is kept in
``ApiExtras``, a small JSON file in the data dir, so it survives restarts with
the paused sandboxes it belongs to.

Capabilities are called by name on the manager (``pause``, ``resume``,
``snapshot``, ``fork``, ``set_timeout``, ``list_snapshots``,
``delete_snapshot``) and answer ``501 … not supported by this node yet`` on a
manager without them.

envd access tokens: derived from the sandbox id (``envd_token``, the
deployment's HMAC, auth.py) and handed to the manager as that function at
create and fork (the id is known only once the manager has picked a pooled
or restored VM; envd gets the token in the same ``/init``). The record keeps
it: that is where the proxy checks it.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aenv_vm.qemu.errors import VmError
from aenv_vm.template import TemplateError

from .errors import ApiError, bad_request, not_found, not_supported
from .extras import ApiExtras, Extra
from .metrics import Metrics
from .sandbox_logs import LogEntry, SandboxLogs
from .schemas import NewSandbox, iso
from .settings import ServerConfig

log = logging.getLogger(__name__)

ENVD_PORT = 49983
CLIENT_ID = "aenv"
VISIBLE_STATES = ("running", "paused")   # the sandbox layer's "lost" is not an E2B state


@functools.cache
def envd_version() -> str:
    """The version of the envd this source tree puts into guests (read from its source,
    not imported: envd is the guest's package, not a host dependency)."""
    from aenv_vm.guest import REPO_ROOT

    with contextlib.suppress(OSError):
        m = re.search(r'ENVD_VERSION\s*=\s*"([^"]+)"', (REPO_ROOT / "envd" / "__init__.py").read_text())
        if m:
            return m.group(1)
    return "0.5.7"  # the oldest version whose features the SDK needs (octet-stream uploads)


def random_envd_token(_sandbox_id: str) -> str:
    """Tokens of a Lifecycle given no deployment secret (library use, unit tests)."""
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class SandboxView:
    """A sandbox as E2B's API shows it (built from the manager's record + extras)."""

    sandbox_id: str
    template_id: str
    alias: str | None
    started_at: float
    end_at: float
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    state: str
    access_token: str | None
    auto_pause: bool
    auto_resume: bool
    metadata: dict[str, str]
    allow_internet_access: bool | None = None   # None: not set at create (allowed)

    @property
    def secure(self) -> bool:
        return self.access_token is not None

    def sandbox(self, domain: str) -> dict[str, Any]:
        """E2B's ``Sandbox`` (create / connect / fork answers)."""
        out: dict[str, Any] = {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                               "clientID": CLIENT_ID, "envdVersion": envd_version()}
        if self.alias:
            out["alias"] = self.alias
        if self.access_token:
            out["envdAccessToken"] = self.access_token
        out["domain"] = domain or None
        return out

    def listed(self) -> dict[str, Any]:
        """E2B's ``ListedSandbox``."""
        out: dict[str, Any] = {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                               "clientID": CLIENT_ID, "envdVersion": envd_version(),
                               "startedAt": iso(self.started_at), "endAt": iso(self.end_at),
                               "cpuCount": max(1, self.cpu_count), "memoryMB": self.memory_mb,
                               "diskSizeMB": self.disk_size_mb, "metadata": dict(self.metadata),
                               "state": self.state}
        if self.alias:
            out["alias"] = self.alias
        return out

    def detail(self, domain: str) -> dict[str, Any]:
        """E2B's ``SandboxDetail`` (get_info)."""
        out = self.listed()
        if self.access_token:
            out["envdAccessToken"] = self.access_token
        out["domain"] = domain or None
        out["lifecycle"] = {"autoResume": self.auto_resume, "onTimeout": "pause" if self.auto_pause else "kill"}
        out["allowInternetAccess"] = self.allow_internet_access
        return out


def egress_choice(req: NewSandbox) -> bool | None:
    """``allow_internet_access`` of a create: the field itself, or False when ``network.denyOut``
    denies everything (E2B: the two are the same); None when neither says. Finer allow/deny
    lists are not enforced by this node: with deny-all, ``allowOut`` entries stay closed too
    (closed rather than open when the node cannot do what was asked)."""
    if req.allow_internet_access is not None:
        return req.allow_internet_access
    deny = (req.network or {}).get("denyOut") or []
    return False if isinstance(deny, list) and "0.0.0.0/0" in deny else None


def parse_metadata_filter(raw: str) -> dict[str, str]:
    """The SDK's metadata filter: a form whose keys and values are URL-encoded once more
    (the HTTP layer has already decoded the query string itself once)."""
    pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True)
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def encode_token(started_at: float, sid: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([started_at, sid]).encode()).decode().rstrip("=")


def decode_token(token: str) -> tuple[float, str]:
    try:
        started, sid = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if not isinstance(sid, str) or isinstance(started, bool) or not isinstance(started, (int, float)):
            raise ValueError
        return float(started), sid
    except (ValueError, TypeError, UnicodeDecodeError):
        raise bad_request("nextToken is not a token this server issued") from None


def page(items: list[Any], key: Any, desc: bool, limit: int | None,
         next_token: str | None) -> tuple[list[Any], str | None]:
    """Keyset pagination over ``items`` sorted by ``key`` (a (float, str) pair)."""
    items = sorted(items, key=key, reverse=desc)
    if next_token:
        cursor = decode_token(next_token)
        items = [r for r in items if (key(r) < cursor if desc else key(r) > cursor)]
    limit = limit or 100
    out, rest = items[:limit], items[limit:]
    return out, (encode_token(*key(out[-1])) if rest and out else None)


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


class Lifecycle:
    """Sandbox operations as the API sees them. Use from the server's event loop."""

    def __init__(self, manager: Any, config: ServerConfig, metrics: Metrics, data_dir: Path,
                 envd_token: Callable[[str], str] = random_envd_token) -> None:
        self.manager = manager
        self.envd_token = envd_token
        self.config = config
        self.metrics = metrics
        self.extras = ApiExtras(data_dir / "api-sandboxes.json")
        self.logs = SandboxLogs(data_dir / "sandbox-logs")
        self._creating = 0
        self._ports: dict[tuple[str, int], tuple[str, int]] = {}   # (sid, guest port) -> (host, port) reaching it
        self._tokens: dict[str, str | None] = {}        # sid -> envd access token (immutable per sandbox)
        self._closing = False

    # --- capabilities --------------------------------------------------------

    def _cap(self, name: str, feature: str) -> Any:
        fn = getattr(self.manager, name, None)
        if not callable(fn):
            raise not_supported(feature)
        return fn

    def supports(self, name: str) -> bool:
        return callable(getattr(self.manager, name, None))

    async def start(self) -> None:
        self.extras.keep_only({r.id for r in self._records()})
        self.logs.keep_only({r.id for r in self._records()})
        snap = getattr(self.manager, "lifecycle", None)   # the Snapshotter (TTL); absent in bare managers
        if snap is not None:
            snap.expiry_listeners.append(self._expired)

    def _expired(self, sid: str, action: str) -> None:
        """A TTL expiry paused or killed ``sid`` below the API (aenv_vm/ttl.py)."""
        self._forget_ports(sid)
        if action == "killed":
            self.extras.drop([sid])
            self.logs.remove(sid)
        else:
            self.logs.event(sid, "sandbox paused: its timeout expired")

    async def shutdown(self) -> None:
        """Pause every running sandbox (``[server] on_shutdown = "pause"`` and the node can),
        else kill it; paused sandboxes come back as paused on the next start."""
        self._closing = True
        pause = self.config.on_shutdown == "pause" and self.supports("pause")
        for view in self.list_views():
            if view.state != "running":
                continue
            try:
                if pause:
                    await self.pause(view.sandbox_id)
                else:
                    await self.kill(view.sandbox_id)
            except Exception as e:  # keep going: every other sandbox must still stop
                log.warning("shutdown of %s failed: %s", view.sandbox_id, e)

    # --- views ---------------------------------------------------------------

    def _records(self) -> list[Any]:
        return list(self.manager.records())

    def _view(self, rec: Any) -> SandboxView:
        extra = self.extras.get(rec.id)
        return SandboxView(
            sandbox_id=rec.id, template_id=rec.template, alias=extra.alias, started_at=rec.started_at,
            end_at=rec.end_at, cpu_count=rec.vcpus, memory_mb=rec.memory_mib, disk_size_mb=extra.disk_mb,
            state=rec.state.value, access_token=rec.access_token, auto_pause=rec.auto_pause,
            auto_resume=extra.auto_resume, metadata=dict(rec.metadata),
            allow_internet_access=getattr(rec, "allow_internet_access", None))

    def _record(self, sid: str) -> Any:
        try:
            return self.manager.record(sid)
        except VmError:
            raise not_found(f"sandbox {sid!r} not found") from None

    def get(self, sid: str) -> SandboxView:
        view = self._view(self._record(sid))
        if view.state not in VISIBLE_STATES:
            raise not_found(f"sandbox {sid!r} not found (its state is {view.state}; delete it to clean up)")
        return view

    def list_views(self) -> list[SandboxView]:
        return [v for v in map(self._view, self._records()) if v.state in VISIBLE_STATES]

    # --- create / kill -------------------------------------------------------

    def _template_ref(self, ref: str) -> str:
        return self.config.default_template if ref == "base" else ref

    async def create(self, req: NewSandbox, *, v2: bool) -> SandboxView:
        if self._closing:
            raise ApiError(503, "the node is shutting down", retry=False)
        held = sum(1 for r in self._records() if r.state.value in VISIBLE_STATES)
        if held + self._creating >= self.config.max_sandboxes:
            raise ApiError(429, f"this node holds its maximum of {self.config.max_sandboxes} sandboxes",
                           retry=False)
        timeout = self.config.default_timeout if req.timeout is None else req.timeout
        # v2 creates are always secured (E2B: "all system communication with the sandbox is always secured").
        token = self.envd_token if (v2 or req.secure) else None
        self._creating += 1
        t0 = time.monotonic()
        try:
            sbx = await self.manager.create(self._template_ref(req.template_id), env_vars=req.env_vars or None,
                                            access_token=token, timeout=timeout, metadata=req.metadata or {},
                                            auto_pause=bool(req.auto_pause),
                                            allow_internet_access=egress_choice(req))
        except TemplateError as e:
            self.metrics.inc("aenv_sandbox_create_failures_total", help="sandbox creates that failed")
            if "unknown template" in str(e):
                raise not_found(f"template {req.template_id!r} not found") from None
            raise ApiError(500, f"template {req.template_id!r} cannot be used: {e}") from None
        except (VmError, OSError) as e:
            self.metrics.inc("aenv_sandbox_create_failures_total", help="sandbox creates that failed")
            raise ApiError(500, f"sandbox create failed: {e}") from None
        finally:
            self._creating -= 1
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "create"),),
                             help="latency of sandbox lifecycle operations")
        alias = None if req.template_id.startswith("tpl-") else req.template_id
        size = getattr(getattr(sbx, "image", None), "size", 0)
        self.extras.put(sbx.id, Extra(alias, bool(req.auto_resume), int(size or 0) >> 20))
        timing = getattr(sbx, "timing", None)
        self.logs.event(sbx.id, "sandbox created", template=req.template_id, timeout=timeout,
                        pooled=getattr(timing, "from_pool", None), secure=token is not None)
        return self.get(sbx.id)

    async def kill(self, sid: str) -> None:
        self._record(sid)
        t0 = time.monotonic()
        try:
            await self.manager.kill(sid)
        except VmError as e:
            if "unknown sandbox" in str(e):
                raise not_found(f"sandbox {sid!r} not found") from None
            raise ApiError(500, f"kill of {sid} failed: {e}") from None
        self.extras.drop([sid])
        self.logs.remove(sid)
        self._forget_ports(sid)
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "kill"),))

    def _forget_ports(self, sid: str) -> None:
        for key in [k for k in self._ports if k[0] == sid]:
            del self._ports[key]
        self._tokens.pop(sid, None)

    # --- timeouts ------------------------------------------------------------

    async def set_timeout(self, sid: str, seconds: int) -> SandboxView:
        self.get(sid)
        await _maybe_await(self._cap("set_timeout", "timeouts")(sid, seconds))
        self.logs.event(sid, "timeout set", seconds=seconds)
        return self.get(sid)

    # --- list ----------------------------------------------------------------

    def list(self, *, states: tuple[str, ...] | None, metadata: str | None, template: str | None = None,
             started_after: float | None = None, order: str | None = None, limit: int | None = None,
             next_token: str | None = None) -> tuple[list[SandboxView], str | None]:
        wanted = parse_metadata_filter(metadata) if metadata else {}
        items = [v for v in self.list_views()
                 if (not states or v.state in states)
                 and all(v.metadata.get(k) == val for k, val in wanted.items())
                 and (template is None or template in (v.template_id, v.alias))
                 and (started_after is None or v.started_at >= started_after)]
        return page(items, lambda v: (v.started_at, v.sandbox_id), order != "asc", limit, next_token)

    # --- pause / resume / connect -------------------------------------------

    def _vm_error(self, op: str, sid: str, e: VmError) -> ApiError:
        text = str(e)
        if "unknown sandbox" in text:
            return not_found(f"sandbox {sid!r} not found")
        if "not running" in text or "cannot be resumed" in text:
            return ApiError(409, f"{op} of {sid}: {text}")
        return ApiError(500, f"{op} of {sid} failed: {text}")

    async def pause(self, sid: str) -> None:
        if self.get(sid).state == "paused":
            raise ApiError(409, f"sandbox {sid} is already paused")
        pause = self._cap("pause", "pause")
        self._capture_console(sid)   # its QEMU is about to go away
        t0 = time.monotonic()
        try:
            await pause(sid)
        except VmError as e:
            raise self._vm_error("pause", sid, e) from None
        self.logs.event(sid, "sandbox paused", seconds=f"{time.monotonic() - t0:.3f}")
        self._forget_ports(sid)
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "pause"),))

    async def resume(self, sid: str, timeout: int | None = None) -> SandboxView:
        if self.get(sid).state == "running":
            raise ApiError(409, f"sandbox {sid} is already running")
        resume = self._cap("resume", "resume")
        t0 = time.monotonic()
        try:
            await resume(sid, timeout)
        except VmError as e:
            self.logs.event(sid, "resume failed", level="error", error=str(e))
            raise self._vm_error("resume", sid, e) from None
        self.logs.event(sid, "sandbox resumed", seconds=f"{time.monotonic() - t0:.3f}")
        self._forget_ports(sid)  # a new QEMU: its port forwards are made afresh
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "resume"),))
        return self.get(sid)

    async def connect(self, sid: str, timeout: int | None) -> tuple[SandboxView, bool]:
        """The sandbox, resumed if it was paused (``True``); a running one's TTL is only extended."""
        view = self.get(sid)
        if view.state == "paused":
            return await self.resume(sid, timeout), True
        if timeout is not None and time.time() + timeout > view.end_at:
            view = await self.set_timeout(sid, timeout)
        return view, False

    # --- snapshots and forks -------------------------------------------------

    async def snapshot(self, sid: str, name: str | None) -> dict[str, Any]:
        self.get(sid)
        snap = self._cap("snapshot", "snapshots")
        t0 = time.monotonic()
        try:
            snapshot_id, names = await snap(sid, name)
        except VmError as e:
            if "already exists" in str(e):
                raise ApiError(409, str(e)) from None
            raise self._vm_error("snapshot", sid, e) from None
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "snapshot"),))
        self.logs.event(sid, "snapshot taken", snapshot=snapshot_id, names=",".join(names) or None)
        return {"snapshotID": snapshot_id, "names": list(names)}

    async def list_snapshots(self, *, sandbox_id: str | None, name: str | None, limit: int | None,
                             next_token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        lister = self._cap("list_snapshots", "listing snapshots")
        items = [s for s in await _maybe_await(lister())
                 if (sandbox_id is None or s.sandbox_id == sandbox_id)
                 and (name is None or name == s.snapshot_id or name in s.names)]
        out, token = page(items, lambda s: (float(s.created), s.snapshot_id), True, limit, next_token)
        return [{"snapshotID": s.snapshot_id, "names": list(s.names)} for s in out], token

    async def delete_snapshot(self, snapshot_id: str) -> None:
        delete = self._cap("delete_snapshot", "deleting snapshots")
        try:
            await _maybe_await(delete(snapshot_id))
        except TemplateError as e:
            if "unknown template" in str(e):
                raise not_found(f"snapshot {snapshot_id!r} not found") from None
            raise ApiError(400, str(e)) from None
        except VmError as e:
            if "not a snapshot" in str(e):
                raise ApiError(400, f"{snapshot_id} is a template, not a snapshot: it is not deleted "
                                    f"through this API") from None
            raise ApiError(500, f"deleting snapshot {snapshot_id} failed: {e}") from None

    async def fork(self, sid: str, count: int, timeout: int | None) -> list[dict[str, Any]]:
        parent = self.get(sid)
        if parent.state != "running":
            raise ApiError(409, f"sandbox {sid} is paused; only a running sandbox can be forked")
        fork = self._cap("fork", "fork")
        held = sum(1 for r in self._records() if r.state.value in VISIBLE_STATES)
        if held + self._creating + count > self.config.max_sandboxes:
            raise ApiError(429, f"{count} forks would exceed this node's {self.config.max_sandboxes} sandboxes",
                           retry=False)
        t0 = time.monotonic()
        self._creating += count
        try:
            results = await fork(sid, count, timeout, access_token=self.envd_token)
        except VmError as e:
            raise self._vm_error("fork", sid, e) from None
        finally:
            self._creating -= count
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "fork"),))
        parent_extra = self.extras.get(sid)
        out: list[dict[str, Any]] = []
        for child in results:
            if isinstance(child, BaseException):
                out.append({"error": {"code": 500, "message": str(child) or type(child).__name__}})
                continue
            self.extras.put(child.id, parent_extra)
            self.logs.event(child.id, "sandbox forked", parent=sid)
            out.append({"sandbox": self.get(child.id).sandbox(self.config.domain)})
        self.logs.event(sid, "sandbox forked", count=count,
                        children=",".join(c.id for c in results if not isinstance(c, BaseException)),
                        failed=sum(1 for c in results if isinstance(c, BaseException)) or None)
        return out

    # --- logs ----------------------------------------------------------------

    def _capture_console(self, sid: str) -> None:
        sbx = self.manager.sandboxes.get(sid)
        if sbx is not None:
            self.logs.capture_console(sid, sbx.vm.spec.serial_log)

    def sandbox_logs(self, sid: str, *, since_ms: int | None, limit: int, forward: bool = True,
                     min_level: str | None = None, search: str | None = None) -> list[LogEntry]:
        self.get(sid)
        self._capture_console(sid)
        return self.logs.query(sid, since_ms=since_ms, limit=limit, forward=forward, min_level=min_level,
                               search=search)

    # --- metrics and proxy targets ------------------------------------------

    def sandbox_metrics(self, sid: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """One sample taken now from the host's view of the VM (QEMU's RSS and CPU time)."""
        view = self.get(sid)
        now = int(time.time())
        if view.state != "running" or (start is not None and now < start) or (end is not None and now > end):
            return []
        sbx = self.manager.sandboxes.get(sid)
        if sbx is None:
            return []
        rss, cpu_pct = _process_usage(sbx.vm.pid, view.started_at)
        return [{"timestamp": iso(now), "timestampUnix": now, "cpuCount": max(1, view.cpu_count),
                 "cpuUsedPct": round(cpu_pct, 2), "memUsed": rss, "memTotal": view.memory_mb << 20,
                 "memCache": 0, "diskUsed": _upper_bytes(sbx), "diskTotal": view.disk_size_mb << 20}]

    async def target(self, sid: str, port: int) -> tuple[str | None, tuple[str, int]]:
        """The envd access token of ``sid`` (None: not secured) and the ``(host, port)``
        that reaches its guest ``port`` (``Sandbox.endpoint``: 127.0.0.1 and a forwarded
        port in user mode, the namespace address in tap mode), resuming a paused sandbox
        created with autoResume.
        ApiError 502 in E2B's shapes otherwise.

        Hot path of every proxied request: a running sandbox whose token is known is
        answered from memory (a sandbox's token never changes), without a record read."""
        sbx = self.manager.sandboxes.get(sid)
        if sbx is None or sid not in self._tokens:
            try:
                view = self._view(self.manager.record(sid))
            except VmError:
                raise ApiError(502, f"The sandbox {sid} was not found", sandboxId=sid) from None
            if view.state == "paused":
                if not view.auto_resume or not self.supports("resume"):
                    raise ApiError(502, f"The sandbox {sid} was not found: it is paused and autoResume is off "
                                        f"(connect to resume it)", sandboxId=sid)
                view = await self.resume(sid)
            sbx = self.manager.sandboxes.get(sid)
            if sbx is None or view.state != "running":
                raise ApiError(502, f"The sandbox {sid} was not found", sandboxId=sid)
            self._tokens[sid] = view.access_token
        token = self._tokens[sid]
        if port == ENVD_PORT:
            return token, (sbx.envd_host, sbx.envd_port)
        where = self._ports.get((sid, port))
        if where is None:
            try:
                where = await sbx.endpoint(port)
            except VmError as e:
                raise ApiError(502, f"The sandbox {sid} is running but port {port} is not open: {e}",
                               sandboxId=sid) from None
            self._ports[(sid, port)] = where
        return token, where

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in VISIBLE_STATES}
        for v in self.list_views():
            out[v.state] += 1
        return out


def _process_usage(pid: int, since: float) -> tuple[int, float]:
    """(RSS bytes, average CPU % since ``since``) of a process, from /proc."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return rss, 100.0 * cpu / max(time.time() - since, 1e-3)
    except (OSError, IndexError, ValueError):
        return 0, 0.0


def _upper_bytes(sbx: Any) -> int:
    """Bytes the sandbox's writable disk layer holds on the host."""
    total = 0
    upper = getattr(sbx, "dir", None)
    if upper is None:
        return 0
    for root, _dirs, files in os.walk(upper / "upper"):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total
