"""P2P discovery through Redis: a fleet node's agent publishes its P2P ticket with
every heartbeat (the ``p2p`` field of ``aenv:node:<id>``) and makes the tickets of
the other live nodes its P2P node's peers, so a chunk a neighbour holds is read
from it before the repository (docs/cluster.md, "P2P between nodes").

A ticket means something only while its node's lease runs: a node whose lease
expired, or that stopped (its lease is set to 0), stops being a peer at the next
heartbeat of every other node. The P2P node itself lives in aenv_store; the agent
sees it through ``PeerSync`` only.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from .coord import Coordinator, NodeRecord

log = logging.getLogger(__name__)

SOURCE = "fleet"      # the peer table's source of the peers this module manages


class PeerSync(Protocol):
    """This node's P2P endpoint as the agent uses it (aenv_store.p2p.source.PeerChunkSource)."""

    @property
    def ticket(self) -> str: ...

    def sync_peers(self, tickets: dict[str, str], source: str = SOURCE) -> tuple[list[str], list[str]]: ...


@dataclass(frozen=True)
class PeerChange:
    added: tuple[str, ...]      # P2P node ids that became peers
    dropped: tuple[str, ...]    # P2P node ids that stopped being peers


def live_tickets(nodes: list[NodeRecord], own_node_id: str) -> dict[str, str]:
    """fleet node id -> P2P ticket of every other node whose lease runs."""
    return {n.node_id: n.p2p_ticket for n in nodes
            if n.alive and n.node_id != own_node_id and n.p2p_ticket}


class FleetPeering:
    """One node's side of discovery; ``sync`` runs after each heartbeat."""

    def __init__(self, coord: Coordinator, node_id: str, peers: PeerSync) -> None:
        self.coord = coord
        self.node_id = node_id
        self.peers = peers

    @property
    def ticket(self) -> str:
        """What the heartbeat publishes."""
        return self.peers.ticket

    async def sync(self) -> PeerChange:
        """Peer with exactly the live nodes' published tickets (CoordError if Redis is
        unreachable: the peers stay as they were until a heartbeat gets through)."""
        tickets = live_tickets(await self.coord.nodes(), self.node_id)
        added, dropped = await asyncio.to_thread(self.peers.sync_peers, tickets, SOURCE)
        if dropped:
            log.info("cluster: %d P2P peer(s) left the fleet", len(dropped))
        return PeerChange(tuple(added), tuple(dropped))
