"""E2B's Volume API over ``aenv_vm.volumes``, as the SDK (2.x ``e2b.Volume``) calls it.

Control plane, with the API key like every other route: ``GET/POST /volumes``,
``GET/DELETE /volumes/{volumeID}``. A volume's answer carries its ``token``, and a
``domain`` only when ``[server] volume_domain`` is set (E2B sends one only for
custom clusters; without it the SDK sends content requests to
``E2B_VOLUME_API_URL``, which ``aenv server`` prints).

Content, authorised by the volume's token as the SDK sends it (``Authorization:
Bearer <token>``, no API key): ``/volumecontent/{volumeID}/path`` (GET stat, DELETE
remove, PATCH uid/gid/mode), ``…/dir`` (GET list with ``depth``, POST make),
``…/file`` (GET read, PUT write: the body streams to the file, a read streams from
it; memory stays bounded whatever the size). Every path is resolved by
``VolumeTree``: beneath the volume's root, no symlink followed (docs/volumes.md).

Statuses, as E2B's volume service answers them: 201 for a made file or directory,
204 for a removal, 404 for a missing path or volume, 409 for an existing one, 400
for a path through a file (or, here, through a symlink), for a symlink where a file
or directory is needed and for bad parameters, 401 for a missing or wrong token.
"""
from __future__ import annotations

import asyncio
import errno
import os
from typing import Any, Callable

from aiohttp import web

from aenv_vm.volumes.charged import ChargedTree
from aenv_vm.volumes.quota import VolumeQuota
from aenv_vm.volumes.registry import (InvalidVolumeName, VolumeInUse, VolumeNameTaken, VolumeNotFound,
                                      VolumeRecord, VolumeRegistry, is_volume_id)
from aenv_vm.volumes.tree import CHUNK, MAX_DEPTH, MAX_PATH, VolumeTree

from .errors import ApiError
from .keystore import DEFAULT_TEAM_ID
from .owners import OwnerMap
from .principal import principal_of
from .quotas import TeamQuota, over_volume_bytes
from .responses import json_response, no_content
from .routes import Call, Reply, Route
from .schemas import Field, Schema

NEW_VOLUME = Schema("NewVolume", (
    Field("name", "string", required=True, max_length=255, description="^[a-zA-Z0-9_-]+$"),
    # aenv's own: the volume's quota (E2B's NewVolume has only a name); absent: the node's
    # [volumes] defaults; 0: that bound off (the node's free-disk floor still holds)
    Field("maxBytes", "integer", minimum=0, maximum=1 << 62,
          description="bytes its files may take (aenv; default [volumes] max_bytes)"),
    Field("maxInodes", "integer", minimum=0, maximum=1 << 62,
          description="files, directories and symlinks it may hold (aenv; default [volumes] max_inodes)")))
_PATH = Field("path", "string", required=True, max_length=MAX_PATH, description="path in the volume")
_UID = Field("uid", "integer", minimum=0, maximum=0xFFFFFFFE)
_GID = Field("gid", "integer", minimum=0, maximum=0xFFFFFFFE)
_MODE = Field("mode", "integer", minimum=0, maximum=0o7777)
_FORCE = Field("force", "boolean", description="make missing parents (and, for a file, replace it)")
PATH_QUERY = Schema("VolumePathQuery", (_PATH,))
LIST_QUERY = Schema("VolumeListQuery", (_PATH, Field("depth", "integer", minimum=-(2**31), maximum=2**31)))
MAKE_QUERY = Schema("VolumeMakeQuery", (_PATH, _UID, _GID, _MODE, _FORCE))
PATCH_BODY = Schema("VolumePathPatch", (_UID, _GID, _MODE))

# OSError errno → HTTP status of a content request (anything else is a 500)
_STATUS = {errno.ENOENT: 404, errno.EEXIST: 409, errno.ENOTEMPTY: 409, errno.ENOTDIR: 400, errno.EISDIR: 400,
           errno.ELOOP: 400, errno.EINVAL: 400, errno.ENAMETOOLONG: 400, errno.E2BIG: 400, errno.EACCES: 403,
           errno.EPERM: 403, errno.EROFS: 403, errno.ENOSPC: 507, errno.EDQUOT: 507, errno.EFBIG: 413}


