"""The fleet's Redis state with a real redis-server and simulated node agents: leases,
slot accounting, placement (two gateways at once never overfill a node), template
preference, and a Redis SIGKILL + restart losing nothing (AOF)."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from aenv_fleet.coord import Capacity, Coordinator, key_digest
from aenv_wire.fleet_auth import FleetKeys

from .redisserver import RedisServer


FLEET_KEYS = FleetKeys.parse("coord-test-fleet-secret-0123456789")


def cap(max_sandboxes: int, mem_avail: int = 100_000, url: str = "http://node") -> Capacity:
    return Capacity(url=url, max_sandboxes=max_sandboxes, vcpus=2, mem_total_mib=mem_avail,
                    mem_avail_mib=mem_avail, disk_free_mib=10_000, sandbox_mem_mib=256, running=0, paused=0)


@pytest.fixture
def fresh(redis_server: RedisServer) -> RedisServer:
    redis_server.client().flushall()
    return redis_server


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_two_gateways_placing_at_once_never_exceed_capacity(fresh: RedisServer) -> None:
    async def main() -> dict[str, int]:
        agent, gw1, gw2 = (Coordinator(fresh.url, FLEET_KEYS) for _ in range(3))
        sizes = {"n1": 3, "n2": 5, "n3": 7}
        for n, m in sizes.items():
            await agent.heartbeat(n, cap(m), 30)

        async def create(gw: Coordinator, i: int) -> str | None:
            got = await gw.place("base", 256)
            if got is None:
                return None
            node, rid = got
            await asyncio.sleep(0.001 * (i % 5))    # the create in flight
            await gw.bind(f"sbx-{i}", node, "running", {"templateID": "base"})
            await gw.unreserve(node, rid)
            return node

        results = await asyncio.gather(*[create(gw1 if i % 2 else gw2, i) for i in range(40)])
        placed = [r for r in results if r is not None]
        counts = {n: placed.count(n) for n in sizes}
        assert counts == sizes, counts              # filled exactly to capacity, 25 refused
        assert results.count(None) == 40 - sum(sizes.values())
        for n in sizes:                             # nothing left over in Redis accounting
            assert len(await agent.node_sandbox_ids(n)) == sizes[n]
            assert await agent.heartbeat(n, cap(sizes[n]), 30) == 0
        for c in (agent, gw1, gw2):
            await c.close()
        return counts

    run(main())


def test_spread_by_free_capacity_and_template_preference(fresh: RedisServer) -> None:
    async def main() -> None:
        c = Coordinator(fresh.url, FLEET_KEYS)
        await c.heartbeat("big", cap(10), 30)
        await c.heartbeat("small", cap(4), 30)
        first = await c.place("", 256)
        assert first is not None
        # by free fraction: both start at 1.0; after the first placement the other one wins
        second = await c.place("", 256)
        assert second is not None and second[0] != first[0]
        # a node whose cache holds the template is preferred over a freer one
        await c.add_templates("small", ["tpl-x"])
        for _ in range(2):
            got = await c.place("tpl-x", 256)
            assert got is not None and got[0] == "small"
        # drained: never placed on; undrained: placed again
        assert await c.set_drained("small", True)
        got = await c.place("tpl-x", 256)
        assert got is not None and got[0] == "big"
        assert await c.set_drained("small", False)
        got = await c.place("tpl-x", 256)
        assert got is not None and got[0] == "small"
        # memory filter: a node without memory for one more sandbox is skipped
        await c.heartbeat("small", cap(4, mem_avail=100), 30)
        got = await c.place("tpl-x", 256)
        assert got is not None and got[0] == "big"
        assert await c.set_drained("nope", True) is False
        await c.close()

    run(main())


def test_a_burst_spreads_by_restore_queue_over_the_cached_template(fresh: RedisServer) -> None:
    """A node whose cache holds the template wins until its restore queue (the creates
    placed there and still running, or what it reported restoring) outweighs that; then
    the burst goes to the idle node."""
    async def main() -> None:
        c = Coordinator(fresh.url, FLEET_KEYS)
        await c.heartbeat("warm", dataclasses.replace(cap(100), restore_slots=2), 30)
        await c.heartbeat("cold", dataclasses.replace(cap(100), restore_slots=2), 30)
        await c.add_templates("warm", ["tpl-x"])
        placed = []
        for _ in range(12):          # a burst: every create still running when the next is placed
            got = await c.place("tpl-x", 256)
            assert got is not None
            placed.append(got[0])
        # the template's node takes the first ones, then its queue of 4 (= 2 * 2 slots)
        # weighs as much as the template: from then on the two alternate
        assert placed == ["warm"] * 4 + ["cold", "warm"] * 4, placed
        # a queue reported at the heartbeat (a fork's children, direct creates) counts too
        await c.heartbeat("warm2", dataclasses.replace(cap(100), restore_slots=2, restoring=8), 30)
        await c.add_templates("warm2", ["tpl-y"])
        await c.heartbeat("idle", dataclasses.replace(cap(100), restore_slots=2), 30)
        got = await c.place("tpl-y", 256, exclude=("warm", "cold"))
        assert got is not None and got[0] == "idle"
        await c.heartbeat("warm2", dataclasses.replace(cap(100), restore_slots=2, restoring=0), 30)
        got = await c.place("tpl-y", 256, exclude=("warm", "cold"))
        assert got is not None and got[0] == "warm2"
        nodes = {n.node_id: n for n in await c.nodes()}
        assert (nodes["warm2"].restore_slots, nodes["warm2"].restoring) == (2, 0)
        assert nodes["warm2"].view()["restoreSlots"] == 2
        await c.close()

    run(main())


def test_lease_expiry_and_leaked_reservation_heal(fresh: RedisServer) -> None:
    async def main() -> None:
        c = Coordinator(fresh.url, FLEET_KEYS)
        await c.heartbeat("a", cap(2), 0.3)
        await c.heartbeat("b", cap(2), 30)
        got = await c.place("", 256, ttl=0.2)      # a gateway that dies before finishing
        assert got is not None
        await asyncio.sleep(0.4)
        assert await c.expire_nodes() == ["a"]
        nodes = {n.node_id: n for n in await c.nodes()}
        assert not nodes["a"].alive and nodes["b"].alive
        placed = []
        for _ in range(3):                          # only b is placeable now
            p = await c.place("", 256, ttl=30)
            assert p is None or p[0] == "b"
            placed.append(p)
        # a leaked reservation on b (if the first create went there) is gone at b's next
        # heartbeat once it expired: b's count is exact again
        await c.heartbeat("b", cap(2), 30)
        assert {n.node_id: n.free_slots for n in await c.nodes()}["b"] == 2 - sum(1 for p in placed if p)
        await c.close()

    run(main())


def test_bind_moves_and_releases_keep_slots_exact(fresh: RedisServer) -> None:
    async def main() -> None:
        c = Coordinator(fresh.url, FLEET_KEYS)
        await c.heartbeat("a", cap(3), 30)
        await c.heartbeat("b", cap(3), 30)
        await c.bind("s1", "a", "running", {"templateID": "t"})
        await c.bind("s1", "a", "paused", {"templateID": "t"}, paused_at=time.time())
        free = {n.node_id: n.free_slots for n in await c.nodes()}
        assert free == {"a": 2, "b": 3}
        assert await c.release("s1", "b") is False          # not b's
        assert await c.release("s1", "a")
        assert await c.released_ids() == ["s1"]
        free = {n.node_id: n.free_slots for n in await c.nodes()}
        assert free == {"a": 3, "b": 3}
        await c.bind("s1", "b", "paused", {"templateID": "t"})   # adopted by b
        b = await c.binding("s1")
        assert b is not None and b.node_id == "b" and b.state == "paused" and b.paused_at is not None
        assert await c.released_ids() == []
        assert {n.node_id: n.free_slots for n in await c.nodes()} == {"a": 3, "b": 2}
        assert await c.unbind("s1", "a") is False
        assert await c.unbind("s1")
        assert await c.binding("s1") is None
        assert {n.node_id: n.free_slots for n in await c.nodes()} == {"a": 3, "b": 3}
        kinds = [e["type"] for e in await c.events()]
        assert "sandbox-released" in kinds and "sandbox-killed" in kinds
        await c.close()

    run(main())


def test_marking_lost_keeps_where_the_sandbox_is_listed(fresh: RedisServer) -> None:
    """The gateway's write for a sandbox no live node holds: its state and note change,
    its holder and the sets it is listed by (its old node's, or the released) do not."""
    async def main() -> None:
        c = Coordinator(fresh.url, FLEET_KEYS)
        await c.heartbeat("a", cap(3), 30)
        await c.bind("on-a", "a", "running", {"templateID": "t"}, paused_at=1.0)
        await c.bind("released", "a", "paused", {"templateID": "t"})
        assert await c.release("released", "a")
        assert await c.mark_lost("on-a", "its node a is gone") and await c.mark_lost("released", "gone")
        lost = await c.binding("on-a")
        assert lost is not None and (lost.node_id, lost.state, lost.note, lost.paused_at) == (
            "a", "lost", "its node a is gone", 1.0)
        assert lost.info == {"templateID": "t"}
        gone = await c.binding("released")
        assert gone is not None and (gone.node_id, gone.state) == ("", "lost")
        assert await c.node_sandbox_ids("a") == ["on-a"] and await c.released_ids() == ["released"]
        assert {n.node_id: n.free_slots for n in await c.nodes()} == {"a": 2}       # slots unchanged
        assert await c.mark_lost("nobody", "x") is False and await c.binding("nobody") is None
        kinds = [(e["type"], e["id"]) for e in await c.events()]
        assert ("sandbox-lost", "on-a") in kinds and ("sandbox-lost", "released") in kinds
        assert await c.unbind("released") and await c.released_ids() == []          # DELETE of a lost one
        await c.close()

    run(main())


def test_redis_sigkill_and_restart_loses_nothing(fresh: RedisServer) -> None:
    async def fill() -> None:
        c = Coordinator(fresh.url, FLEET_KEYS)
        await c.add_api_key("k-123")
        await c.heartbeat("a", cap(5), 3600)
        for i in range(20):
            await c.bind(f"s{i}", "a", "running" if i % 2 else "paused", {"templateID": "t", "i": i})
        await c.set_drained("a", True)
        await c.close()

    async def check() -> None:
        c = Coordinator(fresh.url, FLEET_KEYS)
        assert key_digest("k-123") in await c.api_key_digests()
        (a,) = await c.nodes()
        assert a.alive and a.drained and a.url == "http://node"
        assert len(await c.node_sandbox_ids("a")) == 20
        b = await c.binding("s7")
        assert b is not None and b.state == "running" and b.info["i"] == 7
        await c.close()

    run(fill())
    fresh.restart()       # SIGKILL, then start on the same AOF
    run(check())
