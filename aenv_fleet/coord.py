"""The fleet's state in Redis, as typed calls: node registry and leases, capacity,
bindings, API key digests, reservations, events (keys.py lists the keys, scripts.py
the atomic updates). Used by the node agent and the gateway alike; which of them
writes what is docs/cluster.md's "Who writes a binding"."""
from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from aenv_wire.fleet_auth import FleetKeys

from . import keys, scripts
from .trust import RedisAuth, without_credentials

log = logging.getLogger(__name__)


class CoordError(Exception):
    """Redis could not be reached or answered an error."""


@dataclass(frozen=True)
class VolumeRoom:
    """Whether a volume was recorded under its team's volumeBytes quota; if not, the bytes
    the team's other volumes hold (-1: one of them is unbounded) and the quota."""

    recorded: bool
    held: int = 0
    limit: int = 0


class TeamQuotaExceeded(Exception):
    """A team's quota leaves no room for a start (scripts.py ``team_room``): ``kind`` is
    "running" (``limit`` sandboxes run already) or "rate" (``limit`` creates a second; the
    next token in ``wait`` seconds); or for a pause (``TEAM_PAUSE``): "paused" (``limit``
    sandboxes are paused already)."""

    def __init__(self, kind: str, limit: float, wait: float = 0.0) -> None:
        super().__init__(f"team quota: {kind} {limit:g}")
        self.kind = kind
        self.limit = limit
        self.wait = wait

    @classmethod
    def parse(cls, why: str) -> "TeamQuotaExceeded":
        parts = why.split()
        try:
            if parts[0] == "rate":
                return cls("rate", float(parts[1]), float(parts[2]) / 1000)
            return cls("running", float(parts[1]))
        except (IndexError, ValueError):
            raise CoordError(f"a team quota refusal Redis answered is not one: {why!r:.100}") from None


@dataclass(frozen=True)
class TeamGrant:
    """What ``Coordinator.team_reserve`` got: ``granted`` starts under ``rid`` (members
    ``rid:1``..), and why not more (None: all asked for)."""

    rid: str
    granted: int
    refusal: TeamQuotaExceeded | None

    def member(self, i: int) -> str:
        """The reservation of the i-th start (0-based) granted."""
        return f"{self.rid}:{i + 1}"


def now_ms() -> int:
    return int(time.time() * 1000)


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    url: str
    state: str                  # up | expired | stopped (as last written)
    alive: bool                 # lease deadline not passed
    lease_deadline: float       # unix seconds
    drained: bool
    free_slots: int | None      # None: not placeable (drained, expired, stopped)
    max_sandboxes: int
    running: int
    paused: int
    vcpus: int
    mem_total_mib: int
    mem_avail_mib: int
    disk_free_mib: int
    sandbox_mem_mib: int
    heartbeat_at: float
    templates: tuple[str, ...] = ()
    p2p_ticket: str = ""        # the node's P2P endpoint ticket ("" = P2P off); only meant while alive
    restore_slots: int = 0      # restores the node runs at once (0: not reported)
    restoring: int = 0          # restores running or queued there at its last heartbeat
    # the record's signature (fleet secret) is good: its url, ticket and lease are the node's own.
    # An untrusted record says nothing (no url, no ticket, not alive): someone else wrote it.
    trusted: bool = True

    def view(self) -> dict[str, Any]:
        return {"nodeID": self.node_id, "url": self.url, "state": "up" if self.alive else self.state,
                "alive": self.alive, "drained": self.drained, "freeSlots": self.free_slots,
                "maxSandboxes": self.max_sandboxes, "running": self.running, "paused": self.paused,
                "vcpus": self.vcpus, "memTotalMiB": self.mem_total_mib, "memAvailableMiB": self.mem_avail_mib,
                "diskFreeMiB": self.disk_free_mib, "sandboxMemoryMiB": self.sandbox_mem_mib,
                "leaseDeadline": self.lease_deadline, "heartbeatAt": self.heartbeat_at,
                "templates": list(self.templates), "p2pTicket": self.p2p_ticket,
                "restoreSlots": self.restore_slots, "restoring": self.restoring}


