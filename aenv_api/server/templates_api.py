"""E2B's template build API over ``aenv_vm.builds.template_builds.TemplateBuilds``, exactly as
the SDK (2.63) calls it: request a build (``POST /v3/templates``, 202), the COPY
contexts (``GET /templates/{id}/files/{hash}`` → present, or an upload URL this server
serves), start it (``POST /v2/templates/{id}/builds/{buildID}``, 202), its status and
log (``…/status?logsOffset=``, ``…/logs``), templates (list, paged list, get, delete,
update: ``public``), aliases and tags. The deprecated request flows of older SDKs and
CLIs (``POST /templates`` with a Dockerfile, ``POST /v2/templates``) are
templates_legacy.py's.

The upload URL carries its own authorisation (the SDK PUTs there without the API
key, as to an S3 presigned URL): an HMAC, under a key of this process, of the
template, the build it was issued for (the template's requested build, not started
yet), the files hash and an expiry. It takes one upload: it is spent once an upload
through it succeeded, and refused once its build has started or is gone, so a URL
that leaked (a log, a proxy) cannot replace or add a context later. What it stores
is filed under the hash it was issued for, and a build starts only with the contexts
of its COPY hashes. It is served on the API's own port, which guests cannot reach
(docs/security.md: network isolation), and the body streams to a file in the data
dir (bounded by ``max_upload_bytes``) before the store takes it. At most
``max_parallel_uploads`` stream at once (429 + Retry-After beyond, which the SDK
waits out), and none is accepted -- or goes on -- while the upload dir's filesystem
is below the node's free-disk floor (507).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from aiohttp import web

from aenv_store.diskfloor import DiskFloor
from aenv_vm.builds.log import LogEntry
from aenv_vm.builds.template_builds import TemplateBuilds, TemplateView
from aenv_vm.errors import BadRequest, Conflict, NotFound, VmError
from aenv_wire.builds import BuildResources, parse_build_spec
from aenv_wire.errors import MalformedBuild
from aenv_wire.headers import NEXT_TOKEN_HEADER
from aenv_wire.listing import iso

from .responses import json_response, no_content
from .errors import ApiError
from .keystore import DEFAULT_TEAM_ID
from .principal import principal_of
from .template_access import CODE_INTERPRETER, NODE_PUBLIC, TemplateAccess, owner_of
from .lifecycle import api_error
from .principal import principal_of
from .quotas import QuotaGate
from .routes import Admin, Call, Reply, Route
from .schemas import Field, Schema
from .views import page

UPLOAD_PATH = "/_aenv/template-files/{hash}"
# /templates/{templateID} for the router: never the literal /templates/tags (its own
# route; "tags" and "aliases" are not template names), so a wrong method there is a 405
# naming only that route's methods
TEMPLATE_ID_PATH = r"/templates/{templateID:(?!tags$)[^{}/]+}"
UPLOAD_TTL = 3600.0
UPLOAD_CHUNK = 1 << 20
UPLOAD_RETRY_AFTER = 5            # seconds a refused upload is told to wait
# A create from a template whose first build is running waits this long for it, then
# answers 503 with Retry-After; never 404 for a template on its way.
FIRST_BUILD_PATIENCE = 45.0     # under the SDKs' 60 s request timeout
FIRST_BUILD_RETRY_AFTER = 10
_HASH = re.compile(r"[A-Za-z0-9_-]{8,128}\Z")

_STRINGS = Field("tags", "array", items=Field("tag", "string", max_length=64), max_items=64)
BUILD_REQUEST = Schema("TemplateBuildRequestV3", (
    Field("name", "string", max_length=128), Field("alias", "string", max_length=128), _STRINGS,
    Field("cpuCount", "integer", minimum=1, maximum=64), Field("memoryMB", "integer", minimum=128, maximum=1 << 20),
    Field("minFreeDiskMb", "integer", minimum=0, maximum=1 << 20)))
BUILD_START = Schema("TemplateBuildStartV2", (
    Field("fromImage", "string", max_length=1024), Field("fromTemplate", "string", max_length=256),
    Field("fromImageRegistry", "object"), Field("steps", "array", items=Field("step", "object"), max_items=1000),
    Field("startCmd", "string", max_length=65536), Field("readyCmd", "string", max_length=65536),
    Field("force", "boolean")))
ASSIGN_TAGS = Schema("AssignTemplateTagsRequest", (Field("target", "string", required=True, max_length=200),
                                                  Field("tags", "array", required=True, max_items=64,
                                                        items=Field("tag", "string", max_length=64))))
DELETE_TAGS = Schema("DeleteTemplateTagsRequest", (Field("name", "string", required=True, max_length=200),
                                                  Field("tags", "array", required=True, max_items=64,
                                                        items=Field("tag", "string", max_length=64))))
STATUS_QUERY = Schema("BuildStatusQuery", (Field("logsOffset", "integer", minimum=0, maximum=2**62),
                                           Field("limit", "integer", minimum=0, maximum=100),
                                           Field("level", "string", enum=("debug", "info", "warn", "error"))))
LOGS_QUERY = Schema("BuildLogsQuery", (Field("cursor", "integer", minimum=0, maximum=2**62),
                                       Field("limit", "integer", minimum=0, maximum=100),
                                       Field("direction", "string", enum=("forward", "backward")),
                                       Field("level", "string", enum=("debug", "info", "warn", "error")),
                                       Field("source", "string", max_length=32)))
LIST_V2_QUERY = Schema("TemplateListV2Query", (
    # one tenant: every template is the caller's team's (the teams issue makes it filter)
    Field("teamID", "string", attr="team_id", max_length=128),
    Field("limit", "integer", minimum=1, maximum=100), Field("nextToken", "string", attr="next_token", max_length=512)))
UPDATE_REQUEST = Schema("TemplateUpdateRequest", (Field("public", "boolean"),))
UPLOAD_QUERY = Schema("UploadQuery", (Field("template", "string", required=True, max_length=256),
                                      Field("build", "string", required=True, max_length=64),
                                      Field("expires", "integer", required=True, minimum=0, maximum=2**62),
                                      Field("nonce", "string", required=True, max_length=64),
                                      Field("signature", "string", required=True, max_length=128)))


_error = api_error     # the sandbox layer's error classes, answered as for sandboxes


def _entry(e: LogEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"timestamp": iso(e.timestamp), "level": e.level, "message": e.message}
    if e.step is not None:
        out["step"] = e.step
    return out


def _line(e: LogEntry) -> str:
    return f"[{iso(e.timestamp)}] {e.message}"


class TemplateApi:
    def __init__(self, builds: TemplateBuilds, upload_dir: Path, max_upload_bytes: int = 4 << 30,
                 max_parallel_uploads: int = 4, floor: DiskFloor | None = None,
                 first_build_wait: float = FIRST_BUILD_PATIENCE) -> None:
        self.builds = builds
        self.upload_dir = upload_dir
        self.max_upload_bytes = max_upload_bytes
        self.max_parallel_uploads = max_parallel_uploads
        self.first_build_wait = first_build_wait      # [templates] first_build_wait
        self.floor = floor if floor is not None else DiskFloor()
        self.access = TemplateAccess(builds)     # which team may do what (template_access.py)
        self._uploads = 0
        self.quotas: QuotaGate | None = None    # the teams' concurrent-build quotas (set by the server)
        self._key = secrets.token_bytes(32)
        # signatures of upload URLs in use or used (until they expire): one upload each
        self._spent: dict[str, float] = {}
        # parts a stopped process left (an upload is never resumed: the SDK sends it again)
        if upload_dir.is_dir():
            for left in upload_dir.glob("*.part"):
                left.unlink(missing_ok=True)

    # ------------------------------------------------------------------ build

    async def await_first_build(self, ref: str, patience: float | None = None) -> None:
        """Before a create from ``ref``: when its template's first build is running, wait
        up to ``patience`` seconds (default ``[templates] first_build_wait``) for it to end;
        ApiError 503 (Retry-After) if it has not.
        Returns at once for any other template (ready, unknown, or failed: the create's
        own lookup answers)."""
        task = self.builds.first_build(ref)
        if task is None:
            return
        wait = self.first_build_wait if patience is None else patience
        done, _ = await asyncio.wait({task}, timeout=wait) if wait > 0 else (set(), set())  # never cancels it
        if not done:
            raise ApiError(503, f"template {ref!r} is being built (its first build, e.g. the node's own "
                                f"code-interpreter-v1 after its first start): retry shortly",
                           retry=True, retry_after=FIRST_BUILD_RETRY_AFTER)

    async def request_build(self, request: web.Request, call: Call) -> web.Response:
        b = call.body
        name = b["name"] or b["alias"]
        if not name:
            raise ApiError(400, "name is required")
        try:
            run = await self.builds.request(name, b["tags"], BuildResources(b["cpuCount"], b["memoryMB"],
                                                                            b["minFreeDiskMb"]),
                                            owner=owner_of(_team(request)))
        except VmError as e:
            raise _error(e, f"template {name!r}") from None
        return json_response({"templateID": run.name, "buildID": run.build_id, "public": False,
                              "names": [run.name], "aliases": [run.name], "tags": list(run.tags)}, 202)

    async def files(self, request: web.Request, call: Call) -> web.Response:
        tid, files_hash = call.path["templateID"], call.path["hash"]
        if not _HASH.match(files_hash):
            raise ApiError(400, f"bad files hash {files_hash[:64]!r}")
        missing = f"unknown template {tid!r}: request a build first (POST /v3/templates)"
        self.access.check_own(tid, _team(request), missing)
        try:
            if not self.builds.template_exists(tid):
                raise ApiError(404, missing)
        except VmError as e:
            raise _error(e, "files") from None
        if self.builds.files_present(files_hash):
            return json_response({"present": True}, 201)
        build_id = self.builds.waiting_build(tid)
        if build_id is None:
            raise ApiError(409, f"template {tid!r} has no requested build waiting for its files: request one "
                                f"first (POST /v3/templates)")
        expires = int(time.time() + UPLOAD_TTL)
        nonce = secrets.token_hex(8)        # every URL handed out is one of its own (one upload each)
        url = (f"{request.url.origin()}{UPLOAD_PATH.format(hash=files_hash)}?template={quote(tid, safe='')}"
               f"&build={quote(build_id, safe='')}&expires={expires}&nonce={nonce}"
               f"&signature={self._sign(tid, build_id, files_hash, expires, nonce)}")
        return json_response({"present": False, "url": url}, 201)

    def _sign(self, template_id: str, build_id: str, files_hash: str, expires: int, nonce: str) -> str:
        what = json.dumps([template_id, build_id, files_hash, expires, nonce])  # unambiguous whatever the names hold
        return hmac.new(self._key, what.encode(), hashlib.sha256).hexdigest()

    def _take_url(self, signature: str, expires: float) -> None:
        """Mark an upload URL in use; 409 if it is (or was) used already."""
        now = time.time()
        for sig in [s for s, exp in self._spent.items() if exp < now]:
            del self._spent[sig]
        if signature in self._spent:
            raise ApiError(409, "this upload URL was used already (each takes one upload): ask for a new one "
                                "with GET /templates/{templateID}/files/{hash}")
        self._spent[signature] = expires

    async def upload(self, request: web.Request, call: Call) -> web.Response:
        files_hash = call.path["hash"]
        q = call.query
        tid, build_id = q["template"], q["build"]
        # bytes, not str: compare_digest refuses (TypeError) a str with non-ASCII characters
        if not _HASH.match(files_hash) or not hmac.compare_digest(
                self._sign(tid, build_id, files_hash, q["expires"], q["nonce"]).encode(),
                q["signature"].encode("utf-8", "surrogateescape")):
            raise ApiError(401, "invalid upload signature")
        if q["expires"] < time.time():
            raise ApiError(401, "the upload URL has expired: ask for a new one")
        try:
            self.builds.startable(tid, build_id)
        except NotFound:
            raise ApiError(410, f"the build {build_id} this upload URL was issued for is gone") from None
        except Conflict:
            raise ApiError(409, f"the build {build_id} this upload URL was issued for has started: it takes no "
                                f"more uploads") from None
        length = request.content_length
        if length is not None and length > self.max_upload_bytes:
            raise ApiError(413, f"the upload is larger than {self.max_upload_bytes} bytes")
        if self._uploads >= self.max_parallel_uploads:
            raise ApiError(429, f"{self._uploads} uploads are being received ([templates] max_parallel_uploads): "
                                f"try again shortly", retry=True, retry_after=UPLOAD_RETRY_AFTER)
        self.upload_dir.mkdir(parents=True, exist_ok=True)
        self._check_floor(length or 0)
        self._take_url(q["signature"], q["expires"])
        self._uploads += 1
        path = self.upload_dir / f"{files_hash}.{secrets.token_hex(4)}.part"
        done = False
        try:
            size = 0
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                async for data in request.content.iter_chunked(UPLOAD_CHUNK):
                    size += len(data)
                    if size > self.max_upload_bytes:
                        raise ApiError(413, f"the upload is larger than {self.max_upload_bytes} bytes")
                    if length is None:
                        self._check_floor(len(data))     # a known length was checked whole
                    await asyncio.to_thread(_write_all, fd, data)   # a slow disk never stalls the loop
            finally:
                os.close(fd)
            if length is not None and size != length:
                raise ApiError(400, f"the upload ended after {size} of {length} bytes")
            if not self.builds.files_present(files_hash):
                await self.builds.accept_files(files_hash, path)
            done = True
        finally:
            self._uploads -= 1
            path.unlink(missing_ok=True)
            if not done:    # a failed upload does not spend its URL: the client may send it again
                self._spent.pop(q["signature"], None)
        await self.builds.sweep_contexts()
        return web.Response(status=200)

    def _check_floor(self, incoming: int) -> None:
        """507 when ``incoming`` more bytes (in one new file) would leave the upload dir's
        filesystem below the node's free-disk floor."""
        why = self.floor.shortage(self.upload_dir, incoming, 1)
        if why is not None:
            raise ApiError(507, f"the node cannot take this upload now: {why}")

    def admit_build(self, request: web.Request, tid: str, bid: str) -> None:
        """Count build ``bid`` against its team's concurrent-builds quota (429 at it, quotas.py)."""
        if self.quotas is None:
            return

        def active(key: str) -> bool:
            t, b = key.split("\n", 1)
            try:
                return self.builds.status(t, b, 0, 0).status in ("waiting", "building")
            except VmError:
                return False
        self.quotas.build_started(principal_of(request).team_id, f"{tid}\n{bid}", active)

    async def start_build(self, request: web.Request, call: Call) -> web.Response:
        tid, bid = call.path["templateID"], call.path["buildID"]
        team = _team(request)
        self.access.check_own(tid, team, self.access.no_build(tid, bid))
        try:
            self.builds.startable(tid, bid)      # an unknown or started build: 404 / 409 before the body's 400
            spec = parse_build_spec(call.body)
            if spec.from_template:      # built from another team's private template: as if there were none
                self.access.check_read(spec.from_template, team)
            self.admit_build(request, tid, bid)
            await self.builds.start_build(tid, bid, spec)
        except MalformedBuild as e:
            raise ApiError(400, f"build {bid}: {e}") from None
        except VmError as e:
            raise _error(e, f"build {bid}") from None
        return web.Response(status=202)

    async def status(self, request: web.Request, call: Call) -> web.Response:
        q = call.query
        tid, bid = call.path["templateID"], call.path["buildID"]
        self.access.check_own(tid, _team(request), self.access.no_build(tid, bid))
        try:
            view = self.builds.status(call.path["templateID"], call.path["buildID"], q["logsOffset"] or 0,
                                      100 if q["limit"] is None else q["limit"], q["level"])
        except VmError as e:
            raise _error(e, "build status") from None
        out: dict[str, Any] = {"templateID": view.name, "buildID": view.build_id, "status": view.status,
                               "logs": [_line(e) for e in view.entries],
                               "logEntries": [_entry(e) for e in view.entries]}
        if view.reason is not None:
            reason: dict[str, Any] = {"message": view.reason[0],
                                      "logEntries": [_entry(e) for e in view.reason_entries]}
            if view.reason[1] is not None:
                reason["step"] = view.reason[1]
            out["reason"] = reason
        return json_response(out)

    async def logs(self, request: web.Request, call: Call) -> web.Response:
        q = call.query
        tid, bid = call.path["templateID"], call.path["buildID"]
        self.access.check_own(tid, _team(request), self.access.no_build(tid, bid))
        try:
            view = self.builds.status(call.path["templateID"], call.path["buildID"], 0, 10**9, q["level"])
        except VmError as e:
            raise _error(e, "build logs") from None
        entries = view.entries
        if q["direction"] == "backward":
            entries = entries[::-1]
        start = q["cursor"] or 0
        limit = 100 if q["limit"] is None else q["limit"]
        return json_response({"logs": [_entry(e) for e in entries[start:start + limit]]})

    # ------------------------------------------------------------------ templates

    def _base_view(self) -> dict[str, Any] | None:
        tpl = self.builds.base_template()
        if tpl is None:
            return None
        when = iso(tpl.created)
        bid = "00000000-0000-4000-8000-" + tpl.id.removeprefix("tpl-").rjust(12, "0")[-12:]
        return {"templateID": "base", "buildID": bid, "cpuCount": tpl.vcpus, "memoryMB": tpl.memory_mib,
                "diskSizeMB": tpl.disk_mib, "public": True, "aliases": ["base"], "names": ["base"],
                "createdAt": when, "updatedAt": when, "createdBy": None, "lastSpawnedAt": None, "spawnCount": 0,
                "buildCount": 1, "envdVersion": tpl.envd_version or "", "buildStatus": "ready", "isDefault": True,
                "builds": [{"buildID": bid, "status": "ready", "createdAt": when, "updatedAt": when,
                            "finishedAt": when, "cpuCount": tpl.vcpus, "memoryMB": tpl.memory_mib,
                            "diskSizeMB": tpl.disk_mib, "envdVersion": tpl.envd_version or ""}]}

    @staticmethod
    def _view(v: TemplateView, with_builds: bool = False) -> dict[str, Any]:
        b = v.build
        out: dict[str, Any] = {
            "templateID": v.template_id, "buildID": b.build_id if b else "", "cpuCount": b.cpu_count if b else 0,
            "memoryMB": b.memory_mb if b else 0, "diskSizeMB": b.disk_mb if b else 0, "public": v.public,
            "aliases": list(v.names), "names": list(v.names), "createdAt": iso(v.created),
            "updatedAt": iso(v.updated), "createdBy": None, "lastSpawnedAt": None, "spawnCount": 0,
            "buildCount": len(v.builds), "envdVersion": (b.envd_version or "") if b else "",
            "buildStatus": v.status}
        if with_builds:
            out["builds"] = [{"buildID": x.build_id, "status": x.status, "createdAt": iso(x.created),
                              "updatedAt": iso(x.finished or x.created),
                              **({"finishedAt": iso(x.finished)} if x.finished else {}),
                              "cpuCount": x.cpu_count, "memoryMB": x.memory_mb, "diskSizeMB": x.disk_mb,
                              **({"envdVersion": x.envd_version} if x.envd_version else {})}
                             for x in v.builds]
        return out

    def _listed(self, team: str) -> list[tuple[float, dict[str, Any]]]:
        """The team's templates with a finished build and the node's public ones, the
        node's base first: (created, Template)."""
        owner = owner_of(team)
        out = [(v.created, self._view(v)) for v in self.builds.list_templates()
               if v.build is not None and (v.owner == owner or v.template_id in NODE_PUBLIC)]
        base = self._base_view()
        tpl = self.builds.base_template()
        if base is not None and tpl is not None:
            base.pop("builds")
            out.insert(0, (tpl.created, base))
        return out

    async def list_templates(self, request: web.Request, call: Call) -> web.Response:
        return json_response([t for _, t in self._listed(_team(request))])

    async def list_templates_v2(self, request: web.Request, call: Call) -> web.Response:
        """``GET /v2/templates``: the same templates, oldest first, in pages of ``limit``
        (100) continued by ``X-Next-Token`` (the node's keyset token, as its other lists)."""
        q = call.query
        items, token = page(self._listed(_team(request)), lambda t: (t[0], t[1]["templateID"]), False, q["limit"],
                            q["next_token"])
        return json_response([t for _, t in items], headers={NEXT_TOKEN_HEADER: token} if token else None)

    async def _update(self, request: web.Request, call: Call) -> list[str]:
        """Set ``public`` (absent: nothing changes, as E2B); the template's names. Public:
        every team of the node may read, create from and build from it (template_access.py)."""
        tid, public = call.path["templateID"], call.body["public"]
        if tid in ("base", self.builds.settings.base_template):
            if public is False:
                raise ApiError(409, "the node's base template is always public: every caller of this node "
                                    "creates sandboxes from it")
            return ["base"]
        self.access.check_own(tid, _team(request))
        if public is False and self.access.node_public(tid):
            raise ApiError(409, f"{CODE_INTERPRETER} is always public: the code interpreter SDK creates every "
                                f"team's sandboxes from it")
        try:
            view = self.builds.get(tid) if public is None else await self.builds.set_public(tid, public)
        except VmError as e:
            raise _error(e, f"template {tid!r}") from None
        return list(view.names)

    async def update_template(self, request: web.Request, call: Call) -> web.Response:
        await self._update(request, call)
        return json_response(None)      # E2B's v1 answer: 200 with a JSON null

    async def update_template_v2(self, request: web.Request, call: Call) -> web.Response:
        return json_response({"names": await self._update(request, call)})

    async def get_template(self, request: web.Request, call: Call) -> web.Response:
        tid = call.path["templateID"]
        if tid == "base":
            base = self._base_view()
            if base is not None:
                return json_response(base)
        self.access.check_read(tid, _team(request))
        try:
            return json_response(self._view(self.builds.get(tid), with_builds=True))
        except VmError as e:
            raise _error(e, f"template {tid!r}") from None

    async def delete_template(self, tid: str, team: str = DEFAULT_TEAM_ID) -> bool:
        """True if ``tid`` was an E2B template (now gone); False: not one (a snapshot, maybe).
        Another team's: 404."""
        if tid in ("base", self.builds.settings.base_template):
            raise ApiError(409, "the node's base template cannot be deleted through the API")
        # another team's: what a name that is neither template nor snapshot gets (api.py)
        self.access.check_own(tid, team, f"snapshot {tid!r} not found")
        try:
            return await self.builds.delete(tid)
        except BadRequest:
            return False      # not a template name: the caller tries snapshot ids
        except VmError as e:
            raise _error(e, f"template {tid!r}") from None

    async def alias(self, request: web.Request, call: Call) -> web.Response:
        try:
            self.access.check_read(call.path["alias"], _team(request))
        except ApiError:
            raise ApiError(404, f"no template named {call.path['alias'][:128]!r}") from None
        try:
            tid = self.builds.alias(call.path["alias"])
        except BadRequest:
            raise ApiError(404, f"no template named {call.path['alias'][:128]!r}") from None
        except VmError as e:
            raise _error(e, "alias") from None
        try:
            public = tid == "base" or self.builds.get(tid).public
        except VmError as e:
            raise _error(e, "alias") from None
        return json_response({"templateID": tid, "public": public})

    # ------------------------------------------------------------------ tags

    async def assign_tags(self, request: web.Request, call: Call) -> web.Response:
        self.access.check_own(call.body["target"], _team(request))
        try:
            bid, tags = await self.builds.assign_tags(call.body["target"], call.body["tags"])
        except VmError as e:
            raise _error(e, "tags") from None
        return json_response({"buildID": bid, "tags": tags}, 201)

    async def delete_tags(self, request: web.Request, call: Call) -> web.Response:
        self.access.check_own(call.body["name"], _team(request))
        try:
            await self.builds.remove_tags(call.body["name"], call.body["tags"])
        except VmError as e:
            raise _error(e, "tags") from None
        return no_content()

    async def list_tags(self, request: web.Request, call: Call) -> web.Response:
        self.access.check_own(call.path["templateID"], _team(request))
        try:
            tags = self.builds.tags(call.path["templateID"])
        except VmError as e:
            raise _error(e, "tags") from None
        return json_response([{"tag": t, "buildID": bid, "createdAt": iso(when)} for t, bid, when in tags])

    # ------------------------------------------------------------------ table

    async def admin_cancel_builds(self, request: web.Request, call: Call) -> web.Response:
        """E2B's ``AdminBuildCancelResult``: every build of the team's templates this node runs
        or holds requested, cancelled (each ends failed, saying so in its status)."""
        tid = call.path["teamID"]
        done, failed = await self.builds.cancel_builds(owner_of(tid), "the build was cancelled by the admin")
        return json_response({"cancelledCount": done, "failedCount": failed})

    def routes(self) -> list[Route]:
        t = ("templates",)
        return [
            Route("POST", "/admin/teams/{teamID}/builds/cancel", self.admin_cancel_builds,
                  "cancel every running or waiting build of a team's templates on this node",
                  (Reply(200, "how many were cancelled and how many failed", None),),
                  admin=Admin.ONLY, tags=("admin",)),
            Route("POST", "/v3/templates", self.request_build, "request a template build",
                  (Reply(202, "the build was requested", None),), body=BUILD_REQUEST, body_required=True, tags=t),
            Route("GET", "/templates/{templateID}/files/{hash}", self.files,
                  "whether a COPY context is present, else where to upload it",
                  (Reply(201, "present, or the upload URL", None), Reply(404, "unknown template", "Error")),
                  tags=t),
            Route("PUT", UPLOAD_PATH, self.upload, "upload a COPY context (signed URL, no API key)",
                  (Reply(200, "stored"), Reply(401, "bad or expired signature", "Error")), query=UPLOAD_QUERY,
                  auth=False, tags=t),
            Route("POST", "/v2/templates/{templateID}/builds/{buildID}", self.start_build, "start a build",
                  (Reply(202, "the build has started"), Reply(400, "malformed steps", "Error"),
                   Reply(404, "unknown build", "Error")), body=BUILD_START, body_required=True, tags=t),
            Route("GET", "/templates/{templateID}/builds/{buildID}/status", self.status,
                  "build status and log entries from logsOffset",
                  (Reply(200, "the status", None), Reply(404, "unknown build", "Error")), query=STATUS_QUERY,
                  tags=t),
            Route("GET", "/templates/{templateID}/builds/{buildID}/logs", self.logs, "build log entries",
                  (Reply(200, "the log", None), Reply(404, "unknown build", "Error")), query=LOGS_QUERY, tags=t),
            Route("GET", "/templates", self.list_templates, "templates with a finished build",
                  (Reply(200, "the templates", None),), tags=t),
            Route("GET", "/v2/templates", self.list_templates_v2, "templates with a finished build, paged",
                  (Reply(200, "the templates; the next page's token in X-Next-Token", None, ("X-Next-Token",)),
                   Reply(400, "bad limit or nextToken", "Error")), query=LIST_V2_QUERY, tags=t),
            Route("PATCH", "/templates/{templateID}", self.update_template, "make a template public or not (v1)",
                  (Reply(200, "updated (a JSON null)", None), Reply(400, "bad body", "Error"),
                   Reply(404, "unknown template", "Error"), Reply(409, "the base template is always public",
                                                                  "Error")),
                  body=UPDATE_REQUEST, body_required=True, tags=t, router_path=TEMPLATE_ID_PATH),
            Route("PATCH", "/v2/templates/{templateID}", self.update_template_v2, "make a template public or not",
                  (Reply(200, "updated: the template's names", None), Reply(400, "bad body", "Error"),
                   Reply(404, "unknown template", "Error"), Reply(409, "the base template is always public",
                                                                  "Error")),
                  body=UPDATE_REQUEST, body_required=True, tags=t),
            Route("GET", "/templates/{templateID}", self.get_template, "a template and its builds",
                  (Reply(200, "the template", None), Reply(404, "unknown template", "Error")), tags=t,
                  router_path=TEMPLATE_ID_PATH),
            Route("GET", "/templates/aliases/{alias}", self.alias, "the template a name resolves to",
                  (Reply(200, "the template id", None), Reply(404, "no such name", "Error")), tags=t),
            Route("POST", "/templates/tags", self.assign_tags, "tag the build a name:tag points at",
                  (Reply(201, "tagged", None), Reply(404, "unknown template or tag", "Error")), body=ASSIGN_TAGS,
                  body_required=True, tags=t),
            Route("DELETE", "/templates/tags", self.delete_tags, "remove tags of a template",
                  (Reply(204, "removed"), Reply(404, "unknown template or tag", "Error")), body=DELETE_TAGS,
                  body_required=True, tags=t),
            Route("GET", "/templates/{templateID}/tags", self.list_tags, "the tags of a template",
                  (Reply(200, "the tags", None), Reply(404, "unknown template", "Error")), tags=t),
        ]


def _team(request: web.Request) -> str:
    return principal_of(request).team_id


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
