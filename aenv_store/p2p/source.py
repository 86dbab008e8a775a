"""Where P2P meets the read chain.

``PeerChunkSource`` is the chunk source (aenv_store.chunks.ChunkSource) the
chain consults between the node cache and the repository: ask peers (300 ms
lookup timeout by default), get bytes already verified against their id, or
nothing so the chain reads the repository. ``CommittedChunkProvider`` decides
what this node serves: only committed, verified chunks (its node cache holds
verified plaintext; chunks in the repository index are read and verified on
demand, never via other peers, so two nodes can never ask each other in a
loop). It gets the narrow parts it needs, not the Store: aenv_store.assembly
composes them."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from ..config import P2PConfig
from ..errors import StoreError
from ..formats.ids import Digest
from .node import P2PNode
from .peers import NodeBusy

log = logging.getLogger(__name__)

# A chunk committed by another node shows up in our index only after we reload
# it (a LIST of index/ on the backend): do that at most this often when serving.
INDEX_REFRESH_INTERVAL = 5.0


class ServedCache(Protocol):
    """The node cache as the provider uses it (aenv_store.cache.node_cache.NodeCache)."""

    def contains(self, digest: Digest) -> bool: ...

    def get(self, digest: Digest) -> bytes | None: ...

    def put(self, digest: Digest, data: bytes) -> bool: ...


class CommittedIndex(Protocol):
    """The repository's index as the provider uses it (aenv_store.repository.repository.Repository)."""

    def has_chunk(self, chunk: bytes) -> bool: ...

    def refresh_index(self) -> int: ...


class CommittedChunkProvider:
    """What this node serves: chunks in its node cache or in the repository's index.

    ``fetch`` reads one committed chunk from the repository, verified (no cache, no
    peers); what it reads is added to ``cache``."""

    def __init__(self, cache: ServedCache | None, index: CommittedIndex, fetch: Callable[[Digest], bytes]) -> None:
        self.cache = cache
        self.index = index
        self.fetch = fetch
        self._refreshed = 0.0
        self._lock = threading.Lock()

    def _committed(self, cid: Digest) -> bool:
        if self.index.has_chunk(cid):
            return True
        with self._lock:
            if time.monotonic() - self._refreshed < INDEX_REFRESH_INTERVAL:
                return False
            self._refreshed = time.monotonic()
        try:
            return bool(self.index.refresh_index()) and self.index.has_chunk(cid)
        except StoreError as e:
            log.info("p2p: index refresh failed: %s", e)
            return False

    def has(self, cid: Digest) -> bool:
        return (self.cache is not None and self.cache.contains(cid)) or self._committed(cid)

    def get(self, cid: Digest) -> bytes | None:
        if self.cache is not None:
            data = self.cache.get(cid)
            if data is not None:
                return data
        if not self._committed(cid):
            return None
        try:
            data = self.fetch(cid)  # range read + BLAKE3 check, no peers
        except StoreError as e:
            log.warning("p2p: cannot serve chunk %s: %s", cid.hex()[:16], e)
            return None
        if self.cache is not None:
            self.cache.put(cid, data)
        return data


class PeerChunkSource:
    """The read chain's view of the P2P node (a ChunkSource)."""

    def __init__(self, node: P2PNode) -> None:
        self.node = node

    @property
    def ticket(self) -> str:
        """How peers reach this node (iroh endpoint ticket)."""
        return self.node.ticket

    def fetch_many(self, cids: list[Digest]) -> dict[Digest, bytes]:
        return self.node.fetch_many(cids)

    def status(self) -> dict[str, Any]:
        return self.node.status()

    def sync_peers(self, tickets: dict[str, str], source: str = "fleet") -> tuple[list[str], list[str]]:
        """The peers from ``source`` become exactly ``tickets`` (P2PNode.sync_peers)."""
        return self.node.sync_peers(tickets, source)

    def close(self) -> None:
        self.node.close()


def start_peer_source(data_dir: Path, config: P2PConfig, provider: CommittedChunkProvider) -> PeerChunkSource | None:
    """Start this node's P2P endpoint if ``[p2p] enabled``; None if off or it cannot start
    (P2P is an optimisation: a node without it still reads everything from the repository)."""
    if not config.enabled:
        return None
    node = P2PNode(data_dir, config, provider)
    try:
        node.start()
    except NodeBusy as e:
        # e.g. `aenv repo stats` while the server runs on this data dir: expected
        log.info("p2p not started in this process: %s", e)
        node.close()
        return None
    except Exception as e:  # noqa: BLE001
        log.warning("p2p disabled on this node: the endpoint did not start: %s", e)
        node.close()
        return None
    return PeerChunkSource(node)