@dataclass(frozen=True)
class Capacity:
    """What a node reports at every heartbeat."""
    url: str
    max_sandboxes: int
    vcpus: int
    mem_total_mib: int
    mem_avail_mib: int
    disk_free_mib: int
    sandbox_mem_mib: int
    running: int
    paused: int
    version: str = ""
    p2p: str = ""               # this node's P2P endpoint ticket, "" = P2P off
    restore_slots: int = 0      # its restore gate's slots (aenv_vm/machine/admission.py); 0: unknown
    restoring: int = 0          # restores holding a slot or queued for one, now

    def signed(self, lease_until_ms: int) -> dict[str, str]:
        """The record's fields the node signs: all it reports, and its lease's end."""
        out = {k: str(getattr(self, k)) for k in CAPACITY_FIELDS}
        out[LEASE_FIELD] = str(lease_until_ms)
        return out


CAPACITY_FIELDS = ("url", "vcpus", "mem_total_mib", "mem_avail_mib", "disk_free_mib", "sandbox_mem_mib",
                   "running", "paused", "version", "p2p", "restore_slots", "restoring")
LEASE_FIELD = "lease_until"     # unix ms: the lease the node signed (the aenv:nodes score can only shorten it)
SIGNED_FIELDS = CAPACITY_FIELDS + (LEASE_FIELD,)
REC_FIELD = "rec"               # the signed fields as JSON: what gateways and peers read
SIG_FIELD = "sig"               # HMAC of them (aenv_wire/fleet_auth.py FleetKeys.record_mac)


@dataclass(frozen=True)
class Binding:
    sandbox_id: str
    node_id: str                # "" = released: paused in the repository, on no node
    state: str                  # running | paused | lost
    info: dict[str, Any] = field(default_factory=dict)   # the sandbox's record (agent.info_record)
    note: str = ""
    paused_at: float | None = None   # last pause this fleet saw committed (unix seconds)
    updated: float = 0.0


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return default


