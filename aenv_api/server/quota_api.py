"""The admin's routes for a team's quota (``GET``/``PUT /admin/teams/{teamID}/quota``,
docs/api.md "Quotas"): stored with the team in teams.json (keystore.py), enforced by the
node's ``QuotaGate`` (quotas.py) and, on a fleet node, published to the fleet's Redis
for its gateways (``publish``, set by the node's assembly: aenv_cli/node.py)."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from aiohttp import web

from . import schemas as S
from .errors import ApiError
from .keystore import KeyStore, KeyStoreError
from .quotas import TeamQuota
from .responses import json_response
from .routes import Admin, Call, Reply, Route

log = logging.getLogger(__name__)

Publish = Callable[[str, TeamQuota], Awaitable[None]]


class QuotaApi:
    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self.publish: Publish | None = None     # a fleet node's: the quota into the fleet's Redis

    async def publish_all(self) -> None:
        """Every team's quota set on this node to the fleet (at the agent's start: quotas set
        before the node joined, or while its Redis was away, reach the gateways)."""
        if self.publish is None:
            return
        for team in self.store.teams():
            quota = self.store.quota(team.team_id)
            if not quota.unlimited:
                await self.publish(team.team_id, quota)

    async def get(self, request: web.Request, call: Call) -> web.Response:
        tid = call.path["teamID"]
        try:
            self.store.team(tid)
        except KeyStoreError as e:
            raise ApiError(e.status, str(e)) from None
        return json_response(self.store.quota(tid).wire())

    async def put(self, request: web.Request, call: Call) -> web.Response:
        tid = call.path["teamID"]
        b = call.body
        try:
            quota = TeamQuota.from_wire({w: b[w] for w in TeamQuota.WIRE.values() if b.get(w) is not None})
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        try:
            await asyncio.to_thread(self.store.set_quota, tid, quota)
        except KeyStoreError as e:
            raise ApiError(e.status, str(e)) from None
        if self.publish is not None:
            try:
                await self.publish(tid, quota)
            except Exception as e:  # noqa: BLE001 - stored on the node; the fleet's copy is retried by the admin
                log.warning("team %s: quota stored on this node, not published to the fleet: %s", tid, e)
                raise ApiError(503, f"the quota is stored on this node but the fleet's Redis did not take it "
                                    f"({e}): send it again", retry=True) from None
        return json_response(quota.wire())

    def routes(self) -> list[Route]:
        gone = Reply(404, "no such team", "Error")
        return [
            Route("GET", "/admin/teams/{teamID}/quota", self.get, "a team's quota (null: unlimited)",
                  (Reply(200, "the quota", "TeamQuota"), gone), admin=Admin.ONLY, tags=("admin",)),
            Route("PUT", "/admin/teams/{teamID}/quota", self.put,
                  "set a team's quota, all of it (a field left out or null: unlimited)",
                  (Reply(200, "the quota now", "TeamQuota"), gone,
                   Reply(400, "a value out of range, or a byte quota (not enforced by aenv)", "Error")),
                  body=S.TEAM_QUOTA, body_required=True, admin=Admin.ONLY, tags=("admin",)),
        ]
