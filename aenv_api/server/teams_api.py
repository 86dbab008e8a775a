"""E2B's teams and API keys on one node: who a request is (``authenticate``) and the
routes that manage teams and keys (``/teams``, ``/api-keys``, ``/admin/teams...``).

A request is a ``Principal``: a team's API key (the default team's is the deployment
key), or the node's admin credential (``X-Admin-Token``, auth.py) — on its own for the
admin routes, with ``X-Team-ID`` naming the team for the routes E2B lets an admin use
on a team's behalf (``/api-keys``). The store is keystore.py; what a team owns on the
node (its sandboxes) is recorded by the lifecycle (extras.py ``TEAM_ANNOTATION``) and
enforced by the server (app.py) before any handler runs."""
from __future__ import annotations

import asyncio
import hmac
from typing import Any, Awaitable, Callable

from aiohttp import web

from aenv_wire.api_key import presented_api_key
from aenv_wire.headers import ADMIN_TOKEN_HEADER, API_KEY_HEADER, AUTHORIZATION_HEADER, TEAM_ID_HEADER
from aenv_wire.listing import iso

from . import schemas as S
from .errors import ApiError
from .keystore import KeyStore, KeyStoreError, StoredKey, Team
from .lifecycle import Lifecycle
from .principal import BAD_KEY, Principal, principal_of
from .responses import json_response, no_content
from .routes import Admin, Call, Reply, Route
from .secret_store import SecretStore

def _key_json(k: StoredKey) -> dict[str, Any]:
    return {"id": k.key_id, "name": k.name, "mask": k.mask.wire(), "createdAt": iso(k.created),
            "createdBy": None, "lastUsed": None}


def _team_json(t: Team) -> dict[str, Any]:
    return {"teamID": t.team_id, "name": t.name, "isDefault": t.is_default, "createdAt": iso(t.created)}


async def _store_call(fn: Callable[..., Any], *args: Any) -> Any:
    """A store change (an fsync and a rename) off the event loop; its refusal as an ApiError."""
    try:
        return await asyncio.to_thread(fn, *args)
    except KeyStoreError as e:
        raise ApiError(e.status, str(e)) from None


