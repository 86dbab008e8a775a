"""P2P discovery through Redis (aenv_fleet/peering.py): two store nodes, each with its
own data dir and node cache, one shared posix_fs repository, each with its P2P node
started as ``aenv server`` starts it (open_node_store) and bound on its own
``[p2p] host`` (127.0.0.1 and 127.0.0.2), and two node agents heartbeating into a
real redis-server. B learns A's ticket only through Redis, reads A's chunks from A,
and drops A when A leaves or its lease runs out. No VM."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from aenv_cli.config import fleet_p2p, load_config
from aenv_fleet.agent import NodeAgent
from aenv_fleet.config import ClusterConfig
from aenv_fleet.coord import Capacity, Coordinator
from aenv_wire.fleet_auth import FleetKeys
from aenv_store.assembly import open_node_store, peer_source
from aenv_store.config import CacheConfig, P2PConfig, RepositoryConfig, StorePaths, StoreSettings
from aenv_store.errors import ConfigError
from aenv_store.p2p.node import parse_ticket
from aenv_store.p2p.source import PeerChunkSource

from tests.aenv_store.backends.test_repository_backends import commit_blob
from .redisserver import RedisServer

LEASE = 1.0


def settings(data_dir: Path, repo: Path, host: str) -> StoreSettings:
    return StoreSettings(StorePaths(data_dir), repository=RepositoryConfig(path=str(repo)),
                         p2p=P2PConfig(enabled=True, host=host, lookup_timeout_ms=3000),
                         cache=CacheConfig(capacity=64 << 20, min_free_disk=0))


def agent(name: str, url: str, data_dir: Path, peers: PeerChunkSource) -> NodeAgent:
    cfg = ClusterConfig(redis_url=url, node_id=name, advertise_url=f"http://{name}.test:8000",
                        lease_seconds=LEASE, heartbeat_seconds=LEASE / 2)
    coord = Coordinator(url, FleetKeys.parse("p2p-test-fleet-secret-0123456789"))
    return NodeAgent(cfg, "key", 4, 256, data_dir, coord=coord, p2p=peers)


async def beat(a: NodeAgent) -> None:
    """One heartbeat as NodeAgent.tick sends it (the node's capacity, with its ticket)."""
    assert a.peering is not None
    await a.heartbeat(Capacity(url=a.config.advertise_url, max_sandboxes=4, vcpus=1, mem_total_mib=1024,
                               mem_avail_mib=1024, disk_free_mib=1024, sandbox_mem_mib=256, running=0, paused=0,
                               p2p=a.peering.ticket))


def peer_of(src: PeerChunkSource, node_id: str) -> dict:
    return next(p for p in src.status()["peers"] if p["node_id"] == node_id)


def test_nodes_find_each_other_through_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    redis_server.client().flushall()
    repo = tmp_path / "repo"
    data = os.urandom(1 << 20)
    with open_node_store(settings(tmp_path / "a", repo, "127.0.0.1"), create=True) as sa, \
            open_node_store(settings(tmp_path / "b", repo, "127.0.0.2"), create=True) as sb:
        pa, pb = peer_source(sa), peer_source(sb)
        assert pa is not None and pb is not None
        # each endpoint is bound on its own [p2p] host and its ticket names that address
        assert [str(x) for x in parse_ticket(pa.ticket)[0].direct_addresses()][0].startswith("127.0.0.1:")
        assert [str(x) for x in parse_ticket(pb.ticket)[0].direct_addresses()][0].startswith("127.0.0.2:")
        mid = commit_blob(sa, data, "snap")          # A's node cache holds these chunks
        id_a, id_b = pa.status()["node_id"], pb.status()["node_id"]
        assert pb.status()["peers"] == [] and pa.status()["peers"] == []   # no static peers at all

        async def scenario() -> None:
            ag_a, ag_b = agent("a", redis_server.url, tmp_path / "a", pa), agent("b", redis_server.url,
                                                                                  tmp_path / "b", pb)
            try:
                await beat(ag_a)
                await beat(ag_b)                     # B sees A's record: A becomes its peer
                assert (await ag_b.coord.nodes())[0].p2p_ticket == pa.ticket
                got_b = peer_of(pb, id_a)
                assert got_b["source"] == "fleet" and got_b["state"] == "active" and got_b["ticket"] == pa.ticket
                await beat(ag_a)                     # and at A's next heartbeat, B is A's
                assert peer_of(pa, id_b)["state"] == "active"

                got = await asyncio.to_thread(lambda: sb.open_blob(mid).read(0, len(data)))
                assert got == data
                # every byte came over P2P from A, none from the repository
                assert peer_of(pb, id_a)["bytes_in"] == len(data)
                assert pa.status()["served"][id_b]["bytes_out"] == len(data)

                # A leaves (what NodeAgent.close does after its last reconcile): B drops it
                await ag_a.coord.stop_node("a")
                await beat(ag_b)
                left = peer_of(pb, id_a)
                assert left["state"] == "dropped" and "no longer published" in left["dropped_reason"]
                assert pb.fetch_many([bytes(32)]) == {}  # no usable peer: nobody is asked

                # A comes back, then stops heartbeating: B drops it once its lease has run out
                await beat(ag_a)
                await beat(ag_b)
                assert peer_of(pb, id_a)["state"] == "active"
                deadline = time.monotonic() + 10 * LEASE
                while any(n.alive for n in await ag_b.coord.nodes() if n.node_id == "a"):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
                await beat(ag_b)
                assert peer_of(pb, id_a)["state"] == "dropped"
                # its record still holds the ticket: only the lease decides
                assert [n.p2p_ticket for n in await ag_b.coord.nodes() if n.node_id == "a"] == [pa.ticket]
            finally:
                await ag_a.coord.close()
                await ag_b.coord.close()

        asyncio.run(scenario())


def test_sync_peers_leaves_other_sources_alone(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    with open_node_store(settings(tmp_path / "a", repo, "127.0.0.1"), create=True) as sa, \
            open_node_store(settings(tmp_path / "b", repo, "127.0.0.1"), create=True) as sb, \
            open_node_store(settings(tmp_path / "c", repo, "127.0.0.1"), create=True) as sc:
        pa, pb, pc = peer_source(sa), peer_source(sb), peer_source(sc)
        assert pa is not None and pb is not None and pc is not None
        pa.node.add_peer(pc.ticket, "config")
        # a bad ticket and this node's own are skipped, not fatal
        added, dropped = pa.sync_peers({"b": pb.ticket, "bad": "not-a-ticket", "self": pa.ticket})
        assert added == [pb.status()["node_id"]] and dropped == []
        assert pa.sync_peers({"b": pb.ticket}) == ([], [])      # unchanged: nothing to do
        added, dropped = pa.sync_peers({})
        assert added == [] and dropped == [pb.status()["node_id"]]
        states = {p["node_id"]: (p["source"], p["state"]) for p in pa.status()["peers"]}
        assert states[pc.status()["node_id"]] == ("config", "active")   # a config peer stays


def test_p2p_host_config(tmp_path: Path) -> None:
    for bad in ("0.0.0.0", "::", "node1.example", "10.0.0.1:5"):
        with pytest.raises(ConfigError, match="p2p.host"):
            P2PConfig(host=bad)
    with pytest.raises(ConfigError, match="p2p.port"):
        P2PConfig(port=70000)
    assert P2PConfig().bind_host() == "127.0.0.1"                  # a single node: loopback
    fleet = {"redis_url": "redis://127.0.0.1:1/0", "advertise_url": "http://10.0.0.2:8000"}
    cfg = load_config(tmp_path, overrides={"cluster": fleet, "p2p": {"enabled": True}})
    assert cfg.store_settings().p2p.bind_host() == "10.0.0.2"      # derived from advertise_url
    cfg = load_config(tmp_path, overrides={"cluster": fleet, "p2p": {"enabled": True, "host": "10.0.0.9"}})
    assert cfg.store_settings().p2p.bind_host() == "10.0.0.9"      # an explicit host wins
    named = ClusterConfig(redis_url="redis://x:1/0", advertise_url="http://node1.example:8000")
    assert fleet_p2p(P2PConfig(), named).bind_host() == "127.0.0.1"   # not an IP: set [p2p] host
    assert load_config(tmp_path, overrides={}).store_settings().p2p.bind_host() == "127.0.0.1"
