"""Every Redis key the fleet uses, in one place (docs/cluster.md, "Redis keys", is the
same list with what survives a Redis restart).

All keys start with ``aenv:`` so a fleet can share a Redis with other users; none has a
Redis TTL (a lease is a score compared with the clock, not an expiring key: a Redis
restart from its AOF must not drop a node or a binding because time passed).
"""
from __future__ import annotations

PREFIX = "aenv:"

NODES = PREFIX + "nodes"            # ZSET node id -> lease deadline (unix ms)
FREE = PREFIX + "free"              # ZSET node id -> free sandbox slots (placeable nodes only)
APIKEYS = PREFIX + "apikeys"        # SET sha256 hex digests of the deployment's API keys
EVENTS = PREFIX + "events"          # STREAM of fleet events (capped, ~10k entries)
RELEASED = PREFIX + "released"      # SET sandbox ids paused in the repository, held by no node
TEAMS = PREFIX + "teams"            # HASH doc (the teams document: teams, salted key hashes), version
SECRETS = PREFIX + "secrets"        # HASH doc (the teams' secrets, each value sealed with the secrets key), version
EVENTS_MAXLEN = 10_000


def node(node_id: str) -> str:
    """HASH: url, capacity fields, counts, p2p (its P2P ticket), drained, state (docs/cluster.md)."""
    return f"{PREFIX}node:{node_id}"


def node_sandboxes(node_id: str) -> str:
    """SET: ids of the sandboxes bound to the node (running, paused or lost)."""
    return f"{PREFIX}node:{node_id}:sbx"


def node_templates(node_id: str) -> str:
    """SET: templates (ids and aliases) the node has restored, so its cache holds them."""
    return f"{PREFIX}node:{node_id}:tpl"


def template_nodes(template: str) -> str:
    """SET: nodes whose cache holds ``template`` (the reverse of node_templates)."""
    return f"{PREFIX}tpl:{template}"


def sandbox(sandbox_id: str) -> str:
    """HASH: node, state, info (the sandbox's record as JSON), note, paused_at, updated."""
    return f"{PREFIX}sbx:{sandbox_id}"


def idempotency(digest: str) -> str:
    """STRING: the node a create with this Idempotency-Key (sha256 hex) went to, or
    "pending"; the one key with a Redis TTL (a day, as a node keeps its own keys)."""
    return f"{PREFIX}idem:{digest}"


# team quotas (scripts.py "Team quotas"; docs/cluster.md)
SANDBOX_TEAMS = PREFIX + "sbxteam"   # HASH sandbox id -> the team it counts for


def team_quota(team: str) -> str:
    """HASH: the team's quota as the admin set it (runningSandboxes, createsPerSecond, ...; absent: unlimited)."""
    return f"{PREFIX}quota:{team}"


def team_running(team: str) -> str:
    """SET: ids of the team's sandboxes running in the fleet (counted against its quota)."""
    return f"{PREFIX}team:{team}:run"


def team_paused(team: str) -> str:
    """SET: ids of the team's sandboxes paused in the fleet (on a node or released)."""
    return f"{PREFIX}team:{team}:paused"


def team_pause_reservations(team: str) -> str:
    """ZSET: the team's pauses in flight through a gateway (reservation id -> expiry, unix ms)."""
    return f"{PREFIX}team:{team}:presv"


def team_reservations(team: str) -> str:
    """ZSET: the team's starts in flight (reservation member -> expiry, unix ms)."""
    return f"{PREFIX}team:{team}:resv"


def team_bucket(team: str) -> str:
    """HASH: tokens, stamp (unix ms) of the team's creates-per-second bucket."""
    return f"{PREFIX}team:{team}:bucket"


def volume(volume_id: str) -> str:
    """HASH: node, name, team, bytes (its bound; 0: none) of a volume made through a gateway
    (gateway/volumes.py, scripts.py VOLUME_ADD)."""
    return f"{PREFIX}vol:{volume_id}"


def team_volumes(team: str) -> str:
    """SET: ids of the team's volumes made through a gateway (its volumeBytes quota)."""
    return f"{PREFIX}team:{team}:vols"


def volume_name(name: str) -> str:
    """STRING: the id of the volume named ``name`` in the fleet (``pending`` while it is made)."""
    return f"{PREFIX}volname:{name}"
