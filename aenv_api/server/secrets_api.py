"""E2B's ``/secrets`` routes over the node's secret store (secret_store.py), scoped to
the caller's team: a team key sees and changes its own team's secrets only (another
team's answers 404, as an unknown one); the admin acts for the team ``X-Team-ID``
names. No answer ever carries a value.

Without the deployment's secrets key every route answers 503 saying how to set it. A
fleet node keeps them in the fleet's Redis (secret_store.py, shared); one assembled
without that document answers 501 rather than keep a fleet's secrets on itself alone."""
from __future__ import annotations

import asyncio
import base64
from typing import Any, Callable

from aiohttp import web

from aenv_wire.headers import NEXT_TOKEN_HEADER
from aenv_wire.listing import iso

from . import schemas as S
from .errors import ApiError
from .principal import principal_of
from .responses import json_response, no_content
from .routes import Admin, Call, Reply, Route
from .secret_store import CONFIGURE, Secret, SecretError, SecretStore

FLEET_REFUSAL = ("secrets are not served by this fleet node: it was started without the fleet's secrets "
                 "document, and a fleet's secrets are not kept on one node alone")


def secret_json(s: Secret) -> dict[str, Any]:
    """E2B's ``Secret``: metadata only."""
    return {"secretID": s.secret_id, "name": s.name, "currentVersion": s.current, "metadata": dict(s.metadata),
            "createdAt": iso(s.created), "updatedAt": iso(s.updated)}


def _token(secret_id: str) -> str:
    return base64.urlsafe_b64encode(secret_id.encode()).decode().rstrip("=")


def _after(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "nextToken is not a token this server issued") from None


class SecretsApi:
    """``store`` None: no secrets key configured (503); ``fleet``: a fleet node without the
    fleet's secrets document (501)."""

    def __init__(self, store: SecretStore | None, fleet: bool = False) -> None:
        self.store = store
        self.fleet = fleet

    def _store(self) -> SecretStore:
        if self.fleet:
            raise ApiError(501, FLEET_REFUSAL, retry=False)
        if self.store is None:
            raise ApiError(503, f"this node keeps no secrets: {CONFIGURE}", retry=False)
        return self.store

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except SecretError as e:
            raise ApiError(e.status, str(e), retry=False) from None

    async def list_secrets(self, request: web.Request, call: Call) -> web.Response:
        store = self._store()
        items = store.list(principal_of(request).team_id)
        limit = call.query.get("limit") or 100
        token = call.query.get("next_token")
        if token:
            after = _after(token)
            ids = [s.secret_id for s in items]
            if after not in ids:
                raise ApiError(400, "nextToken names no secret of the team (deleted meanwhile?)")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        headers = {NEXT_TOKEN_HEADER: _token(page[-1].secret_id)} if len(items) > limit else None
        return json_response([secret_json(s) for s in page], headers=headers)

    async def create(self, request: web.Request, call: Call) -> web.Response:
        store = self._store()
        b = call.body
        made = await self._call(store.create, principal_of(request).team_id, b["name"], b["value"], b["metadata"])
        return json_response(secret_json(made), 201)

    async def get(self, request: web.Request, call: Call) -> web.Response:
        store = self._store()
        return json_response(secret_json(await self._call(store.get, principal_of(request).team_id,
                                                          call.path["secretID"])))

    async def update(self, request: web.Request, call: Call) -> web.Response:
        store = self._store()
        b = call.body
        new = await self._call(store.update, principal_of(request).team_id, call.path["secretID"], b["value"],
                               b["metadata"])
        return json_response(secret_json(new))

    async def delete(self, request: web.Request, call: Call) -> web.Response:
        store = self._store()
        await self._call(store.delete, principal_of(request).team_id, call.path["secretID"])
        return no_content()

    def routes(self) -> list[Route]:
        tags = ("secrets",)
        gone = Reply(404, "no such secret of the team", "Error")
        off = Reply(503, "the node has no secrets key configured", "Error")
        return [
            Route("GET", "/secrets", self.list_secrets, "the team's secrets (never their values)",
                  (Reply(200, "a page of secrets; the next page's token in X-Next-Token", "Secret[]",
                         ("X-Next-Token",)), off), query=S.SECRET_LIST, admin=Admin.ALSO, tags=tags),
            Route("POST", "/secrets", self.create, "create a secret (its value is its first version)",
                  (Reply(201, "the secret's metadata", "Secret"), Reply(409, "a secret of that name exists", "Error"),
                   off), body=S.NEW_SECRET, body_required=True, admin=Admin.ALSO, tags=tags),
            Route("GET", "/secrets/{secretID}", self.get, "one secret's metadata, by id or name",
                  (Reply(200, "the secret's metadata", "Secret"), gone, off), admin=Admin.ALSO, tags=tags),
            Route("POST", "/secrets/{secretID}", self.update, "a new version of a secret's value",
                  (Reply(200, "the secret's metadata", "Secret"), gone, off), body=S.SECRET_UPDATE,
                  body_required=True, admin=Admin.ALSO, tags=tags),
            Route("DELETE", "/secrets/{secretID}", self.delete, "delete a secret and all its versions",
                  (Reply(204, "deleted"), gone, off), admin=Admin.ALSO, tags=tags),
        ]
