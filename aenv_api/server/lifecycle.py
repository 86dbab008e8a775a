"""The glue between the HTTP API and the node's ``SandboxManager``.

It keeps the sandbox records E2B's API shows (template, metadata, env vars,
start and end times, state, security flags) and turns manager calls and
errors into API answers. Capabilities the sandbox layer grows over time are
called by name on the manager when present:

    pause(sid)                      -> None
    resume(sid)                     -> Sandbox | None
    snapshot(sid, name)             -> (snapshot_id, names)
    fork(sid, count, timeout)       -> list[Sandbox | Exception]
    set_timeout(sid, seconds)       -> None    (the manager then owns expiry)
    list_snapshots()                -> iterable of objects/dicts with
                                       snapshot_id, names[, sandbox_id, created]
    delete_snapshot(snapshot_id)    -> None

and answer ``501 … not supported by this node yet`` while absent.

TTL: until the manager has ``set_timeout``, expiry is kept here: every record
has ``end_at``; a reaper task pauses (``autoPause`` and pause supported) or
kills sandboxes whose time is up, and drops records of sandboxes whose VM
died. The records live in memory (``RecordTable``); persisting them is the
sandbox layer's job once it keeps its own (issue 6).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import time
import urllib.parse
from dataclasses import dataclass
from enum import Enum
from typing import Any

from aenv_vm.qemu.errors import VmError
from aenv_vm.template import TemplateError

from .auth import Credentials
from .errors import ApiError, bad_request, not_found, not_supported
from .metrics import Metrics
from .schemas import NewSandbox, iso
from .settings import ServerConfig

log = logging.getLogger(__name__)

ENVD_PORT = 49983
CLIENT_ID = "aenv"


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


class SandboxState(str, Enum):
    RUNNING = "running"
    PAUSED = "paused"


@dataclass(frozen=True)
class SandboxRecord:
    sandbox_id: str
    template_id: str
    alias: str | None
    started_at: float
    end_at: float
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    state: SandboxState
    secure: bool
    auto_pause: bool
    auto_resume: bool
    metadata: tuple[tuple[str, str], ...] = ()
    env_vars: tuple[tuple[str, str], ...] = ()
    envd_version: str = ""

    def sandbox(self, creds: Credentials, domain: str) -> dict[str, Any]:
        """E2B's ``Sandbox`` (create / connect / fork answers)."""
        out: dict[str, Any] = {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                               "clientID": CLIENT_ID, "envdVersion": self.envd_version}
        if self.alias:
            out["alias"] = self.alias
        if self.secure:
            out["envdAccessToken"] = creds.envd_token(self.sandbox_id)
        out["domain"] = domain or None
        return out

    def listed(self) -> dict[str, Any]:
        """E2B's ``ListedSandbox``."""
        out: dict[str, Any] = {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                               "clientID": CLIENT_ID, "envdVersion": self.envd_version,
                               "startedAt": iso(self.started_at), "endAt": iso(self.end_at),
                               "cpuCount": self.cpu_count, "memoryMB": self.memory_mb,
                               "diskSizeMB": self.disk_size_mb, "metadata": dict(self.metadata),
                               "state": self.state.value}
        if self.alias:
            out["alias"] = self.alias
        return out

    def detail(self, creds: Credentials, domain: str) -> dict[str, Any]:
        """E2B's ``SandboxDetail`` (get_info)."""
        out = self.listed()
        if self.secure:
            out["envdAccessToken"] = creds.envd_token(self.sandbox_id)
        out["domain"] = domain or None
        out["lifecycle"] = {"autoResume": self.auto_resume, "onTimeout": "pause" if self.auto_pause else "kill"}
        return out


class RecordTable:
    """Sandbox records by id (in memory; the seam where persistent records plug in)."""

    def __init__(self) -> None:
        self._records: dict[str, SandboxRecord] = {}

    def get(self, sid: str) -> SandboxRecord | None:
        return self._records.get(sid)

    def put(self, rec: SandboxRecord) -> None:
        self._records[rec.sandbox_id] = rec

    def remove(self, sid: str) -> SandboxRecord | None:
        return self._records.pop(sid, None)

    def all(self) -> list[SandboxRecord]:
        return list(self._records.values())

    def __len__(self) -> int:
        return len(self._records)


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


