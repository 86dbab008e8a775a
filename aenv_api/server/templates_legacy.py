"""E2B's deprecated template request flows, as older SDKs and E2B's v1 CLI call them, over
the same ``TemplateBuilds`` as templates_api.py:

* ``POST /v2/templates`` (``TemplateBuildRequestV2``: alias, cpuCount, memoryMB): a build
  requested as ``POST /v3/templates`` does it, answered 202 with a ``TemplateLegacy``;
  started with its steps by ``POST /v2/templates/{id}/builds/{buildID}``.
* ``POST /templates`` (``TemplateBuildRequest``: a Dockerfile, alias, startCmd, readyCmd,
  cpuCount, memoryMB) and ``POST /templates/{templateID}`` (its rebuild): the v1 CLI's
  flow. E2B's CLI builds the Dockerfile with Docker, pushes the image to E2B's registry
  and then starts the build (``POST /templates/{id}/builds/{buildID}``). aenv runs no
  registry to push to: it maps the Dockerfile onto build steps at the request, with the
  converter ``aenv template build -f`` uses (aenv_api/dockerfile), and the start request
  runs them. What needs the files of the build context (``COPY``/``ADD`` of local paths)
  is refused with a 400 naming the line: the legacy flow sends no context (E2B's has it
  inside the pushed image); the SDK's ``Template.from_dockerfile`` and ``aenv template
  build -f`` upload it. As E2B's v1 builds, the template runs ``startCmd`` of the request,
  not the Dockerfile's ``CMD``/``ENTRYPOINT`` (ignored with a warning in the build log).

A template id is its name here: ``alias`` names the template (``name`` or ``name:tag``);
without one the id is generated, as E2B's (20 characters of ``[a-z0-9]``).
"""
from __future__ import annotations

import re
import secrets
import string
from typing import Any, Callable

from aiohttp import web

from aenv_api.dockerfile import DockerfileError
from aenv_api.dockerfile.convert import BuildPlan, convert
from aenv_api.dockerfile.syntax import parse
from aenv_vm.builds.template_builds import BuildRun, TemplateBuilds
from aenv_vm.errors import VmError
from aenv_wire.builds import BuildResources, BuildSpec, parse_build_spec
from aenv_wire.errors import MalformedBuild
from aenv_wire.listing import iso

from .errors import ApiError
from .lifecycle import api_error
from .principal import principal_of
from .template_access import TemplateAccess, owner_of
from .responses import json_response
from .routes import Call, Reply, Route
from .schemas import Field, Schema
from .templates_api import TEMPLATE_ID_PATH

MAX_DOCKERFILE = 256 << 10       # characters: far above a real Dockerfile, below the 1 MiB body bound
_ID_ALPHABET = string.ascii_lowercase + string.digits
_BUILD_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")

_RESOURCES = (Field("cpuCount", "integer", minimum=1, maximum=64),
              Field("memoryMB", "integer", minimum=128, maximum=1 << 20),
              # one tenant: the caller's team is the deployment's (the teams issue checks it)
              Field("teamID", "string", max_length=128))
DOCKERFILE_REQUEST = Schema("TemplateBuildRequest", (
    Field("dockerfile", "string", required=True, max_length=MAX_DOCKERFILE),
    Field("alias", "string", max_length=128),
    Field("startCmd", "string", max_length=65536), Field("readyCmd", "string", max_length=65536), *_RESOURCES))
V2_REQUEST = Schema("TemplateBuildRequestV2", (Field("alias", "string", required=True, max_length=128),
                                              *_RESOURCES))


def generated_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


def dockerfile_spec(text: str, start_cmd: str | None, ready_cmd: str | None) -> tuple[BuildSpec, list[str]]:
    """The build a v1 request's Dockerfile stands for, and the warnings for its log.
    ApiError 400 naming the line when it cannot be built without a context."""
    try:
        plan: BuildPlan = convert(parse(text))
    except DockerfileError as e:
        raise ApiError(400, f"dockerfile: {e}") from None
    if plan.copies:
        c = plan.copies[0]
        raise ApiError(400, f"dockerfile: Dockerfile line {c.line}: {c.keyword} {c.src} needs the files of the "
                            f"build context, which this request does not carry (E2B's CLI pushes them inside "
                            f"an image built by Docker; aenv runs no registry for it): build with the SDK's "
                            f"Template.from_dockerfile or `aenv template build -f`, which upload the context")
    body = plan.request()
    body.pop("startCmd", None)
    body.pop("readyCmd", None)
    notes = [str(w) for w in plan.warnings]
    if plan.start_cmd:
        notes.append("Dockerfile: CMD/ENTRYPOINT ignored: a v1 template runs the request's startCmd "
                     "(E2B's v1 builds do the same)")
    if start_cmd:
        body["startCmd"] = start_cmd
    if ready_cmd:
        body["readyCmd"] = ready_cmd
    try:
        return parse_build_spec(body), notes
    except MalformedBuild as e:
        raise ApiError(400, f"dockerfile: {e}") from None


