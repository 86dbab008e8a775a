"""E2B's volumes through a gateway (docs/cluster.md, "Volumes").

A volume is a directory tree of the node that made it (docs/volumes.md): in a fleet it
stays there, and the gateway keeps where it is. A volume made through the gateway is
placed on the live, undrained node with the most free disk; the gateway records
``aenv:vol:<volumeID>`` (its node, name, team and byte bound) and ``aenv:volname:<name>``
(its id: names are unique in the fleet, as on one node, claimed before the node makes
it, so two gateways cannot make the same name twice). A team's volumeBytes quota holds
across the fleet: the node checks its own share, and the record is made in one Redis
step with the check of the team's volumes' bounds everywhere (scripts.py VOLUME_ADD); a
volume that no longer fits (another gateway's took the room) is deleted again, 507. Then:

* ``GET/DELETE /volumes/{id}`` go to its node (which checks the team: another team's is
  404 there); ``GET /volumes`` asks every live node and joins their lists;
* the content routes (``/volumecontent/{id}/…``, the volume's token, no API key) are
  streamed to its node, which checks the token;
* a sandbox created with ``volumeMounts`` is placed on the node of its volumes (all on
  one node, else 400; a volume the fleet does not know: 404, as a node answers).

A node that is down makes its volumes unavailable (503) until it is back; they do not
move. A volume made on a node directly, not through a gateway, is not known to it.
"""
from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError


from .. import keys
from ..coord import CoordError
from .answers import error, relay
from .forward import NodeClient, forwarded_headers
from .state import FleetView

CONTENT = re.compile(r"^/volumecontent/([^/]+)(/.*)?$")
VOLUME = re.compile(r"^/volumes/([^/]+)$")
CLAIM_PENDING = "pending"
CLAIM_SECONDS = 120         # a name claimed by a create still running (a gateway that died keeps it no longer)


vol_key, name_key = keys.volume, keys.volume_name


def _over_volume_bytes(limit: int, held: int, asked: int) -> str:
    """A node's words for the quota (aenv_api/server/quotas.py ``over_volume_bytes``)."""
    if held < 0:
        return (f"your team's volumes include one with no byte bound: it leaves no room under the team's "
                f"volumeBytes quota ({limit} bytes); delete it first")
    return (f"Your team's volumes may hold {limit} bytes (volumeBytes quota); its volumes' bounds already sum to "
            f"{held} bytes, so a volume of {asked} more bytes is refused: delete a volume, make a smaller one "
            f"(maxBytes) or ask the deployment's admin for a larger quota")


