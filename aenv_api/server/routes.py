"""Typed route definitions and the OpenAPI document generated from them.

A ``Route`` says everything the server needs (method, path, handler, body
and query schemas, auth) and everything a client needs (summary, answers).
``openapi(routes)`` renders them: ``GET /openapi.json`` serves exactly the
table the server dispatches on."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

from aenv_wire.fleet_auth import NODE_AUTH_HEADER

from .schemas import RESPONSE_SCHEMAS, Schema

Handler = Callable[[web.Request, "Call"], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Call:
    """What a handler gets besides the request: parsed path, body and query values."""

    path: dict[str, str]
    body: dict[str, Any]
    query: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    """One documented answer: status, description, and the body's schema (component name,
    ``Name[]`` for a list of them, or None for no body)."""

    status: int
    description: str
    schema: str | None = None
    headers: tuple[str, ...] = ()


class Admin(enum.Enum):
    """Whether a route takes the node's admin credential (``X-Admin-Token``, auth.py)."""

    NO = "no"           # a team's API key only
    ALSO = "also"       # a team's API key, or the admin credential with X-Team-ID naming the team
    ONLY = "only"       # the admin credential only (team management)


@dataclass(frozen=True)
class Route:
    method: str
    path: str                          # OpenAPI form: /sandboxes/{sandboxID}
    handler: Handler
    summary: str
    replies: tuple[Reply, ...]
    body: Schema | None = None
    body_required: bool = False
    query: Schema | None = None
    auth: bool = True
    admin: Admin = Admin.NO
    # the node's own routes (/nodes, /metrics, the fleet's adopt/release): the deployment key
    # (the default team's) only, as before teams; another team's key is 403
    deployment: bool = False
    # the fleet's node credential instead (aenv_wire/fleet_auth.py): routes only gateways and
    # peer nodes call; an API key is refused
    node_auth: bool = False
    tags: tuple[str, ...] = ()
    content_type: str = "application/json"   # of the success body
    extra: dict[str, Any] = field(default_factory=dict)
    router_path: str = ""              # aiohttp's form when it needs a constraint ({id:regex}); "" = path

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"{(\w+)}", self.path)

    @property
    def operation_id(self) -> str:
        parts = [p for p in re.split(r"[/{}]+", self.path) if p]
        return self.method.lower() + "".join(p[:1].upper() + p[1:] for p in parts)


def _content(schema: str | None, content_type: str = "application/json") -> dict[str, Any]:
    if schema is None:
        return {}
    if schema.endswith("[]"):
        body: dict[str, Any] = {"type": "array", "items": {"$ref": f"#/components/schemas/{schema[:-2]}"}}
    elif schema == "text":
        return {"content": {content_type: {"schema": {"type": "string"}}}}
    else:
        body = {"$ref": f"#/components/schemas/{schema}"}
    return {"content": {content_type: {"schema": body}}}


def openapi(routes: list[Route], version: str, server_url: str | None = None) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    components: dict[str, Any] = {s.name: s.json_schema() for s in RESPONSE_SCHEMAS}
    for r in routes:
        op: dict[str, Any] = {"operationId": r.operation_id, "summary": r.summary}
        if r.tags:
            op["tags"] = list(r.tags)
        params: list[dict[str, Any]] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in r.path_params]
        if r.query is not None:
            from .schemas import field_schema

            for f in r.query.fields:
                param = {"name": f.name, "in": "query", "required": f.required, "schema": field_schema(f)}
                if f.kind == "states":
                    param.update(style="form", explode=False)
                params.append(param)
        if params:
            op["parameters"] = params
        if r.body is not None:
            components.update(r.body.components())
            op["requestBody"] = {"required": r.body_required,
                                 "content": {"application/json": {"schema": {
                                     "$ref": f"#/components/schemas/{r.body.name}"}}}}
        responses: dict[str, Any] = {}
        for reply in r.replies:
            ctype = r.content_type if 200 <= reply.status < 300 else "application/json"
            entry: dict[str, Any] = {"description": reply.description, **_content(reply.schema, ctype)}
            if reply.headers:
                entry["headers"] = {h: {"schema": {"type": "string"}} for h in reply.headers}
            responses[str(reply.status)] = entry
        # Every failure is E2B's Error shape: 400 bad input, 401 key, 404 unknown id,
        # 409 state conflict, 429 node full, 500/501/503 server side.
        responses["default"] = {"description": "error", **_content("Error")}
        op["responses"] = responses
        op["security"] = ([{"FleetNodeAuth": []}] if r.node_auth else [] if not r.auth else
                          [{"AdminApiKeyAuth": []}] if r.admin is Admin.ONLY else
                          [{"ApiKeyAuth": []}, {"AdminApiKeyAuth": [], "AdminTeamAuth": []}]
                          if r.admin is Admin.ALSO else [{"ApiKeyAuth": []}])
        paths.setdefault(r.path, {})[r.method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "aenv E2B-compatible API", "version": version,
                 "description": "Control plane of one aenv node. Sandbox traffic (envd and other ports) is "
                                "proxied on the same port by the E2b-Sandbox-Id / E2b-Sandbox-Port headers "
                                "or <port>-<sandboxID>.<domain> hosts; it is not described here."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {
                           "ApiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
                           "AdminApiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-Admin-Token"},
                           "AdminTeamAuth": {"type": "apiKey", "in": "header", "name": "X-Team-ID"},
                           "FleetNodeAuth": {"type": "apiKey", "in": "header", "name": NODE_AUTH_HEADER,
                                             "description": "a fleet's gateways and nodes only: derived "
                                                            "from the fleet secret per request "
                                                            "(docs/security.md)"}}},
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc
