"""Team quotas in the fleet's Redis with a real redis-server: two gateways creating at
once never take a team past its running quota (checked and reserved in the same Lua step
as the node slot), a pause, a kill or a release frees the team's place as the agent's
bindings change, the creates-per-second bucket is shared by the gateways, and a fork's
or a resume's starts are reserved the same way (``team_reserve``)."""
from __future__ import annotations

import asyncio
import time

import pytest

from aenv_fleet.coord import Coordinator, TeamQuotaExceeded

from .redisserver import RedisServer
from .test_coord import FLEET_KEYS, cap


@pytest.fixture
def fresh(redis_server: RedisServer) -> RedisServer:
    redis_server.client().flushall()
    return redis_server


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def create(gw: Coordinator, agent: Coordinator, team: str, i: int) -> str | None:
    """A gateway's create: place with the team, the node's agent binds, the gateway settles."""
    try:
        got = await gw.place("base", 256, team=team)
    except TeamQuotaExceeded:
        return None
    assert got is not None, "the nodes have room for all: only the team's quota refuses"
    node, rid = got
    await asyncio.sleep(0.001 * (i % 5))        # the create in flight on the node
    sid = f"{team}-sbx-{i}"
    await agent.bind(sid, node, "running", {"templateID": "base"})
    await gw.unreserve(node, rid)
    await gw.team_settle(team, f"{rid}:1", sid)
    return sid


def test_two_gateways_creating_at_once_never_exceed_a_teams_quota(fresh: RedisServer) -> None:
    async def main() -> None:
        agent, gw1, gw2 = (Coordinator(fresh.url, FLEET_KEYS) for _ in range(3))
        for n in ("n1", "n2"):
            await agent.heartbeat(n, cap(50), 30)
        await gw1.set_team_quota("a", {"runningSandboxes": 7, "createsPerSecond": None})
        await gw1.set_team_quota("b", {"runningSandboxes": 3})
        # both teams through both gateways, all at once
        results = await asyncio.gather(*[create(gw1 if i % 2 else gw2, agent, "ab"[i // 2 % 2], i)
                                         for i in range(60)])
        made_a = [r for r in results if r and r.startswith("a-")]
        made_b = [r for r in results if r and r.startswith("b-")]
        assert len(made_a) == 7 and len(made_b) == 3, results
        assert await agent.team_running("a") == set(made_a)
        # another team without a quota is not held back, and is counted all the same
        free = [await create(gw1, agent, "c", 100 + i) for i in range(5)]
        assert None not in free and await agent.team_running("c") == set(free)   # type: ignore[arg-type]
        # a pause frees a place (the agent binds it paused), a resume takes it again
        await agent.bind(made_a[0], "n1", "paused", {})
        assert await create(gw2, agent, "a", 200) is not None
        assert await create(gw2, agent, "a", 201) is None
        grant = await gw1.team_reserve("a", 1, create=False)         # resuming the paused one: no room
        assert grant.granted == 0 and grant.refusal is not None and grant.refusal.kind == "running"
        # a kill (unbind), a release and a lost sandbox free places too
        await agent.unbind(made_a[1], "")
        await agent.release(made_a[2], (await agent.binding(made_a[2])).node_id)   # type: ignore[union-attr]
        assert await agent.mark_lost(made_a[3], "its node is gone")
        grant = await gw1.team_reserve("a", 5, create=True)          # a fork of 5 gets the 3 places there are
        assert grant.granted == 3 and grant.refusal is not None and grant.refusal.kind == "running"
        await gw1.team_unreserve("a", grant.rid, grant.granted)      # the fork failed: the places are back
        assert (await gw1.team_reserve("a", 5, create=True)).granted == 3
        # the quota raised: room again, with no restart of anything
        await gw1.set_team_quota("b", {"runningSandboxes": 4})
        assert await create(gw2, agent, "b", 300) is not None
        # the nodes' slots are the bindings' as ever (17 bound, one killed, one released), nothing
        # held by the teams' reservations
        assert sum([await agent.heartbeat(n, cap(50), 30) for n in ("n1", "n2")]) == 100 - 15
        for c in (agent, gw1, gw2):
            await c.close()

    run(main())


def test_the_creates_per_second_bucket_is_shared_by_the_gateways(fresh: RedisServer) -> None:
    async def main() -> tuple[int, float]:
        agent, gw1, gw2 = (Coordinator(fresh.url, FLEET_KEYS) for _ in range(3))
        await agent.heartbeat("n1", cap(10_000), 30)
        rate = 25.0
        await gw1.set_team_quota("r", {"createsPerSecond": rate})
        made = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            got = await asyncio.gather(*(gw.place("base", 256, team="r") for gw in (gw1, gw2)),
                                       return_exceptions=True)
            for g in got:
                if isinstance(g, TeamQuotaExceeded):
                    assert g.kind == "rate" and g.limit == rate and 0 < g.wait <= 1 / rate + 0.01
                else:
                    assert not isinstance(g, BaseException) and g is not None
                    made += 1
                    await gw1.unreserve(g[0], g[1])
                    await gw1.team_unreserve("r", g[1])
        elapsed = time.monotonic() - t0
        for c in (agent, gw1, gw2):
            await c.close()
        return made, elapsed

    made, elapsed = run(main())
    # the bucket starts full (25), then the rate over both gateways together: within 10 %
    assert abs((made - 25) / elapsed - 25) <= 2.5, (made, elapsed)


# --- the gateway's answers (placement.py), scripted nodes and a fake Redis -----------------------------

def test_the_gateway_answers_a_teams_quota_as_the_node_does() -> None:
    import json

    from aiohttp.test_utils import make_mocked_request

    from aenv_fleet.coord import TeamGrant
    from aenv_fleet.gateway.forward import Answer
    from aenv_fleet.gateway.placement import DEFAULT_TEAM

    from .test_placement_units import Fleet, _answer, _sandboxes, body_of, moves, node, status

    fleet = Fleet(node("n1"))
    created = {"sandboxID": "sbx-7", "templateID": "base"}
    path = "/snapshots/snap-1/fork"
    m, nodes = moves(fleet, {("POST", "http://n1/v2/sandboxes"): [Answer(201, {}, json.dumps(created).encode())],
                             ("POST", "http://n1" + path): [_answer(_sandboxes("a"))]})
    req = make_mocked_request("POST", "/v2/sandboxes", headers={"X-API-Key": "k"})
    # a create: counted for the request's team (the deployment key's, the one a gateway knows)
    assert status(run(m.create(req, b'{"templateID": "base"}'))) == 201
    assert fleet.coord.settled == [(DEFAULT_TEAM, "sbx-7")]
    # the team at its running quota: E2B's 429, no node asked
    async def full(*args: object, **kwargs: object) -> None:
        raise TeamQuotaExceeded("running", 2)
    fleet.coord.place = full     # type: ignore[method-assign]
    calls = len(nodes.calls)
    got = run(m.create(req, b'{"templateID": "base"}'))
    assert status(got) == 429 and body_of(got)["message"].startswith(
        "You have reached the maximum number of concurrent E2B sandboxes (2).")
    assert got.headers["Should-Retry"] == "false" and len(nodes.calls) == calls

    async def slow(*args: object, **kwargs: object) -> None:
        raise TeamQuotaExceeded("rate", 4, 0.2)
    fleet.coord.place = slow     # type: ignore[method-assign]
    got = run(m.create(req, b'{"templateID": "base"}'))
    assert status(got) == 429 and got.headers["Should-Retry"] == "true" and got.headers["Retry-After"] == "1"
    # a batch of 3 from a snapshot with room for 1: one child made, two refused by the quota
    async def one_of(team: str, n: int, create: bool) -> TeamGrant:
        return TeamGrant("rid", 1, TeamQuotaExceeded("running", 5))
    fleet.coord.team_reserve = one_of    # type: ignore[method-assign]
    got = run(m.fork_snapshot(make_mocked_request("POST", path, headers={"X-API-Key": "k"}), "snap-1",
                              json.dumps({"count": 3}).encode()))
    kids = body_of(got)
    assert status(got) == 201 and kids[0] == _sandboxes("a")[0] and nodes.bodies[-1]["count"] == 1
    assert [k["error"]["code"] for k in kids[1:]] == [429, 429]   # type: ignore[index]
    assert fleet.coord.settled[-1] == (DEFAULT_TEAM, "a")


def test_a_quota_the_admin_sets_on_a_node_reaches_the_gateways(fresh: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The admin's PUT on a fleet node writes the quota to Redis (what aenv_cli/node.py wires),
    where a gateway's placement holds the team to it; a Redis that is away is a 503 to retry."""
    from aenv_api.server.keystore import DEFAULT_TEAM_ID
    from tests.aenv_api.server.inprocess import InProcessServer

    admin = {"X-Admin-Token": "admin-" + "f" * 26}
    srv = InProcessServer.start(tmp_path / "node", admin_token=admin["X-Admin-Token"])
    try:
        async def wire(url: str = fresh.url) -> Coordinator:
            coord = Coordinator(url, FLEET_KEYS)
            srv.server.quotas.publish = lambda team, quota: coord.set_team_quota(team, quota.wire())
            return coord
        node_coord = srv.call(wire())
        path = f"/admin/teams/{DEFAULT_TEAM_ID}/quota"
        status, _, got = srv.request("PUT", path, {"runningSandboxes": 0, "createsPerSecond": 3}, key=None,
                                     headers=admin)
        assert status == 200, got
        assert fresh.client().hgetall(f"aenv:quota:{DEFAULT_TEAM_ID}") == {"runningSandboxes": "0",
                                                                           "createsPerSecond": "3.0"}

        async def gateway_places() -> str:
            gw = Coordinator(fresh.url, FLEET_KEYS)
            await gw.heartbeat("n1", cap(5), 30)
            try:
                await gw.place("base", 256, team=DEFAULT_TEAM_ID)
                return "placed"
            except TeamQuotaExceeded as e:
                return f"{e.kind} {e.limit:g}"
            finally:
                await gw.close()
        assert run(gateway_places()) == "running 0"
        assert srv.request("PUT", path, {}, key=None, headers=admin)[0] == 200     # unlimited: the hash goes
        assert fresh.client().exists(f"aenv:quota:{DEFAULT_TEAM_ID}") == 0
        assert run(gateway_places()) == "placed"
        srv.call(node_coord.close())
        away = srv.call(wire("redis://127.0.0.1:1"))     # nothing listens there: Redis is away
        status, _, got = srv.request("PUT", path, {"runningSandboxes": 1}, key=None, headers=admin)
        assert status == 503 and "send it again" in got["message"]
        srv.call(away.close())
    finally:
        srv.stop()


def test_the_gateway_holds_a_resume_to_the_teams_running_quota() -> None:
    """Connecting to a paused sandbox is a start of its team: refused (no node asked) at the
    running quota, and counted for the team once the node resumed it."""
    from aenv_fleet.coord import TeamGrant
    from aenv_fleet.gateway.forward import Answer
    from aenv_fleet.gateway.placement import DEFAULT_TEAM

    from .test_placement_units import Fleet, body_of, connect_request, moves, node, paused_on, status

    fleet = Fleet(node("n1"))
    fleet.bindings["sbx-1"] = paused_on("n1")
    m, nodes = moves(fleet, {("POST", "http://n1/sandboxes/sbx-1/connect"): [Answer(201, {}, b"{}")]})
    asked: list[bool] = []

    async def none_left(team: str, n: int, create: bool) -> TeamGrant:
        asked.append(create)
        return TeamGrant("rid", 0, TeamQuotaExceeded("running", 3))
    real = fleet.coord.team_reserve
    fleet.coord.team_reserve = none_left     # type: ignore[method-assign]
    got = run(m.connect(connect_request("sbx-1"), "sbx-1", b"{}"))
    assert status(got) == 429 and "concurrent E2B sandboxes (3)" in body_of(got)["message"]
    assert nodes.calls == [] and asked == [False]       # a resume takes no creates-per-second token
    fleet.coord.team_reserve = real          # type: ignore[method-assign]
    assert status(run(m.connect(connect_request("sbx-1"), "sbx-1", b"{}"))) == 201
    assert fleet.coord.settled == [(DEFAULT_TEAM, "sbx-1")]


def test_two_gateways_recording_volumes_at_once_never_exceed_a_teams_volume_bytes(fresh: RedisServer) -> None:
    """A team's volumeBytes quota across the fleet (scripts.py VOLUME_ADD): volumes made on
    any node, recorded by two gateways at once, never sum past it; a volume without a byte
    bound never fits under it; dropping one makes room; a team without the quota is not
    held."""
    mib = 1 << 20

    async def main() -> None:
        gw1, gw2 = Coordinator(fresh.url, FLEET_KEYS), Coordinator(fresh.url, FLEET_KEYS)
        await gw1.set_team_quota("a", {"volumeBytes": 10 * mib})
        rooms = await asyncio.gather(*[(gw1 if i % 2 else gw2).add_volume("a", f"v{i}", f"n{i % 3}", f"vol-{i}",
                                                                          3 * mib) for i in range(12)])
        recorded = [i for i, r in enumerate(rooms) if r.recorded]
        assert len(recorded) == 3, rooms
        refused = [r for r in rooms if not r.recorded]
        assert all(r.limit == 10 * mib and r.held == 9 * mib for r in refused), refused
        assert fresh.client().smembers("aenv:team:a:vols") == {f"v{i}" for i in recorded}
        assert fresh.client().get(f"aenv:volname:vol-{recorded[0]}") == f"v{recorded[0]}"
        assert not (await gw1.add_volume("a", "v-unbounded", "n1", "unbounded", 0)).recorded
        assert (await gw1.add_volume("a", "v-one", "n1", "one", mib)).recorded       # 10 MiB exactly
        assert not (await gw2.add_volume("a", "v-byte", "n1", "byte", 1)).recorded
        assert await gw2.drop_volume(f"v{recorded[0]}") and not await gw2.drop_volume(f"v{recorded[0]}")
        assert fresh.client().get(f"aenv:volname:vol-{recorded[0]}") is None
        assert (await gw1.add_volume("a", "v-again", "n2", "again", 3 * mib)).recorded
        # without the quota: anything, unbounded too; the quota cleared: team a is free again
        assert (await gw1.add_volume("b", "vb", "n1", "b-big", 1 << 50)).recorded
        assert (await gw1.add_volume("b", "vb0", "n1", "b-none", 0)).recorded
        await gw1.set_team_quota("a", {"volumeBytes": None})
        assert (await gw2.add_volume("a", "v-free", "n1", "free", 1 << 40)).recorded
        await gw1.close()
        await gw2.close()
    run(main())


def test_two_gateways_pausing_at_once_never_exceed_a_teams_paused_quota(fresh: RedisServer) -> None:
    """The pausedSandboxes quota across the fleet (TEAM_PAUSE): each gateway reserves a
    pause in one step with the count of the team's paused sandboxes and pauses in flight;
    the node's agent binds it paused; the gateway drops the reservation. Ten pauses at once
    through two gateways under a quota of 3: exactly 3. A resume, a kill or a lost sandbox
    frees a place; a release to the repository keeps it (still paused)."""
    async def main() -> None:
        agent, gw1, gw2 = (Coordinator(fresh.url, FLEET_KEYS) for _ in range(3))
        for n in ("n1", "n2"):
            await agent.heartbeat(n, cap(50), 30)
        sids = [await create(gw1, agent, "a", i) for i in range(10)]
        await gw1.set_team_quota("a", {"pausedSandboxes": 3})

        async def pause(gw: Coordinator, sid: str, i: int, team: str = "a") -> bool:
            try:
                rid = await gw.team_pause(team)
            except TeamQuotaExceeded as e:
                assert e.kind == "paused" and e.limit == 3
                return False
            assert (rid is None) == (team == "b")          # team b has no paused quota: nothing reserved
            try:
                await asyncio.sleep(0.001 * (i % 4))        # the node pausing it
                b = await agent.binding(sid)
                assert b is not None
                await agent.bind(sid, b.node_id, "paused", {})
                return True
            finally:
                if rid is not None:
                    await gw.team_paused(team, rid)
        done = await asyncio.gather(*[pause(gw1 if i % 2 else gw2, sid, i)     # type: ignore[arg-type]
                                      for i, sid in enumerate(sids)])
        paused = [sid for sid, ok in zip(sids, done) if ok]
        assert len(paused) == 3 and await agent.team_paused_ids("a") == set(paused)
        assert fresh.client().zcard("aenv:team:a:presv") == 0
        rest = [sid for sid in sids if sid not in paused]
        assert not await pause(gw1, rest[0], 0)
        # resumed (bound running again): a place is free; the release of another keeps its place
        b = await agent.binding(paused[0])
        await agent.bind(paused[0], b.node_id, "running", {})           # type: ignore[union-attr]
        assert await pause(gw2, rest[0], 0) and not await pause(gw2, rest[1], 0)
        await agent.release(paused[1], (await agent.binding(paused[1])).node_id)   # type: ignore[union-attr]
        assert paused[1] in await agent.team_paused_ids("a") and not await pause(gw1, rest[1], 0)
        await agent.unbind(paused[1], "")                                 # killed in the repository
        assert await pause(gw1, rest[1], 0)
        assert await agent.mark_lost(rest[1], "its node is gone")
        assert await pause(gw1, rest[2], 0)
        assert await agent.team_paused_ids("a") == {paused[2], rest[0], rest[2]}
        # a team without the quota pauses freely
        other = [await create(gw2, agent, "b", 50 + i) for i in range(4)]
        for i, sid in enumerate(other):
            assert await pause(gw2, sid, i, "b")                          # type: ignore[arg-type]
        for c in (agent, gw1, gw2):
            await c.close()
    run(main())