def _snapshot_view(item: Any) -> dict[str, Any]:
    get = item.get if isinstance(item, dict) else (lambda k, d=None: getattr(item, k, d))
    names = list(get("names", []) or [])
    return {"snapshotID": str(get("snapshot_id") or get("snapshotID")), "names": names,
            "sandboxID": get("sandbox_id"), "created": get("created", 0.0)}


class Lifecycle:
    """Sandbox operations as the API sees them. Use from the server's event loop."""

    def __init__(self, manager: Any, creds: Credentials, config: ServerConfig, metrics: Metrics,
                 store: Any = None) -> None:
        self.manager = manager
        self.creds = creds
        self.config = config
        self.metrics = metrics
        self.store = store
        self.records = RecordTable()
        self._creating = 0
        self._ports: dict[tuple[str, int], int] = {}   # (sid, guest port) -> host port
        self._reaper: asyncio.Task | None = None
        self._closing = False

    # --- capabilities --------------------------------------------------------

    def _cap(self, name: str, feature: str) -> Any:
        fn = getattr(self.manager, name, None)
        if not callable(fn):
            raise not_supported(feature)
        return fn

    @property
    def manager_owns_ttl(self) -> bool:
        return callable(getattr(self.manager, "set_timeout", None))

    def supports(self, name: str) -> bool:
        return callable(getattr(self.manager, name, None))

    # --- start / stop --------------------------------------------------------

    async def start(self) -> None:
        if not self.manager_owns_ttl:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())

    async def shutdown(self) -> None:
        """Stop expiring; pause every running sandbox when the node can, else kill it."""
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(BaseException):
                await self._reaper
        can_pause = self.supports("pause")
        for rec in self.records.all():
            if rec.state is not SandboxState.RUNNING:
                continue
            try:
                if can_pause:
                    await self.pause(rec.sandbox_id)
                else:
                    await self.kill(rec.sandbox_id)
            except Exception as e:  # keep going: every other sandbox must still stop
                log.warning("shutdown of %s failed: %s", rec.sandbox_id, e)

    # --- records -------------------------------------------------------------

    def get(self, sid: str) -> SandboxRecord:
        rec = self.records.get(sid)
        if rec is None:
            raise not_found(f"sandbox {sid!r} not found")
        return rec

    def _update(self, rec: SandboxRecord, **changes: Any) -> SandboxRecord:
        new = dataclasses.replace(rec, **changes)
        self.records.put(new)
        return new

    def _new_record(self, sbx: Any, alias: str | None, timeout: int, *, secure: bool, auto_pause: bool,
                    auto_resume: bool, metadata: dict[str, str], env_vars: dict[str, str]) -> SandboxRecord:
        tpl = sbx.template
        now = time.time()
        return SandboxRecord(
            sandbox_id=sbx.id, template_id=tpl.id, alias=alias, started_at=now, end_at=now + timeout,
            cpu_count=tpl.vcpus, memory_mb=tpl.memory_mib, disk_size_mb=self._disk_mb(sbx),
            state=SandboxState.RUNNING, secure=secure, auto_pause=auto_pause, auto_resume=auto_resume,
            metadata=tuple(sorted(metadata.items())), env_vars=tuple(sorted(env_vars.items())),
            envd_version=envd_version())

    @staticmethod
    def _disk_mb(sbx: Any) -> int:
        size = getattr(getattr(sbx, "image", None), "size", None)
        return int(size) >> 20 if isinstance(size, int) else 0

    def _template_ref(self, ref: str) -> str:
        return self.config.default_template if ref == "base" else ref

    # --- create / kill -------------------------------------------------------

    async def create(self, req: NewSandbox, *, v2: bool) -> SandboxRecord:
        if self._closing:
            raise ApiError(503, "the node is shutting down", retry=False)
        if len(self.records) + self._creating >= self.config.max_sandboxes:
            raise ApiError(429, f"this node holds its maximum of {self.config.max_sandboxes} sandboxes",
                           retry=False)
        timeout = self.config.default_timeout if req.timeout is None else req.timeout
        # v2 creates are always secured (E2B: "all system communication with the sandbox is always secured").
        secure = True if v2 else bool(req.secure)
        ref = self._template_ref(req.template_id)
        self._creating += 1
        t0 = time.monotonic()
        try:
            # The token is derived from the id, which the manager picks: envd gets it by
            # the manager's /init through a token callback when available, else set after.
            sbx = await self.manager.create(ref, env_vars=req.env_vars or None)
            try:
                if secure:
                    await self._set_envd_token(sbx, None, self.creds.envd_token(sbx.id))
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.manager.kill(sbx.id)
                raise
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
        rec = self._new_record(sbx, alias, timeout, secure=secure, auto_pause=bool(req.auto_pause),
                               auto_resume=bool(req.auto_resume), metadata=req.metadata or {},
                               env_vars=req.env_vars or {})
        self.records.put(rec)
        if self.manager_owns_ttl:
            await self.manager.set_timeout(rec.sandbox_id, timeout)
        return rec

    async def _set_envd_token(self, sbx: Any, old: str | None, new: str) -> None:
        """Give envd in ``sbx`` its access token (``old``: the token it has now, e.g. a fork's parent's)."""
        body = json.dumps({"accessToken": new}).encode()
        headers = {"Content-Type": "application/json"}
        if old:
            headers["X-Access-Token"] = old
        status = await asyncio.to_thread(_post, sbx.envd_port, "/init", body, headers)
        if not 200 <= status < 300:
            raise VmError(f"envd /init (access token) answered HTTP {status}")

    async def kill(self, sid: str) -> None:
        rec = self.get(sid)
        t0 = time.monotonic()
        try:
            await self.manager.kill(sid)
        except VmError as e:
            if rec.state is SandboxState.RUNNING and sid in getattr(self.manager, "sandboxes", {sid: None}):
                raise ApiError(500, f"kill of {sid} failed: {e}") from None
            # unknown to the manager (already gone): the record is all that is left
        self.records.remove(sid)
        for key in [k for k in self._ports if k[0] == sid]:
            del self._ports[key]
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "kill"),))

    # --- timeouts ------------------------------------------------------------

    async def set_timeout(self, sid: str, seconds: int) -> SandboxRecord:
        rec = self.get(sid)
        if self.manager_owns_ttl:
            await self.manager.set_timeout(sid, seconds)
        return self._update(rec, end_at=time.time() + seconds)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.reap()
            except Exception:  # the reaper must outlive any one failure
                log.exception("sandbox reaper pass failed")

    async def reap(self) -> None:
        now = time.time()
        live = getattr(self.manager, "sandboxes", None)
        for rec in self.records.all():
            if rec.state is not SandboxState.RUNNING:
                continue
            sbx = live.get(rec.sandbox_id) if isinstance(live, dict) else None
            if live is not None and (sbx is None or not sbx.vm.alive()):
                log.warning("sandbox %s is gone (VM exited); dropping it", rec.sandbox_id)
                with contextlib.suppress(Exception):
                    await self.manager.kill(rec.sandbox_id)
                self.records.remove(rec.sandbox_id)
                continue
            if rec.end_at <= now:
                self.metrics.inc("aenv_sandbox_expired_total", help="sandboxes that reached their timeout")
                try:
                    if rec.auto_pause and self.supports("pause"):
                        await self.pause(rec.sandbox_id)
                    else:
                        await self.kill(rec.sandbox_id)
                except ApiError as e:
                    log.warning("expiry of %s failed: %s", rec.sandbox_id, e.message)

    # --- list ----------------------------------------------------------------

    def list(self, *, states: tuple[str, ...] | None, metadata: str | None, template: str | None = None,
             started_after: float | None = None, order: str | None = None, limit: int | None = None,
             next_token: str | None = None) -> tuple[list[SandboxRecord], str | None]:
        wanted = parse_metadata_filter(metadata) if metadata else {}
        items = [r for r in self.records.all()
                 if (not states or r.state.value in states)
                 and all(dict(r.metadata).get(k) == v for k, v in wanted.items())
                 and (template is None or template in (r.template_id, r.alias))
                 and (started_after is None or r.started_at >= started_after)]
        desc = order != "asc"
        key = lambda r: (r.started_at, r.sandbox_id)  # noqa: E731
        items.sort(key=key, reverse=desc)
        if next_token:
            cursor = decode_token(next_token)
            items = [r for r in items if (key(r) < cursor if desc else key(r) > cursor)]
        limit = limit or 100
        page, rest = items[:limit], items[limit:]
        token = encode_token(*key(page[-1])) if rest and page else None
        return page, token

    # --- pause / resume / connect -------------------------------------------

    async def pause(self, sid: str) -> None:
        rec = self.get(sid)
        if rec.state is SandboxState.PAUSED:
            raise ApiError(409, f"sandbox {sid} is already paused")
        pause = self._cap("pause", "pause")
        t0 = time.monotonic()
        try:
            await pause(sid)
        except VmError as e:
            raise ApiError(500, f"pause of {sid} failed: {e}") from None
        self._update(rec, state=SandboxState.PAUSED)
        for key in [k for k in self._ports if k[0] == sid]:
            del self._ports[key]
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "pause"),))

    async def connect(self, sid: str, timeout: int | None) -> tuple[SandboxRecord, bool]:
        """The sandbox, resumed if it was paused (``True``); its TTL is only ever extended."""
        rec = self.get(sid)
        resumed = False
        if rec.state is SandboxState.PAUSED:
            rec = await self.resume(sid)
            resumed = True
        if timeout is not None:
            end = max(rec.end_at, time.time() + timeout)
            if self.manager_owns_ttl and end != rec.end_at:
                await self.manager.set_timeout(sid, int(end - time.time()))
            rec = self._update(rec, end_at=end)
        return rec, resumed

    async def resume(self, sid: str) -> SandboxRecord:
        rec = self.get(sid)
        if rec.state is SandboxState.RUNNING:
            raise ApiError(409, f"sandbox {sid} is already running")
        resume = self._cap("resume", "resume")
        t0 = time.monotonic()
        try:
            await resume(sid)
        except VmError as e:
            raise ApiError(500, f"resume of {sid} failed: {e}") from None
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "resume"),))
        return self._update(rec, state=SandboxState.RUNNING,
                            end_at=max(rec.end_at, time.time() + self.config.default_timeout))

    # --- snapshots and forks -------------------------------------------------

    async def snapshot(self, sid: str, name: str | None) -> dict[str, Any]:
        self.get(sid)
        snap = self._cap("snapshot", "snapshots")
        t0 = time.monotonic()
        try:
            snapshot_id, names = await snap(sid, name)
        except VmError as e:
            raise ApiError(500, f"snapshot of {sid} failed: {e}") from None
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "snapshot"),))
        return {"snapshotID": snapshot_id, "names": list(names)}

    async def list_snapshots(self, *, sandbox_id: str | None, name: str | None, limit: int | None,
                             next_token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        lister = self._cap("list_snapshots", "listing snapshots")
        items = [_snapshot_view(x) for x in await _maybe_await(lister())]
        items = [s for s in items if (sandbox_id is None or s["sandboxID"] == sandbox_id)
                 and (name is None or name == s["snapshotID"] or name in s["names"])]
        items.sort(key=lambda s: (-float(s["created"] or 0), s["snapshotID"]))
        if next_token:
            created, last = decode_token(next_token)
            items = [s for s in items if (-float(s["created"] or 0), s["snapshotID"]) > (-created, last)]
        limit = limit or 100
        page, rest = items[:limit], items[limit:]
        token = encode_token(float(page[-1]["created"] or 0), page[-1]["snapshotID"]) if rest and page else None
        return [{"snapshotID": s["snapshotID"], "names": s["names"]} for s in page], token

    async def delete_snapshot(self, snapshot_id: str) -> None:
        delete = self._cap("delete_snapshot", "deleting snapshots")
        try:
            await _maybe_await(delete(snapshot_id))
        except (TemplateError, KeyError) as e:
            raise not_found(f"snapshot {snapshot_id!r} not found: {e}") from None
        except VmError as e:
            if "unknown" in str(e) or "not found" in str(e):
                raise not_found(f"snapshot {snapshot_id!r} not found") from None
            raise ApiError(500, f"deleting snapshot {snapshot_id} failed: {e}") from None

    async def fork(self, sid: str, count: int, timeout: int | None) -> list[dict[str, Any]]:
        parent = self.get(sid)
        if parent.state is not SandboxState.RUNNING:
            raise ApiError(409, f"sandbox {sid} is paused; only a running sandbox can be forked")
        fork = self._cap("fork", "fork")
        if len(self.records) + self._creating + count > self.config.max_sandboxes:
            raise ApiError(429, f"{count} forks would exceed this node's {self.config.max_sandboxes} sandboxes",
                           retry=False)
        ttl = self.config.default_timeout if timeout is None else timeout
        t0 = time.monotonic()
        self._creating += count
        try:
            results = await fork(sid, count, ttl)
        except VmError as e:
            raise ApiError(500, f"fork of {sid} failed: {e}") from None
        finally:
            self._creating -= count
        self.metrics.observe("aenv_lifecycle_seconds", time.monotonic() - t0, (("op", "fork"),))
        out: list[dict[str, Any]] = []
        for child in results:
            if isinstance(child, BaseException):
                out.append({"error": {"code": 500, "message": str(child) or type(child).__name__}})
                continue
            try:
                if parent.secure:
                    await self._set_envd_token(child, self.creds.envd_token(sid), self.creds.envd_token(child.id))
            except (VmError, OSError) as e:
                with contextlib.suppress(Exception):
                    await self.manager.kill(child.id)
                out.append({"error": {"code": 500, "message": f"fork {child.id}: {e}"}})
                continue
            rec = self._new_record(child, parent.alias, ttl, secure=parent.secure, auto_pause=parent.auto_pause,
                                   auto_resume=parent.auto_resume, metadata=dict(parent.metadata),
                                   env_vars=dict(parent.env_vars))
            rec = dataclasses.replace(rec, template_id=parent.template_id)
            self.records.put(rec)
            out.append({"sandbox": rec.sandbox(self.creds, self.config.domain)})
        return out

    # --- metrics and proxy targets ------------------------------------------

    def sandbox_metrics(self, sid: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """One sample taken now from the host's view of the VM (QEMU's RSS and CPU time)."""
        rec = self.get(sid)
        now = int(time.time())
        if rec.state is not SandboxState.RUNNING or (start is not None and now < start) \
                or (end is not None and now > end):
            return []
        sbx = getattr(self.manager, "sandboxes", {}).get(sid)
        if sbx is None:
            return []
        rss, cpu_pct = _process_usage(sbx.vm.pid, rec.started_at)
        return [{"timestamp": iso(now), "timestampUnix": now, "cpuCount": rec.cpu_count,
                 "cpuUsedPct": round(cpu_pct, 2), "memUsed": rss, "memTotal": rec.memory_mb << 20,
                 "memCache": 0, "diskUsed": _upper_bytes(sbx), "diskTotal": rec.disk_size_mb << 20}]

    async def target(self, sid: str, port: int) -> tuple[SandboxRecord, int]:
        """The record and host port that reach guest ``port`` of ``sid`` (resuming a paused
        sandbox when it was created with autoResume). ApiError 502 in E2B's shapes otherwise."""
        rec = self.records.get(sid)
        if rec is None:
            raise ApiError(502, f"The sandbox {sid} was not found", sandboxId=sid)
        if rec.state is SandboxState.PAUSED:
            if not rec.auto_resume or not self.supports("resume"):
                raise ApiError(502, f"The sandbox {sid} is paused and autoResume is off: connect to resume it",
                               sandboxId=sid)
            rec = await self.resume(sid)
        sbx = getattr(self.manager, "sandboxes", {}).get(sid)
        if sbx is None:
            raise ApiError(502, f"The sandbox {sid} was not found", sandboxId=sid)
        if port == ENVD_PORT:
            return rec, sbx.envd_port
        host_port = self._ports.get((sid, port))
        if host_port is None:
            host_port = await self._forward(sbx, port)
            self._ports[(sid, port)] = host_port
        return rec, host_port

    async def _forward(self, sbx: Any, port: int) -> int:
        """Open a host port to guest ``port`` on the VM's user-mode network (QEMU's hostfwd_add)."""
        from aenv_vm.qemu.launcher import GUEST_IP, free_port

        qmp = getattr(sbx.vm, "qmp", None)
        if qmp is None:
            raise ApiError(502, f"The sandbox {sbx.id} is running but port {port} is not open", sandboxId=sbx.id)
        host_port = free_port()
        reply = await qmp.execute("human-monitor-command", {
            "command-line": f"hostfwd_add net0 tcp:127.0.0.1:{host_port}-{GUEST_IP}:{port}"})
        if isinstance(reply, str) and reply.strip():
            raise ApiError(502, f"The sandbox {sbx.id} is running but port {port} is not open: {reply.strip()}",
                           sandboxId=sbx.id)
        return host_port

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in SandboxState}
        for r in self.records.all():
            out[r.state.value] += 1
        return out


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _process_usage(pid: int, since: float) -> tuple[int, float]:
    """(RSS bytes, average CPU % since ``since``) of a process, from /proc."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])
        cpu = ticks / os.sysconf("SC_CLK_TCK")
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