class Coordinator:
    """One Redis connection pool and the fleet's scripts on it. ``fleet_keys`` sign this
    node's record (``heartbeat``) and check every node's (``nodes``)."""

    def __init__(self, url: str, fleet_keys: FleetKeys, auth: RedisAuth = RedisAuth(),
                 client: aioredis.Redis | None = None) -> None:
        self.url = without_credentials(url)     # for messages: no password in a log line
        self.fleet_keys = fleet_keys
        self.redis = client or aioredis.from_url(url, decode_responses=True, socket_timeout=10,
                                                 socket_connect_timeout=5, health_check_interval=10,
                                                 **auth.client_kwargs())
        self._forged: dict[str, str] = {}       # node id -> the bad signature last logged
        self._scripts = {name: self.redis.register_script(getattr(scripts, name))
                         for name in ("HEARTBEAT", "STOP", "EXPIRE", "PLACE", "UNRESERVE", "BIND", "UNBIND",
                                      "RELEASE", "LOST", "DRAIN", "TEAM_RESERVE", "TEAM_SETTLE",
                                      "TEAM_UNRESERVE", "TEAM_PAUSE", "TEAM_PAUSED", "VOLUME_ADD",
                                      "VOLUME_DROP")}

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, name: str, *args: Any) -> Any:
        try:
            return await self._scripts[name](args=[str(a) for a in args])
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def ping(self) -> None:
        try:
            await self.redis.ping()
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    # --- API keys ------------------------------------------------------------------------

    async def add_api_key(self, api_key: str) -> None:
        try:
            await self.redis.sadd(keys.APIKEYS, key_digest(api_key))
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def api_key_digests(self) -> set[str]:
        try:
            return set(await self.redis.smembers(keys.APIKEYS))
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    # --- nodes ---------------------------------------------------------------------------

    async def heartbeat(self, node_id: str, cap: Capacity, lease_seconds: float) -> int:
        """Renew the lease with ``cap``. The hash's plain fields are for the placement
        script; what gateways and peers use is the signed copy (``rec``, ``sig``)."""
        now, lease_ms = now_ms(), int(lease_seconds * 1000)
        signed = cap.signed(now + lease_ms)
        rec = json.dumps(signed, sort_keys=True, separators=(",", ":"))
        fields = [x for k, v in signed.items() for x in (k, v)]
        fields += [REC_FIELD, rec, SIG_FIELD, self.fleet_keys.record_mac(node_id, signed)]
        return int(await self._run("HEARTBEAT", node_id, now, lease_ms, cap.max_sandboxes, *fields))

    async def stop_node(self, node_id: str) -> None:
        await self._run("STOP", node_id)

    async def expire_nodes(self) -> list[str]:
        return list(await self._run("EXPIRE", now_ms()))

    async def set_drained(self, node_id: str, drained: bool) -> bool:
        return int(await self._run("DRAIN", node_id, "1" if drained else "0", now_ms())) == 1

    async def add_templates(self, node_id: str, templates: list[str]) -> None:
        templates = [t for t in templates if t]
        if not templates:
            return
        try:
            async with self.redis.pipeline(transaction=True) as p:
                p.sadd(keys.node_templates(node_id), *templates)
                for t in templates:
                    p.sadd(keys.template_nodes(t), node_id)
                await p.execute()
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def nodes(self) -> list[NodeRecord]:
        try:
            leases = await self.redis.zrange(keys.NODES, 0, -1, withscores=True)
            free = dict(await self.redis.zrange(keys.FREE, 0, -1, withscores=True))
            async with self.redis.pipeline(transaction=False) as p:
                for nid, _ in leases:
                    p.hgetall(keys.node(nid))
                    p.smembers(keys.node_templates(nid))
                got = await p.execute()
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None
        now = time.time()
        out = []
        for i, (nid, deadline) in enumerate(leases):
            h, tpls = got[2 * i], got[2 * i + 1]
            rec = self._signed_record(nid, h)
            # a lease is the node's own: the score in aenv:nodes may end it early, never extend it
            if rec is not None:
                deadline = min(deadline, _int(rec.get(LEASE_FIELD)))
            else:
                deadline = 0
            v = rec if rec is not None else {}      # an unsigned record says nothing of the node
            out.append(NodeRecord(
                node_id=nid, url=v.get("url", ""), state=h.get("state", "?"),
                alive=rec is not None and deadline / 1000 >= now, trusted=rec is not None,
                lease_deadline=deadline / 1000, drained=h.get("drained") == "1",
                free_slots=int(free[nid]) if nid in free else None, max_sandboxes=_int(h.get("max_sandboxes")),
                running=_int(v.get("running")), paused=_int(v.get("paused")), vcpus=_int(v.get("vcpus")),
                mem_total_mib=_int(v.get("mem_total_mib")), mem_avail_mib=_int(v.get("mem_avail_mib")),
                disk_free_mib=_int(v.get("disk_free_mib")), sandbox_mem_mib=_int(v.get("sandbox_mem_mib")),
                heartbeat_at=_int(h.get("heartbeat_at")) / 1000, templates=tuple(sorted(tpls)),
                p2p_ticket=v.get("p2p", ""), restore_slots=_int(v.get("restore_slots")),
                restoring=_int(v.get("restoring"))))
        return out

    def _signed_record(self, node_id: str, h: dict[str, str]) -> dict[str, str] | None:
        """The node's own record: its signed copy (``rec``) when the fleet secret's
        signature over it is good, else None. Each forgery is logged once."""
        raw, sig = h.get(REC_FIELD, ""), h.get(SIG_FIELD, "")
        rec: dict[str, str] | None = None
        try:
            got = json.loads(raw) if raw else None
        except ValueError:
            got = None
        if (isinstance(got, dict) and set(got) == set(SIGNED_FIELDS) and all(isinstance(x, str) for x in got.values())
                and self.fleet_keys.record_ok(node_id, got, sig)):
            rec = got
        # what a stranger may have written: a bad signed copy, or plain fields that are not the signed ones
        forged = rec is None or h.get("url", "") != rec["url"] or h.get("p2p", "") != rec["p2p"]
        if not forged:
            self._forged.pop(node_id, None)
        elif self._forged.get(node_id) != raw + sig + h.get("url", ""):
            self._forged[node_id] = raw + sig + h.get("url", "")
            log.warning("fleet: the record of node %r in Redis is %s (url %r): ignored; someone without the fleet "
                        "secret wrote it, or the node runs with another secret", node_id,
                        "not signed with the fleet secret" if rec is None else "not what the node signed",
                        h.get("url", "")[:200])
        return rec

    # --- placement -----------------------------------------------------------------------

    async def place(self, template: str, memory_mib: int, exclude: tuple[str, ...] = (), ttl: float = 900.0,
                    candidates: int = 16, team: str = "") -> tuple[str, str] | None:
        """Reserve a slot: ``(node, reservation id)``, or None when no node has room.
        ``team``: a create of that team, whose quota is checked and its start reserved in
        the same step (member ``<rid>:1``, settled by ``team_settle`` or dropped by
        ``team_unreserve``); TeamQuotaExceeded when its quota leaves no room."""
        rid = secrets.token_hex(8)
        node = await self._run("PLACE", now_ms(), template, rid, int(ttl * 1000), memory_mib, candidates,
                               ",".join(exclude), team)
        if isinstance(node, str) and node.startswith("!"):
            raise TeamQuotaExceeded.parse(node[1:])
        return (node, rid) if node else None

    # --- volumes (gateway/volumes.py) ------------------------------------------------------

    async def add_volume(self, team: str, volume_id: str, node: str, name: str, max_bytes: int) -> VolumeRoom:
        """Record a volume a node made, if ``team``'s volumeBytes quota has room for its
        bound ``max_bytes`` (0: unbounded) beside its other volumes' (scripts.py VOLUME_ADD)."""
        got = await self._run("VOLUME_ADD", team, volume_id, node, name, max_bytes)
        if int(got[0]) == 1:
            return VolumeRoom(True)
        return VolumeRoom(False, int(got[1]), int(got[2]))

    async def drop_volume(self, volume_id: str) -> bool:
        """Forget a volume (its record, its name, its place in its team's bytes)."""
        return int(await self._run("VOLUME_DROP", volume_id)) == 1

    # --- team quotas (scripts.py "Team quotas") --------------------------------------------

    async def set_team_quota(self, team: str, quota: dict[str, float | int | None]) -> None:
        """The team's quota as the gateways read it (wire names; None: unlimited)."""
        k = keys.team_quota(team)
        values = {name: str(v) for name, v in quota.items() if v is not None}
        try:
            async with self.redis.pipeline(transaction=True) as p:
                p.delete(k)
                if values:
                    p.hset(k, mapping=values)
                await p.execute()
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def team_reserve(self, team: str, n: int, create: bool, ttl: float = 900.0) -> TeamGrant:
        """Reserve up to ``n`` starts of ``team`` (partly, as its quota allows)."""
        rid = secrets.token_hex(8)
        k, why = await self._run("TEAM_RESERVE", team, n, rid, now_ms(), int(ttl * 1000), "1" if create else "0")
        return TeamGrant(rid, int(k), TeamQuotaExceeded.parse(why) if why else None)

    async def team_settle(self, team: str, member: str, sandbox_id: str) -> None:
        """The start reserved as ``member`` made ``sandbox_id``: counted for ``team`` from now on."""
        await self._run("TEAM_SETTLE", team, member, sandbox_id)

    async def team_unreserve(self, team: str, rid: str, n: int = 1) -> None:
        """Drop the starts reserved under ``rid`` that were not settled (settled ones are gone already)."""
        await self._run("TEAM_UNRESERVE", team, rid, n)

    async def team_pause(self, team: str, ttl: float = 300.0) -> str | None:
        """Reserve a pause of ``team``'s (scripts.py TEAM_PAUSE): the reservation's id, to
        give ``team_paused`` once the pause was answered (None: the team has no paused
        quota, nothing reserved). TeamQuotaExceeded ("paused") when the team's paused
        sandboxes and pauses in flight are at its quota."""
        rid = secrets.token_hex(8)
        got = await self._run("TEAM_PAUSE", team, rid, now_ms(), int(ttl * 1000))
        if int(got[0]) == 0:
            raise TeamQuotaExceeded("paused", float(got[1]))
        return rid if int(got[0]) == 1 else None

    async def team_paused(self, team: str, rid: str) -> None:
        await self._run("TEAM_PAUSED", team, rid)

    async def team_paused_ids(self, team: str) -> set[str]:
        try:
            return set(await cast(Awaitable[set[str]], self.redis.smembers(keys.team_paused(team))))
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def team_running(self, team: str) -> set[str]:
        try:
            # redis-py types the call for its sync and async clients at once: this client's is awaitable
            return set(await cast(Awaitable[set[str]], self.redis.smembers(keys.team_running(team))))
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def free_slots(self, node_id: str) -> int | None:
        """The node's free slots now (None: not placeable, e.g. drained or expired)."""
        try:
            score = await self.redis.zscore(keys.FREE, node_id)
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None
        return None if score is None else int(score)

    async def unreserve(self, node_id: str, rid: str) -> None:
        await self._run("UNRESERVE", node_id, rid)

    # --- idempotent creates --------------------------------------------------------------

    async def claim_idempotency(self, key: str, ttl: int = 86400) -> str | None:
        """None: this caller is the first with ``key`` (it is now "pending"); else the
        node the first create went to, or "pending" while it runs."""
        k = keys.idempotency(key_digest(key))
        try:
            if await self.redis.set(k, "pending", nx=True, ex=ttl):
                return None
            return await self.redis.get(k) or "pending"
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def settle_idempotency(self, key: str, node_id: str | None, ttl: int = 86400) -> None:
        """The create of ``key`` went to ``node_id`` (None: it failed; the key is free again)."""
        k = keys.idempotency(key_digest(key))
        try:
            if node_id is None:
                await self.redis.delete(k)
            else:
                await self.redis.set(k, node_id, ex=ttl)
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    # --- bindings ------------------------------------------------------------------------

    async def bind(self, sandbox_id: str, node_id: str, state: str, info: dict[str, Any],
                   paused_at: float | None = None, note: str = "") -> None:
        await self._run("BIND", sandbox_id, node_id, state, json.dumps(info, sort_keys=True), now_ms(),
                        "" if paused_at is None else repr(paused_at), note)

    async def unbind(self, sandbox_id: str, node_id: str = "") -> bool:
        return int(await self._run("UNBIND", sandbox_id, node_id)) == 1

    async def release(self, sandbox_id: str, node_id: str) -> bool:
        return int(await self._run("RELEASE", sandbox_id, node_id, now_ms())) == 1

    async def mark_lost(self, sandbox_id: str, note: str) -> bool:
        """Show ``sandbox_id`` as lost, with ``note``, where it is bound now (False: no
        binding). For a sandbox no live node holds (the gateway's write, docs/cluster.md)."""
        return int(await self._run("LOST", sandbox_id, note, now_ms())) == 1

    async def binding(self, sandbox_id: str) -> Binding | None:
        try:
            h = await self.redis.hgetall(keys.sandbox(sandbox_id))
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None
        return _binding(sandbox_id, h) if h else None

    async def bindings(self, sandbox_ids: list[str]) -> list[Binding]:
        if not sandbox_ids:
            return []
        try:
            async with self.redis.pipeline(transaction=False) as p:
                for sid in sandbox_ids:
                    p.hgetall(keys.sandbox(sid))
                got = await p.execute()
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None
        return [_binding(sid, h) for sid, h in zip(sandbox_ids, got) if h]

    async def node_sandbox_ids(self, node_id: str) -> list[str]:
        try:
            return sorted(await self.redis.smembers(keys.node_sandboxes(node_id)))
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def released_ids(self) -> list[str]:
        try:
            return sorted(await self.redis.smembers(keys.RELEASED))
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None

    async def events_since(self, last_id: str, count: int = 1000) -> list[tuple[str, dict[str, str]]]:
        """Events after ``last_id`` ("$" = none yet: only the id of the newest is returned)."""
        try:
            if last_id == "$":
                newest = await self.redis.xrevrange(keys.EVENTS, count=1)
                return [(newest[0][0], {})] if newest else [("0-0", {})]
            got = await self.redis.xrange(keys.EVENTS, min=f"({last_id}", count=count)
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None
        return [(eid, fields) for eid, fields in got]

    async def events(self, count: int = 100) -> list[dict[str, str]]:
        try:
            got = await self.redis.xrevrange(keys.EVENTS, count=count)
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.url}: {e}") from None
        return [{"eventID": eid, **fields} for eid, fields in got]


def _binding(sid: str, h: dict[str, str]) -> Binding:
    try:
        info = json.loads(h.get("info") or "{}")
    except ValueError:
        info = {}
    pa = h.get("paused_at")
    return Binding(sid, h.get("node", ""), h.get("state", "running"), info if isinstance(info, dict) else {},
                   h.get("note", ""), float(pa) if pa else None, _int(h.get("updated")) / 1000)