def _volume(rec: VolumeRecord, domain: str, quota: VolumeQuota) -> dict[str, Any]:
    # E2B's VolumeAndToken, and aenv's own: the bounds the volume was made with (0: none;
    # a fleet's gateway holds a team's volumeBytes quota by them)
    out: dict[str, Any] = {"volumeID": rec.volume_id, "name": rec.name, "token": rec.token,
                           "maxBytes": quota.max_bytes, "maxInodes": quota.max_inodes}
    if domain:
        out["domain"] = domain
    return out


def _bearer(request: web.Request) -> str:
    """The token of the one ``Authorization: Bearer`` header, or a 401."""
    values = request.headers.getall("Authorization", [])
    scheme, _, token = values[0].strip().partition(" ") if len(values) == 1 else ("", "", "")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "a volume token is required: send Authorization: Bearer <the volume's token> "
                            "(Volume.create / Volume.connect give it)")
    return token.strip()


class VolumeApi:
    def __init__(self, registry: VolumeRegistry, domain: str = "") -> None:
        self.registry = registry
        self.domain = domain
        # which team owns each volume (owners.py); the server (app.py) sets the node's map.
        # Without one every volume is the default team's.
        self.owners: OwnerMap | None = None
        # each team's quota (keystore.py; app.py sets it): its volumeBytes bounds the sum
        # of its volumes' maxBytes, checked and the volume made under one lock
        self.quota_of: Callable[[str], TeamQuota] | None = None
        self._creating = asyncio.Lock()

    def owner(self, volume_id: str) -> str:
        return self.owners.owner(volume_id) if self.owners is not None else DEFAULT_TEAM_ID

    def foreign_mount(self, mounts: list[Any], team: str) -> str | None:
        """The name of the first volume ``mounts`` (a create's volumeMounts) names that
        belongs to another team than ``team``, or None."""
        for m in mounts:
            name = m.get("name") if isinstance(m, dict) else None
            rec = self.registry.by_name(name) if isinstance(name, str) else None
            if rec is not None and self.owner(rec.volume_id) != team:
                return str(name)
        return None

    # ------------------------------------------------------------- volumes

    async def list_volumes(self, request: web.Request, call: Call) -> web.Response:
        team = principal_of(request).team_id
        return json_response([{"volumeID": r.volume_id, "name": r.name} for r in self.registry.list()
                              if self.owner(r.volume_id) == team])

    async def create(self, request: web.Request, call: Call) -> web.Response:
        team = principal_of(request).team_id
        limit = self.quota_of(team).volume_bytes if self.quota_of is not None else None
        if limit is None:
            rec = await self._make(call, team)
        else:
            async with self._creating:      # the check, the make and its owner, one create at a time
                self._check_volume_bytes(team, limit, call.body["maxBytes"])
                rec = await self._make(call, team)
        return json_response(_volume(rec, self.domain, self.registry.quota(rec)), 201)

    async def _make(self, call: Call, team: str) -> VolumeRecord:
        try:
            rec = await asyncio.to_thread(self.registry.create, call.body["name"], call.body["maxBytes"],
                                          call.body["maxInodes"])
        except InvalidVolumeName as e:
            raise ApiError(400, f"Invalid volume name: {e}") from None
        except VolumeNameTaken as e:
            raise ApiError(400, str(e)) from None   # E2B's status and message for a taken name
        if self.owners is not None:
            await asyncio.to_thread(self.owners.put, rec.volume_id, team)
        return rec

    def _bound_of(self, max_bytes: int | None) -> int:
        """The byte bound a volume made with ``max_bytes`` gets (0: unbounded)."""
        return self.registry.default_quota.max_bytes if max_bytes is None else max_bytes

    def _check_volume_bytes(self, team: str, limit: int, max_bytes: int | None) -> None:
        """The ApiError when a volume of ``max_bytes`` would take ``team``'s volumes' bounds
        past ``limit``. A volume without a byte bound could hold anything: none is made
        under a byte quota, and one made before the quota leaves no room."""
        asked = self._bound_of(max_bytes)
        if asked == 0:
            raise ApiError(400, "your team has a volumeBytes quota, so its volumes need a byte bound: send maxBytes "
                                "> 0 (this node's default, [volumes] max_bytes, is unbounded)")
        held = 0
        for rec in self.registry.list():
            if self.owner(rec.volume_id) != team:
                continue
            bound = self.registry.quota(rec).max_bytes
            if bound == 0:
                raise ApiError(507, f"your team's volume {rec.name!r} has no byte bound (made before the "
                                    f"volumeBytes quota): it leaves no room under the quota; delete it first",
                               retry=False)
            held += bound
        if held + asked > limit:
            raise over_volume_bytes(limit, held, asked)

    def _record(self, request: web.Request, volume_id: str) -> VolumeRecord:
        """The caller's team's volume; another team's is not found, as an unknown id."""
        if not is_volume_id(volume_id):
            raise ApiError(400, f"Invalid volume ID {volume_id[:64]!r}: a volume ID is a UUID")
        try:
            rec = self.registry.get(volume_id)
        except VolumeNotFound:
            raise ApiError(404, "Volume not found") from None
        if self.owner(rec.volume_id) != principal_of(request).team_id:
            raise ApiError(404, "Volume not found")
        return rec

    async def get(self, request: web.Request, call: Call) -> web.Response:
        rec = self._record(request, call.path["volumeID"])
        return json_response(_volume(rec, self.domain, self.registry.quota(rec)))

    async def delete(self, request: web.Request, call: Call) -> web.Response:
        rec = self._record(request, call.path["volumeID"])
        try:
            await asyncio.to_thread(self.registry.delete, rec.volume_id)
        except VolumeNotFound:
            raise ApiError(404, "Volume not found") from None
        except VolumeInUse as e:
            raise ApiError(409, str(e), retry=False) from None
        if self.owners is not None:
            await asyncio.to_thread(self.owners.drop, rec.volume_id)
        return no_content()

    # ------------------------------------------------------------- content

    def _tree(self, request: web.Request, call: Call) -> ChargedTree:
        token = _bearer(request)
        rec = self.registry.find(call.path["volumeID"])
        if rec is None:
            raise ApiError(404, "Volume not found")
        if not rec.token_matches(token):
            raise ApiError(401, "invalid volume token for this volume")
        return self.registry.tree(rec.volume_id)

    @staticmethod
    def _failure(e: OSError, tree: VolumeTree, path: str) -> ApiError:
        """The API answer to an OSError of ``tree``: a message naming the in-volume path,
        never a host one."""
        where = e.filename if isinstance(e.filename, str) else ""
        if not where.startswith("/") or where.startswith(("/proc/", str(tree.root))):
            where = path if path.startswith("/") else "/" + path
        status = _STATUS.get(e.errno or 0, 500)
        reason = e.strerror or os.strerror(e.errno or 0)
        if status == 500:
            return ApiError(500, f"{where}: {reason}")
        return ApiError(status, f"{where[:512]}: {reason}")

    async def _run(self, tree: VolumeTree, path: str, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as e:
            raise self._failure(e, tree, path) from None

    async def stat(self, request: web.Request, call: Call) -> web.Response:
        tree, path = self._tree(request, call), call.query["path"]
        return json_response((await self._run(tree, path, tree.get_info, path)).to_json())

    async def remove(self, request: web.Request, call: Call) -> web.Response:
        tree, path = self._tree(request, call), call.query["path"]
        await self._run(tree, path, tree.remove, path)
        return no_content()

    async def patch(self, request: web.Request, call: Call) -> web.Response:
        tree, path = self._tree(request, call), call.query["path"]
        b = call.body
        entry = await self._run(tree, path, tree.update_metadata, path, b["uid"], b["gid"], b["mode"])
        return json_response(entry.to_json())

    async def list_dir(self, request: web.Request, call: Call) -> web.Response:
        tree, path = self._tree(request, call), call.query["path"]
        depth = call.query["depth"]
        depth = 1 if depth is None or depth < 1 else depth    # E2B: below 1 is 1, above 10 a 400
        if depth > MAX_DEPTH:
            raise ApiError(400, f"depth must be at most {MAX_DEPTH}, got {depth}")
        entries = await self._run(tree, path, tree.list_dir, path, depth)
        return json_response([e.to_json() for e in entries])

    async def make_dir(self, request: web.Request, call: Call) -> web.Response:
        tree, q = self._tree(request, call), call.query
        entry = await self._run(tree, q["path"], tree.make_dir, q["path"], bool(q["force"]), q["mode"], q["uid"],
                                q["gid"])
        return json_response(entry.to_json(), 201)

    async def read_file(self, request: web.Request, call: Call) -> web.StreamResponse:
        tree, path = self._tree(request, call), call.query["path"]
        fd, size = await self._run(tree, path, tree.open_read, path)
        try:
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/octet-stream"})
            resp.content_length = size
            await resp.prepare(request)
            left = size
            try:
                while left > 0:
                    data = await asyncio.to_thread(os.read, fd, min(CHUNK, left))
                    if not data:
                        break        # the file shrank while read: the short body tells the client
                    await resp.write(data)
                    left -= len(data)
            except OSError:
                left = 1
            if left > 0:
                resp.force_close()
            else:
                await resp.write_eof()
        finally:
            os.close(fd)
        return resp

    async def write_file(self, request: web.Request, call: Call) -> web.Response:
        tree, q = self._tree(request, call), call.query
        path = q["path"]
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise ApiError(415, f"unsupported Content-Encoding {encoding[:40]!r}: send the file's bytes as they are")
        fd = await self._run(tree, path, tree.open_write, path, bool(q["force"]), q["mode"], q["uid"], q["gid"])
        try:
            buf = bytearray()
            async for data in request.content.iter_chunked(CHUNK):
                buf += data
                if len(buf) >= CHUNK:
                    await self._run(tree, path, tree.write_chunk, fd, bytes(buf))
                    buf.clear()
            if buf:
                await self._run(tree, path, tree.write_chunk, fd, bytes(buf))
        except BaseException:
            os.close(fd)
            raise
        entry = await self._run(tree, path, tree.finish_write, fd, path, q["mode"], q["uid"], q["gid"])
        return json_response(entry.to_json(), 201)

    # ------------------------------------------------------------- table

    def routes(self) -> list[Route]:
        t = ("volumes",)
        gone = Reply(404, "no such volume", "Error")
        bad = Reply(400, "bad path or parameter (a path through a file or a symlink, '..')", "Error")
        denied = Reply(401, "missing or wrong volume token", "Error")
        vol = "/volumecontent/{volumeID}"

        def content(method: str, suffix: str, handler: Any, summary: str, ok: Reply, *more: Reply,
                    query: Schema = PATH_QUERY, body: Schema | None = None) -> Route:
            return Route(method, vol + suffix, handler, summary + " (auth: Authorization: Bearer <volume token>)",
                         (ok, bad, denied, Reply(404, "no such volume or path", "Error"), *more), query=query,
                         body=body, auth=False, tags=t,
                         content_type="application/octet-stream" if handler == self.read_file else "application/json")

        return [
            Route("GET", "/volumes", self.list_volumes, "list the node's volumes", (Reply(200, "the volumes", None),),
                  tags=t),
            Route("POST", "/volumes", self.create, "create a volume",
                  (Reply(201, "the volume and its token", None), Reply(400, "bad or taken name", "Error"),
                   Reply(507, "its bound does not fit the team's volumeBytes quota", "Error")),
                  body=NEW_VOLUME, body_required=True, tags=t),
            Route("GET", "/volumes/{volumeID}", self.get, "a volume and its token",
                  (Reply(200, "the volume", None), Reply(400, "not a volume ID", "Error"), gone), tags=t),
            Route("DELETE", "/volumes/{volumeID}", self.delete, "delete a volume and its files",
                  (Reply(204, "deleted"), gone, Reply(409, "a sandbox mounts it", "Error")), tags=t),
            content("GET", "/path", self.stat, "stat a path (a symlink is reported, not followed)",
                    Reply(200, "the entry", None)),
            content("DELETE", "/path", self.remove, "remove a file, symlink or directory (recursively)",
                    Reply(204, "removed")),
            content("PATCH", "/path", self.patch, "set uid, gid, mode", Reply(200, "the entry", None),
                    body=PATCH_BODY),
            content("GET", "/dir", self.list_dir, "list a directory down to depth (1..10)",
                    Reply(200, "the entries", None), query=LIST_QUERY),
            content("POST", "/dir", self.make_dir, "make a directory (force: and its parents)",
                    Reply(201, "the directory", None), Reply(409, "exists", "Error"), query=MAKE_QUERY),
            content("GET", "/file", self.read_file, "read a file (streamed)", Reply(200, "the bytes", "text")),
            content("PUT", "/file", self.write_file, "write a file from the body (streamed; force: replace, "
                    "make parents)", Reply(201, "the file", None), Reply(409, "exists (no force)", "Error"),
                    query=MAKE_QUERY),
        ]