class FleetVolumes:
    """Where each volume of the fleet is, and the routes that need it (module doc)."""

    def __init__(self, fleet: FleetView, nodes: NodeClient) -> None:
        self.fleet = fleet
        self.nodes = nodes

    @property
    def _redis(self) -> Any:
        return self.fleet.coord.redis

    async def node_of(self, volume_id: str) -> str | None:
        try:
            return await self._redis.hget(vol_key(volume_id), "node") 
        except (RedisError, OSError) as e:
            raise CoordError(f"redis: {e}") from None

    async def node_of_name(self, name: str) -> str | None:
        try:
            vid = await self._redis.get(name_key(name))
            if not vid or vid == CLAIM_PENDING:
                return None
            return await self._redis.hget(vol_key(vid), "node")    
        except (RedisError, OSError) as e:
            raise CoordError(f"redis: {e}") from None

    # --- the API key's routes ------------------------------------------------------------

    async def create(self, request: web.Request, body: bytes, team: str) -> web.Response:
        try:
            name = json.loads(body).get("name")
        except (ValueError, AttributeError):
            name = None
        if not isinstance(name, str) or not name:
            return error(400, "Invalid volume name: a name is required")   # the node says why in detail
        candidates = sorted((n for n in self.fleet.alive() if not n.drained), key=lambda n: -n.disk_free_mib)
        if not candidates:
            return error(503, "no undrained node of the fleet is up to make the volume on")
        try:
            claimed = await self._redis.set(name_key(name), CLAIM_PENDING, nx=True, ex=CLAIM_SECONDS)
        except (RedisError, OSError) as e:
            raise CoordError(f"redis: {e}") from None
        if not claimed:
            return error(400, f"Volume with name {name!r} already exists")
        recorded = False
        try:
            node = candidates[0]
            headers = forwarded_headers(request)
            a = await self.nodes.call("POST", node.url + request.rel_url.raw_path_qs, body, headers)
            if a.status != 201:
                return relay(a)
            made = json.loads(a.body)
            vid, bound = str(made["volumeID"]), int(made.get("maxBytes", 0))
            room = await self.fleet.coord.add_volume(team, vid, node.node_id, name, bound)
            if not room.recorded:
                # another gateway's volume of the team took the room meanwhile: this one goes
                await self.nodes.call("DELETE", node.url + f"/volumes/{vid}", None, headers)
                return error(507, _over_volume_bytes(room.limit, room.held, bound))
            recorded = True
            return relay(a)
        except (RedisError, OSError) as e:
            raise CoordError(f"redis: {e}") from None
        finally:
            if not recorded:
                await self._redis.delete(name_key(name))

    async def list(self, request: web.Request) -> web.Response:
        answers = await self.nodes.answers([n.url for n in self.fleet.alive()], "GET", "/volumes",
                                           forwarded_headers(request))
        out: list[Any] = []
        for a in answers:
            if a.status != 200:
                return relay(a)        # the key is wrong for every node alike: their answer
            out.extend(a.json())
        out.sort(key=lambda v: (v.get("name", ""), v.get("volumeID", "")))
        return web.Response(text=json.dumps(out), content_type="application/json")

    async def one(self, request: web.Request, volume_id: str) -> web.Response:
        """GET or DELETE ``/volumes/{id}`` on its node."""
        node = await self.node_of(volume_id)
        if node is None:
            return error(404, "Volume not found")
        if not self.fleet.is_alive(node):
            return error(503, f"volume {volume_id} is on node {node}, which is down: retry when it is back")
        a = await self.nodes.call(request.method, self.fleet.url(node) + request.rel_url.raw_path_qs, None,
                                  forwarded_headers(request))
        if request.method == "DELETE" and a.status == 204:
            await self.fleet.coord.drop_volume(volume_id)
        return relay(a)

    # --- the volume token's routes --------------------------------------------------------

    async def content_node(self, volume_id: str) -> tuple[str, str] | web.Response:
        """(node id, its URL) of a volume's content routes, or the answer why none."""
        node = await self.node_of(volume_id)
        if node is None:
            return error(404, "Volume not found")
        if not self.fleet.is_alive(node):
            return error(503, f"volume {volume_id} is on node {node}, which is down: retry when it is back")
        return node, self.fleet.url(node)

    # --- creates with volumeMounts ---------------------------------------------------------

    async def mounts_node(self, mounts: Any) -> str | web.Response | None:
        """The node every volume ``mounts`` names is on (None: no mounts), or the answer
        why a create cannot be placed."""
        if not isinstance(mounts, list) or not mounts:
            return None
        found: set[str] = set()
        for m in mounts:
            name = m.get("name") if isinstance(m, dict) else None
            if not isinstance(name, str):
                return None         # malformed: the node answers it (400) with its reason
            node = await self.node_of_name(name)
            if node is None:
                return error(404, f"volumeMounts: Volume {name[:64]!r} not found")
            found.add(node)
        if len(found) > 1:
            return error(400, f"volumeMounts: the volumes are on different nodes ({', '.join(sorted(found))}); "
                               f"a sandbox mounts volumes of one node")
        node = found.pop()
        if not self.fleet.is_alive(node):
            return error(503, f"volumeMounts: the volumes are on node {node}, which is down: retry when it is back")
        return node
