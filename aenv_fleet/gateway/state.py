"""What a gateway knows of the fleet, from Redis, kept fresh by a background loop:
the node table (a second old at most), the API keys (team_auth.py), and a short-lived cache
of sandbox -> node routes for the proxy's hot path (dropped early when the fleet's
event stream says the sandbox changed). It is a cache of Redis, never a
source of truth: any gateway can die or start at any time."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable

from ..coord import Binding, CoordError, Coordinator, NodeRecord
from ..trust import RedisTrustError
from .team_auth import TeamKeys, UnusableTeams

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0
ROUTE_TTL = 1.0


def trusted_view(before: dict[str, NodeRecord], now: list[NodeRecord]) -> dict[str, NodeRecord]:
    """The node table from Redis' records, where a record without the node's signature
    (someone else wrote it) counts for nothing: the node's last signed record stays, with
    the lease it signed, until the node signs again; a node never seen signed is left out.
    So a forged URL redirects no traffic, and a forged record cannot make a live node
    look dead before its signed lease runs out."""
    out: dict[str, NodeRecord] = {}
    for n in now:
        if n.trusted:
            out[n.node_id] = n
        elif n.node_id in before:
            out[n.node_id] = before[n.node_id]
    return out


class FleetView:
    def __init__(self, coord: Coordinator, verify: Callable[[], Awaitable[bool]] | None = None) -> None:
        """``verify``: refuses (raises) a Redis that takes anonymous commands; False while
        Redis cannot be reached. Nothing is read from Redis before it said True."""
        self.coord = coord
        self._verify = verify
        self._verified = verify is None
        self.refused: str = ""      # why this gateway's Redis was refused ("" = it was not)
        self.nodes: dict[str, NodeRecord] = {}
        self.team_keys = TeamKeys(coord)     # who a request's API key is (team_auth.py)
        self._teams_refused = ""             # why the teams document was last refused (logged once)
        self._routes: dict[str, tuple[float, Binding]] = {}
        self._task: asyncio.Task | None = None
        self._last_event = "$"
        self.redis_ok = False
        self._last_ok = 0.0     # when the nodes' leases were last read: they are judged as of then (_now)
        self._reread: asyncio.Future[None] | None = None    # alive_now's read of the leases, in flight

    async def start(self) -> None:
        with contextlib.suppress(CoordError, RedisTrustError):
            await self.refresh()
        self._task = asyncio.ensure_future(self._loop())

    @property
    def verified(self) -> bool:
        """Redis was checked to refuse anonymous commands (or the fleet is a development one)."""
        return self._verified

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.refresh()
            except CoordError as e:
                if self.redis_ok:
                    log.warning("gateway: redis unreachable: %s", e)
                self.redis_ok = False
            except RedisTrustError as e:
                if not self.refused:
                    log.error("gateway: %s", e)
                self.refused = str(e)
                self.redis_ok = False
            except Exception:
                log.exception("gateway: refresh failed")

    async def refresh(self) -> None:
        if not self._verified:
            assert self._verify is not None
            if not await self._verify():
                raise CoordError(f"redis {self.coord.url}: not reachable to check its authentication")
            self._verified = True
        await self.coord.expire_nodes()     # any gateway may notice an expiry first; the script is idempotent
        read_at = time.time()
        self.nodes = trusted_view(self.nodes, await self.coord.nodes())
        self._last_ok = read_at
        try:
            await self.team_keys.refresh()
        except UnusableTeams as e:     # Redis is fine: only team keys suffer (refused after STALE_AFTER)
            if str(e) != self._teams_refused:
                log.error("gateway: %s", e)
            self._teams_refused = str(e)
        else:
            self._teams_refused = ""
        self.redis_ok = True
        now = time.monotonic()
        self._routes = {k: v for k, v in self._routes.items() if v[0] > now}
        # a sandbox that moved, paused or went since: its cached route goes at once
        for eid, ev in await self.coord.events_since(self._last_event):
            self._last_event = eid
            if ev.get("type", "").startswith("sandbox-"):
                self._routes.pop(ev.get("id", ""), None)

    def _now(self) -> float:
        """Leases are judged as of the last read of them: a lease that ended before it is
        over; one that ends after it may have been renewed since, which this gateway
        learns at its next refresh (a second later). So a gateway whose refreshes run late
        (its loop busy, Redis slow to answer) never takes a live node for a dead one and
        a running sandbox for a lost one; nor does a Redis outage, during which nodes
        cannot heartbeat either, make every node look dead to the proxy."""
        return self._last_ok

    def alive(self) -> list[NodeRecord]:
        now = self._now()
        return [n for n in self.nodes.values() if n.lease_deadline >= now]

    def is_alive(self, node_id: str) -> bool:
        n = self.nodes.get(node_id)
        return n is not None and n.lease_deadline >= self._now()

    async def alive_now(self, node_id: str) -> bool:
        """Whether ``node_id`` is alive, its lease read again when this gateway's view says
        it is not: before a sandbox is answered as unreachable or lost, or a connect goes
        another way. A node back from a stall renews before it answers anything, and this
        view may be up to a refresh behind that (or its last read may have straddled the
        renewal)."""
        if self.is_alive(node_id):
            return True
        # requests for a dead node's sandboxes share one read: at most one in flight
        if self._reread is None or self._reread.done():
            self._reread = asyncio.ensure_future(self.refresh())
        with contextlib.suppress(CoordError, RedisTrustError):
            await asyncio.shield(self._reread)
        return self.is_alive(node_id)

    def url(self, node_id: str) -> str:
        n = self.nodes.get(node_id)
        return n.url if n is not None else ""

    async def team_of(self, presented: str | None) -> str | None:
        """The team of the API key ``presented``, None when it is no key of the fleet."""
        return await self.team_keys.team_of(presented)

    async def binding(self, sandbox_id: str, cached: bool = False) -> Binding | None:
        if cached:
            hit = self._routes.get(sandbox_id)
            if hit is not None and hit[0] > time.monotonic():
                return hit[1]
        b = await self.coord.binding(sandbox_id)
        if b is not None:
            self._routes[sandbox_id] = (time.monotonic() + ROUTE_TTL, b)
        else:
            self._routes.pop(sandbox_id, None)
        return b

    def forget(self, sandbox_id: str) -> None:
        self._routes.pop(sandbox_id, None)
