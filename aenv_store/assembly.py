"""A node's store, assembled: ``Store.open`` plus, when ``[p2p] enabled``, the P2P
node, whose peers join the read chain between the node cache and the repository.

The server, the CLI, benchmarks and tests that want P2P open their store here;
``Store.open`` alone never starts P2P, and ``p2p/`` never sees the Store: the
provider it serves from gets the node cache, the repository index and a
verified repository read."""
from __future__ import annotations

from .config import StoreSettings
from .p2p.source import CommittedChunkProvider, PeerChunkSource, start_peer_source
from .store import Store


def chunk_provider(store: Store) -> CommittedChunkProvider:
    """What this node serves to its peers, from ``store``'s node cache and repository."""
    return CommittedChunkProvider(store.cache, store.repository, store.fetch_chunk)


def open_node_store(settings: StoreSettings, create: bool = False) -> Store:
    """``Store.open(settings, create)`` with P2P composed in when ``[p2p] enabled``
    (it is skipped, with a log line, if its endpoint cannot start); closing the
    store stops the P2P node first."""
    store = Store.open(settings, create)
    try:
        peers = start_peer_source(settings.paths.data_dir, settings.p2p, chunk_provider(store))
    except BaseException:
        store.close()
        raise
    if peers is not None:
        store.add_chunk_source(peers)
    return store


def peer_source(store: Store) -> PeerChunkSource | None:
    """The P2P source open_node_store put into ``store``'s read chain (ticket, status), if any."""
    for source in store.chunk_sources:
        if isinstance(source, PeerChunkSource):
            return source
    return None
