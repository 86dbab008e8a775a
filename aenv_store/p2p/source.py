"""Where P2P meets the Store.

``PeerChunkSource`` is what ``Store.read_chunk`` consults between the node
cache and the repository: ask peers (300 ms lookup timeout by default), get
bytes already verified against their id, or ``None`` so the Store reads the
repository. ``StoreChunkProvider`` decides what this node serves: only
committed, verified chunks (its node cache holds verified plaintext; chunks in
the repository index are read and verified on demand, never via other peers,
so two nodes can never ask each other in a loop)."""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..formats.ids import Digest
from .node import P2PNode
from .peers import NodeBusy

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger(__name__)

# A chunk committed by another node shows up in our index only after we reload
# it (a LIST of index/ on the backend): do that at most this often when serving.
INDEX_REFRESH_INTERVAL = 5.0


class StoreChunkProvider:
    def __init__(self, store: "Store") -> None:
        self.store = store
        self._refreshed = 0.0
        self._lock = threading.Lock()

    def _committed(self, cid: Digest) -> bool:
        repo = self.store.repository
        if repo.has_chunk(cid):
            return True
        with self._lock:
            if time.monotonic() - self._refreshed < INDEX_REFRESH_INTERVAL:
                return False
            self._refreshed = time.monotonic()
        try:
            return bool(repo.refresh_index()) and repo.has_chunk(cid)
        except StoreError as e:
            log.info("p2p: index refresh failed: %s", e)
            return False

    def has(self, cid: Digest) -> bool:
        cache = self.store.cache
        return (cache is not None and cache.contains(cid)) or self._committed(cid)

    def get(self, cid: Digest) -> bytes | None:
        cache = self.store.cache
        if cache is not None:
            data = cache.get(cid)
            if data is not None:
                return bytes(data)
        if not self._committed(cid):
            return None
        try:
            data = self.store.fetch_chunk(cid)  # range read + BLAKE3 check, no peers
        except StoreError as e:
            log.warning("p2p: cannot serve chunk %s: %s", cid.hex()[:16], e)
            return None
        if cache is not None:
            cache.put(cid, data)
        return data


class PeerChunkSource:
    """The Store's view of the P2P node."""

    def __init__(self, node: P2PNode) -> None:
        self.node = node

    def fetch(self, cid: Digest) -> bytes | None:
        return self.node.fetch(cid)

    def fetch_many(self, cids: list[Digest]) -> dict[Digest, bytes]:
        return self.node.fetch_many(cids)

    def status(self) -> dict[str, Any]:
        return self.node.status()

    def close(self) -> None:
        self.node.close()


def attach(store: "Store") -> PeerChunkSource | None:
    """Start this node's P2P endpoint if ``[p2p] enabled``; None if off or it cannot start
    (P2P is an optimisation: a node without it still reads everything from the repository)."""
    cfg = store.settings.p2p
    if not cfg.enabled:
        return None
    node = P2PNode(store.settings.paths.data_dir, cfg, StoreChunkProvider(store))
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