class TeamsApi:
    def __init__(self, store: KeyStore, admin_token: str, lifecycle: Lifecycle) -> None:
        self.store = store
        self._admin_token = admin_token
        self.lc = lifecycle
        self.secret_store: SecretStore | None = None     # a deleted team's secrets go with it
        # the names of the templates a team owns (the builder's records: in the repository,
        # so a fleet's nodes all see them); None: this server builds no templates
        self.templates_of: Callable[[str], list[str]] | None = None

    # --- who is asking -------------------------------------------------------

    def authenticate(self, request: web.Request, route: Route) -> Principal:
        """The request's Principal for ``route``; ApiError 401 (wrong or missing credential),
        403 (an admin route on a node without an admin credential), 400/404 (X-Team-ID)."""
        h = request.headers
        admin_given = h.getall(ADMIN_TOKEN_HEADER, [])
        if route.admin is Admin.ONLY or (route.admin is Admin.ALSO and admin_given
                                         and API_KEY_HEADER not in h):
            self._check_admin(admin_given)
            if route.admin is Admin.ONLY:
                return Principal("", "", admin=True)
            team = h.get(TEAM_ID_HEADER, "").strip()
            if not team:
                raise ApiError(400, f"an admin call for a team names it in the {TEAM_ID_HEADER} header")
            try:
                self.store.team(team)
            except KeyStoreError as e:
                raise ApiError(e.status, str(e)) from None
            return Principal(team, "", admin=True)
        key = presented_api_key(h.getall(API_KEY_HEADER, []), h.getall(AUTHORIZATION_HEADER, []))
        caller = self.store.verify(key)
        if caller is None or key is None:
            raise ApiError(401, BAD_KEY)
        return Principal(caller.team_id, key)

    def _check_admin(self, given: list[str]) -> None:
        if not self._admin_token:
            raise ApiError(403, "this node has no admin credential: set AENV_ADMIN_TOKEN or "
                                "[server] teams_admin_token_file to manage teams")
        if len(given) != 1 or not hmac.compare_digest(given[0].strip().encode(), self._admin_token.encode()):
            raise ApiError(401, f"Invalid admin token: send the node's admin credential, once, in the "
                                f"{ADMIN_TOKEN_HEADER} header")

    # --- a team's own --------------------------------------------------------

    async def list_teams(self, request: web.Request, call: Call) -> web.Response:
        p = principal_of(request)
        team = self.store.team(p.team_id)
        return json_response([{"teamID": team.team_id, "name": team.name, "apiKey": p.api_key,
                               "isDefault": team.is_default}])

    async def list_keys(self, request: web.Request, call: Call) -> web.Response:
        return json_response([_key_json(k) for k in self.store.keys(principal_of(request).team_id)])

    async def create_key(self, request: web.Request, call: Call) -> web.Response:
        return await self._create_key(principal_of(request).team_id, call.body["name"])

    async def _create_key(self, team_id: str, name: str) -> web.Response:
        stored, key = await _store_call(self.store.create_key, team_id, name)
        return json_response({**_key_json(stored), "key": key}, 201)

    async def rename_key(self, request: web.Request, call: Call) -> web.Response:
        stored = await _store_call(self.store.rename_key, principal_of(request).team_id, call.path["apiKeyID"],
                                   call.body["name"])
        return json_response(_key_json(stored))

    async def delete_key(self, request: web.Request, call: Call) -> web.Response:
        await _store_call(self.store.delete_key, principal_of(request).team_id, call.path["apiKeyID"])
        return no_content()

    # --- admin ---------------------------------------------------------------

    async def admin_list_teams(self, request: web.Request, call: Call) -> web.Response:
        return json_response([{**_team_json(t), "quota": self.store.quota(t.team_id).wire()}
                              for t in self.store.teams()])

    async def admin_create_team(self, request: web.Request, call: Call) -> web.Response:
        return json_response(_team_json(await _store_call(self.store.create_team, call.body["name"])), 201)

    async def admin_delete_team(self, request: web.Request, call: Call) -> web.Response:
        tid = call.path["teamID"]
        await _store_call(self.store.team, tid)
        held = await self.lc.list_views(team=tid)
        if held:
            raise ApiError(409, f"team {tid} still has {len(held)} sandbox(es) on this node "
                                f"(running or paused): kill them first")
        if self.templates_of is not None:
            owned = await asyncio.to_thread(self.templates_of, tid)
            if owned:
                # a team's templates would outlive it, usable by nobody: they go first
                raise ApiError(409, f"team {tid} still owns {len(owned)} template(s) "
                                    f"({', '.join(sorted(owned)[:5])}{', …' if len(owned) > 5 else ''}): "
                                    f"delete them first")
        await _store_call(self.store.delete_team, tid)
        if self.secret_store is not None:
            await asyncio.to_thread(self.secret_store.drop_team, tid)
        return no_content()

    async def admin_list_keys(self, request: web.Request, call: Call) -> web.Response:
        keys = await _store_call(self.store.keys, call.path["teamID"])
        return json_response([_key_json(k) for k in keys])

    async def admin_create_key(self, request: web.Request, call: Call) -> web.Response:
        return await self._create_key(call.path["teamID"], call.body["name"])

    async def admin_delete_key(self, request: web.Request, call: Call) -> web.Response:
        await _store_call(self.store.delete_key, call.path["teamID"], call.path["apiKeyID"])
        return no_content()

    async def admin_kill_sandboxes(self, request: web.Request, call: Call) -> web.Response:
        """E2B's ``AdminSandboxKillResult``: every sandbox of the team on this node, running
        or paused, killed at once; one that went away meanwhile counts in neither."""
        tid = call.path["teamID"]
        await _store_call(self.store.team, tid)
        views = await self.lc.list_views(team=tid)
        results = await asyncio.gather(*(self.lc.kill(v.sandbox_id) for v in views), return_exceptions=True)
        gone = sum(1 for r in results if isinstance(r, ApiError) and r.status == 404)
        failed = sum(1 for r in results if isinstance(r, BaseException)) - gone
        return json_response({"killedCount": len(views) - failed - gone, "failedCount": failed})

    async def create_access_token(self, request: web.Request, call: Call) -> web.Response:
        raise ApiError(410, "access tokens are deprecated in E2B's API and not issued here: use an API key "
                            "(POST /api-keys)")

    async def delete_access_token(self, request: web.Request, call: Call) -> web.Response:
        raise ApiError(404, f"no access token {call.path['accessTokenID']!r}: this server issues none "
                            f"(use API keys: /api-keys)")

    async def admin_running_counts(self, request: web.Request, call: Call) -> web.Response:
        """Every team's running sandboxes on this node (E2B's), and its paused ones (aenv's:
        what the dashboard draws against a team's quotas)."""
        counts: dict[str, tuple[int, int]] = {t.team_id: (0, 0) for t in self.store.teams()}
        counts.update(await self.lc.team_counts())
        return json_response({"teams": [{"teamID": t, "runningSandboxes": r, "pausedSandboxes": p}
                                        for t, (r, p) in counts.items()]})

    def routes(self) -> list[Route]:
        keys = ("api-keys",)
        admin = ("admin",)
        gone_key = Reply(404, "no such API key of the team", "Error")
        gone_team = Reply(404, "no such team", "Error")
        wrap = self._guarded
        return [
            Route("GET", "/teams", wrap(self.list_teams), "the caller's team",
                  (Reply(200, "the team of the API key", "Team[]"),), tags=("auth",)),
            Route("GET", "/api-keys", wrap(self.list_keys), "the team's API keys, masked",
                  (Reply(200, "the keys (never their values)", "TeamAPIKey[]"),), admin=Admin.ALSO, tags=keys),
            Route("POST", "/api-keys", wrap(self.create_key), "create an API key of the team",
                  (Reply(201, "the key, its value shown this once", "CreatedTeamAPIKey"),), body=S.KEY_NAME,
                  body_required=True, admin=Admin.ALSO, tags=keys),
            Route("PATCH", "/api-keys/{apiKeyID}", wrap(self.rename_key), "rename an API key of the team",
                  (Reply(200, "renamed", "TeamAPIKey"), gone_key), body=S.KEY_RENAME, body_required=True,
                  admin=Admin.ALSO, tags=keys),
            Route("DELETE", "/api-keys/{apiKeyID}", wrap(self.delete_key),
                  "delete an API key of the team (it fails from now on)", (Reply(204, "deleted"), gone_key),
                  admin=Admin.ALSO, tags=keys),
            Route("GET", "/admin/teams", wrap(self.admin_list_teams), "every team of the node",
                  (Reply(200, "the teams", "AdminTeam[]"),), admin=Admin.ONLY, tags=admin),
            Route("POST", "/admin/teams", wrap(self.admin_create_team), "create a team",
                  (Reply(201, "the team", "AdminTeam"), Reply(409, "a team of that name exists", "Error")),
                  body=S.NEW_TEAM, body_required=True, admin=Admin.ONLY, tags=admin),
            Route("DELETE", "/admin/teams/{teamID}", wrap(self.admin_delete_team),
                  "delete a team and its API keys",
                  (Reply(204, "deleted"), gone_team, Reply(409, "the default team, or it has sandboxes", "Error")),
                  admin=Admin.ONLY, tags=admin),
            Route("GET", "/admin/teams/{teamID}/api-keys", wrap(self.admin_list_keys), "a team's API keys, masked",
                  (Reply(200, "the keys", "TeamAPIKey[]"), gone_team), admin=Admin.ONLY, tags=admin),
            Route("POST", "/admin/teams/{teamID}/api-keys", wrap(self.admin_create_key),
                  "create an API key of a team",
                  (Reply(201, "the key, its value shown this once", "CreatedTeamAPIKey"), gone_team),
                  body=S.KEY_NAME, body_required=True, admin=Admin.ONLY, tags=admin),
            Route("DELETE", "/admin/teams/{teamID}/api-keys/{apiKeyID}", wrap(self.admin_delete_key),
                  "delete an API key of a team", (Reply(204, "deleted"), gone_key), admin=Admin.ONLY, tags=admin),
            Route("POST", "/admin/teams/{teamID}/sandboxes/kill", wrap(self.admin_kill_sandboxes),
                  "kill every sandbox of a team on this node, running or paused",
                  (Reply(200, "how many were killed and how many failed", None), gone_team),
                  admin=Admin.ONLY, tags=admin),
            Route("POST", "/access-tokens", wrap(self.create_access_token),
                  "E2B's deprecated access tokens: none issued (use an API key)",
                  (Reply(410, "deprecated: use an API key", "Error"),), tags=("access-tokens",)),
            Route("DELETE", "/access-tokens/{accessTokenID}", wrap(self.delete_access_token),
                  "E2B's deprecated access tokens: none exist here",
                  (Reply(404, "no such access token", "Error"),), tags=("access-tokens",)),
            Route("GET", "/admin/sandboxes/running-counts", wrap(self.admin_running_counts),
                  "running (and paused) sandboxes of each team on this node",
                  (Reply(200, "counts by team", None),), admin=Admin.ONLY, tags=admin),
        ]

    @staticmethod
    def _guarded(fn: Callable[[web.Request, Call], Awaitable[web.Response]]
                 ) -> Callable[[web.Request, Call], Awaitable[web.StreamResponse]]:
        """``fn`` with the store's refusals (unknown team or key) as ApiErrors."""
        async def handler(request: web.Request, call: Call) -> web.StreamResponse:
            try:
                return await fn(request, call)
            except KeyStoreError as e:
                raise ApiError(e.status, str(e)) from None
        return handler
