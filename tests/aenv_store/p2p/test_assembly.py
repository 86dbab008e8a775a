"""P2P is composed where a node's store is assembled (aenv_store.assembly), not in
Store.open: one node reads another's committed chunks through its read chain."""
from __future__ import annotations

import os
from pathlib import Path

from aenv_store.assembly import open_node_store, peer_source
from aenv_store.config import CacheConfig, P2PConfig, RepositoryConfig, StorePaths, StoreSettings
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.store import Store


def settings(data_dir: Path, repo: Path, p2p: P2PConfig) -> StoreSettings:
    return StoreSettings(StorePaths(data_dir), repository=RepositoryConfig(path=str(repo)), p2p=p2p,
                         cache=CacheConfig(capacity=64 << 20, min_free_disk=0))


def test_store_open_alone_never_starts_p2p(tmp_path: Path) -> None:
    with Store.open(settings(tmp_path / "a", tmp_path / "repo", P2PConfig(enabled=True)), create=True) as store:
        assert store.chunk_sources == () and peer_source(store) is None
    with open_node_store(settings(tmp_path / "b", tmp_path / "repo", P2PConfig(enabled=False))) as store:
        assert peer_source(store) is None


def test_open_node_store_puts_peers_into_the_read_chain(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    repo = tmp_path / "repo"
    with open_node_store(settings(tmp_path / "a", repo, P2PConfig(enabled=True)), create=True) as a:
        with a.workspace() as ws:
            w = ws.blob_writer(size=len(data))
            w.write(0, data)
            mid = w.close()
            ws.commit(CatalogRecord(name="snap", kind="snapshot", manifests=(("disk", mid),)))
        a_peers = peer_source(a)
        assert a_peers is not None and a.chunk_sources == (a_peers,)
        p2p = P2PConfig(enabled=True, peers=(a_peers.ticket,), lookup_timeout_ms=3000)
        with open_node_store(settings(tmp_path / "b", repo, p2p)) as b:
            b_peers = peer_source(b)
            assert b_peers is not None
            a_peers.node.add_peer(b_peers.ticket)      # a serves only its peers
            got = b.open_blob(mid).read(0, len(data))
            totals = b_peers.status()["totals"]
        assert got == data
        assert totals["bytes_in"] == len(data)      # every chunk came from node a, none from the repository
    # closing the store stopped its node: the data dir can run a node again
    with open_node_store(settings(tmp_path / "a", repo, P2PConfig(enabled=True))) as again:
        assert peer_source(again) is not None