class LegacyTemplateApi:
    def __init__(self, builds: TemplateBuilds,
                 admit: Callable[[web.Request, str, str], None] | None = None) -> None:
        """``admit``: counts a build against its team's quota (TemplateApi.admit_build)."""
        self.builds = builds
        self._admit = admit
        self.access = TemplateAccess(builds)

    def _legacy(self, run: BuildRun) -> dict[str, Any]:
        """E2B's ``TemplateLegacy`` of a just-requested build."""
        try:
            view = self.builds.get(run.name)
        except VmError as e:
            raise api_error(e, f"template {run.name!r}") from None
        st = self.builds.settings
        return {"templateID": run.name, "buildID": run.build_id,
                "cpuCount": run.resources.cpu_count or st.vcpus, "memoryMB": run.resources.memory_mb or st.memory_mib,
                # the disk is sized when the build runs (its base plus headroom): the last build's until then
                "diskSizeMB": view.build.disk_mb if view.build else 0,
                "public": view.public, "aliases": list(view.names), "createdAt": iso(view.created),
                "updatedAt": iso(view.updated), "createdBy": None, "lastSpawnedAt": None, "spawnCount": 0,
                "buildCount": len(view.builds), "envdVersion": (view.build.envd_version or "") if view.build else ""}

    async def _request(self, request: web.Request, ref: str, b: dict[str, Any], spec: BuildSpec | None,
                       notes: list[str]) -> web.Response:
        team = principal_of(request).team_id
        if spec is not None and spec.from_template:     # another team's private template: as if none
            self.access.check_read(spec.from_template, team)
        try:
            run = await self.builds.request(ref, None, BuildResources(b["cpuCount"], b["memoryMB"]), spec,
                                            tuple(notes), owner=owner_of(team))
        except VmError as e:
            raise api_error(e, f"template {ref!r}") from None
        return json_response(self._legacy(run), 202)

    async def request_v2(self, request: web.Request, call: Call) -> web.Response:
        alias = call.body["alias"]
        if not alias.strip():
            raise ApiError(400, "alias must be a non-empty string")
        return await self._request(request, alias, call.body, None, [])

    async def request_dockerfile(self, request: web.Request, call: Call) -> web.Response:
        b = call.body
        spec, notes = dockerfile_spec(b["dockerfile"], b["startCmd"], b["readyCmd"])
        return await self._request(request, b["alias"] or generated_id(), b, spec, notes)

    async def rebuild(self, request: web.Request, call: Call) -> web.Response:
        tid, b = call.path["templateID"], call.body
        try:
            self.access.check_own(tid, principal_of(request).team_id)
        except ApiError:
            raise ApiError(404, f"Template '{tid[:128]}' not found") from None
        try:
            if not self.builds.template_exists(tid):
                raise ApiError(404, f"Template '{tid[:128]}' not found")
        except VmError as e:
            raise api_error(e, f"template {tid!r}") from None
        name = tid.split(":", 1)[0].lower()
        if b["alias"] and b["alias"].split(":", 1)[0].lower() != name:
            raise ApiError(400, f"alias {b['alias'][:128]!r} would rename template {name!r}: a template's id is "
                                f"its name here (request a new template with POST /templates)")
        spec, notes = dockerfile_spec(b["dockerfile"], b["startCmd"], b["readyCmd"])
        return await self._request(request, b["alias"] or tid, b, spec, notes)

    async def start(self, request: web.Request, call: Call) -> web.Response:
        tid, bid = call.path["templateID"], call.path["buildID"]
        if not _BUILD_ID.match(bid):
            raise ApiError(400, f"Invalid build ID: {bid[:64]}")
        self.access.check_own(tid, principal_of(request).team_id, self.access.no_build(tid, bid))
        if self._admit is not None:
            self._admit(request, tid, bid)
        try:
            await self.builds.start_requested(tid, bid)
        except VmError as e:
            raise api_error(e, f"build {bid}") from None
        return web.Response(status=202)

    def routes(self) -> list[Route]:
        t = ("templates",)
        legacy = Reply(202, "the build was requested (TemplateLegacy)", None)
        bad = Reply(400, "bad body, a Dockerfile that cannot be built without its context", "Error")
        return [
            Route("POST", "/v2/templates", self.request_v2, "request a template build (deprecated; v2 SDKs)",
                  (legacy, bad), body=V2_REQUEST, body_required=True, tags=t),
            Route("POST", "/templates", self.request_dockerfile,
                  "request a template build from a Dockerfile (deprecated; E2B's v1 CLI)", (legacy, bad),
                  body=DOCKERFILE_REQUEST, body_required=True, tags=t),
            Route("POST", "/templates/{templateID}", self.rebuild, "rebuild a template from a Dockerfile (deprecated)",
                  (legacy, bad, Reply(404, "unknown template", "Error")), body=DOCKERFILE_REQUEST,
                  body_required=True, tags=t, router_path=TEMPLATE_ID_PATH),
            Route("POST", "/templates/{templateID}/builds/{buildID}", self.start,
                  "start a build requested with a Dockerfile (deprecated)",
                  (Reply(202, "the build has started"), Reply(400, "bad build id, not waiting, or requested "
                                                                   "without a Dockerfile", "Error"),
                   Reply(404, "unknown build", "Error")), tags=t),
        ]
