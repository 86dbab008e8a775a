"""Signed ``/files`` URLs that name no sandbox, through the gateway (docs/cluster.md,
"Routing").

The E2B SDK builds ``download_url`` / ``upload_url`` on ``E2B_SANDBOX_URL`` when that
is set: ``/files?path=…&signature=…`` with nothing naming the sandbox, whose envd
token alone made the signature. A gateway with ``domain`` set gets host-routed URLs
instead and needs none of this. For the rest:

* **Found, not fanned out.** The gateway asks the live nodes at once, with no body,
  which of their sandboxes made the signature (``GET /_aenv/cluster/signed-owner``);
  the one that knows it answers its id. The request itself then goes to that node
  only, streamed both ways as any sandbox traffic (no body held in memory).
* **Remembered.** A found signature is kept (``OWNER_TTL``, or until its expiry) so a
  client's repeated downloads ask nobody; one no node knows is kept as unknown for
  ``UNKNOWN_TTL`` and answered 401 at once. Both memories are bounded (oldest out).
* **Limited per client.** The lookups a client address may start are a token bucket
  (``LOOKUPS_PER_SECOND``, burst ``LOOKUP_BURST``): a client trying signatures costs
  the nodes at most that, then gets 429 with Retry-After.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from aenv_wire.cluster import signed_owner_path

from .forward import NodeClient, NodeFailed, NodeUnreachable
from .limits import ClientBuckets

OWNER_TTL = 300.0           # seconds a found signature's sandbox is remembered (at most: its expiry)
UNKNOWN_TTL = 30.0          # seconds a signature no node knows is answered 401 without asking
MAX_REMEMBERED = 10_000     # entries in each of the two memories
LOOKUPS_PER_SECOND = 10.0   # lookups one client address may start, sustained
LOOKUP_BURST = 40.0
LOOKUP_TIMEOUT = 10.0       # seconds a node may take to say whether a signature is its


class _Expiring:
    """key -> value until a deadline, at most ``size`` entries (the oldest go first)."""

    def __init__(self, size: int, clock: Callable[[], float]) -> None:
        self.size, self.clock = size, clock
        self.items: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def get(self, key: str) -> str | None:
        hit = self.items.get(key)
        if hit is None:
            return None
        if hit[0] < self.clock():
            del self.items[key]
            return None
        return hit[1]

    def put(self, key: str, value: str, ttl: float) -> None:
        self.items[key] = (self.clock() + ttl, value)
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def drop(self, key: str) -> None:
        self.items.pop(key, None)


@dataclass(frozen=True)
class Lookup:
    """What the gateway knows of a signed URL: its sandbox, or why it has none."""
    sandbox_id: str | None
    retry_after: int = 0          # > 0: the client asked too often (429)


def signature_key(method: str, query: Mapping[str, str]) -> str:
    """What identifies a signed request for the memories: its method and signed fields."""
    return json.dumps([method, *(query.get(k, "") for k in ("path", "username", "signature",
                                                             "signature_expiration"))])


class SignedOwners:
    """Finds, remembers and limits the lookups of signed URLs' sandboxes (module doc)."""

    def __init__(self, nodes: NodeClient, clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = nodes
        self.clock = clock
        self.owners = _Expiring(MAX_REMEMBERED, clock)
        self.unknown = _Expiring(MAX_REMEMBERED, clock)
        self.buckets = ClientBuckets(LOOKUPS_PER_SECOND, LOOKUP_BURST, clock)

    async def find(self, method: str, query: Mapping[str, str], client: str, node_urls: Iterable[str]) -> Lookup:
        key = signature_key(method, query)
        sid = self.owners.get(key)
        if sid is not None:
            return Lookup(sid)
        if self.unknown.get(key) is not None:
            return Lookup(None)
        wait = self.buckets.take(client)
        if wait > 0:
            return Lookup(None, retry_after=max(1, math.ceil(wait)))
        path = signed_owner_path(method, query)

        async def ask(url: str) -> str | None:
            try:
                a = await self.nodes.call("GET", url + path, None, {}, LOOKUP_TIMEOUT)
            except (NodeUnreachable, NodeFailed):
                return None
            if a.status != 200:
                return None
            try:
                got = json.loads(a.body).get("sandboxID")
            except (ValueError, AttributeError):
                return None
            return got if isinstance(got, str) else None
        found = [s for s in await asyncio.gather(*(ask(u) for u in node_urls)) if s]
        if not found:
            self.unknown.put(key, "", UNKNOWN_TTL)
            return Lookup(None)
        self.owners.put(key, found[0], self._ttl(query))
        return Lookup(found[0])

    def forget(self, method: str, query: Mapping[str, str]) -> None:
        """The sandbox found is not where it was (killed, moved away): ask again next time."""
        self.owners.drop(signature_key(method, query))

    def _ttl(self, query: Mapping[str, str]) -> float:
        try:
            left = int(query.get("signature_expiration", "")) - time.time()
        except ValueError:
            return OWNER_TTL
        return max(0.0, min(OWNER_TTL, left))
