"""The fleet's teams and keys with a real redis-server (password-protected, as a fleet's
must be): two nodes' key stores (aenv_api/server/shared_keys.py over
aenv_fleet/teams_doc.py) and a gateway's key check (aenv_fleet/gateway/team_auth.py)
sharing one teams document. A key created on one node works on the other and at the
gateway; concurrent changes on two nodes both survive (compare-and-set); a deleted key
fails everywhere within the stated bound; Redis never holds a key in clear."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from aenv_api.server.keystore import DEFAULT_TEAM_ID, KeyStoreError
from aenv_api.server.shared_keys import REFRESH_SECONDS, SharedKeyStore
from aenv_fleet import keys
from aenv_fleet.coord import Coordinator
from aenv_fleet.gateway.team_auth import TeamKeys
from aenv_fleet.teams_doc import RedisTeamsDocument
from aenv_fleet.trust import RedisAuth
from aenv_wire.fleet_auth import FleetKeys

from .redisserver import RedisServer

DEPLOYMENT_KEY = "e2b_" + "d" * 40
FLEET_KEYS = FleetKeys.parse("fleet-keys-test-secret-0123456789")
BOUND = REFRESH_SECONDS + 1.0     # docs/cluster.md: a deleted key fails everywhere within this


@pytest.fixture
def fresh(redis_server: RedisServer) -> RedisServer:
    redis_server.client().flushall()
    return redis_server


def node_store(srv: RedisServer) -> SharedKeyStore:
    return SharedKeyStore(RedisTeamsDocument(srv.bare_url, RedisAuth(password=srv.password), FLEET_KEYS), DEPLOYMENT_KEY)


def test_a_key_made_on_one_node_works_on_another_and_a_deleted_one_fails(fresh: RedisServer) -> None:
    n1, n2 = node_store(fresh), node_store(fresh)
    team = n1.create_team("fleet-a")
    stored, key = n1.create_key(team.team_id, "k")
    assert n1.verify(key) is not None
    assert n2.verify(key) is None              # its copy is older than the key ...
    assert n2.refresh() is True                # ... until it reads the version (at most every REFRESH_SECONDS)
    caller = n2.verify(key)
    assert caller is not None and caller.team_id == team.team_id and caller.key_id == stored.key_id
    assert n2.refresh() is False               # nothing changed: nothing read
    assert n2.verify(DEPLOYMENT_KEY) is not None and n2.verify(DEPLOYMENT_KEY).team_id == DEFAULT_TEAM_ID  # type: ignore[union-attr]
    # n2 renames from its copy while n1 made another change: both survive (compare-and-set, redone)
    n1.create_key(team.team_id, "second")
    n2.rename_key(team.team_id, stored.key_id, "renamed")
    n1.refresh()
    assert sorted(k.name for k in n1.keys(team.team_id)) == ["renamed", "second"]
    # deleted on n2: n1's verified copy goes at its next refresh
    n2.delete_key(team.team_id, stored.key_id)
    assert n2.verify(key) is None
    assert n1.refresh() is True and n1.verify(key) is None
    # names stay unique across the fleet, whichever node is asked
    with pytest.raises(KeyStoreError, match="exists"):
        n1.create_team("fleet-a")


def test_concurrent_creates_on_two_nodes_all_survive(fresh: RedisServer) -> None:
    n1, n2 = node_store(fresh), node_store(fresh)
    team = n1.create_team("busy")
    n2.refresh()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda i: (n1 if i % 2 else n2).create_key(team.team_id, f"k{i}"), range(16)))
    n1.refresh()
    assert sorted(k.name for k in n1.keys(team.team_id)) == sorted(f"k{i}" for i in range(16))
    assert all(n1.verify(key) is not None for _, key in made)
    assert int(fresh.client().hget(keys.TEAMS, "version")) == 17   # one version per change, none lost


def test_a_deleted_key_fails_on_every_node_and_gateway_within_the_bound(fresh: RedisServer) -> None:
    async def main() -> tuple[float, float]:
        n1, n2 = node_store(fresh), node_store(fresh)
        team = await asyncio.to_thread(n1.create_team, "bound")
        stored, key = await asyncio.to_thread(n1.create_key, team.team_id, "k")
        coord = Coordinator(fresh.url, FLEET_KEYS)
        gateway = TeamKeys(coord)
        await coord.add_api_key(DEPLOYMENT_KEY)
        try:
            # a key made a moment ago works at once: a key the copy lacks makes both read Redis now
            assert await gateway.team_of(key) == team.team_id
            assert await gateway.team_of(DEPLOYMENT_KEY) == DEFAULT_TEAM_ID
            assert await gateway.team_of("e2b_" + "0" * 40) is None
            assert await n2.refreshed() and n2.verify(key) is not None
            loop = asyncio.ensure_future(n2.run())      # the node's refresh loop, as ApiServer runs it

            async def gateway_loop() -> None:           # the gateway's (its fleet view's loop)
                while True:
                    await asyncio.sleep(REFRESH_SECONDS)
                    await gateway.refresh()
            gw_loop = asyncio.ensure_future(gateway_loop())
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            await asyncio.to_thread(n1.delete_key, team.team_id, stored.key_id)
            node_gone = gw_gone = None
            while (node_gone is None or gw_gone is None) and time.monotonic() - t0 < 10:
                if node_gone is None and n2.verify(key) is None:
                    node_gone = time.monotonic() - t0
                if gw_gone is None and await gateway.team_of(key) is None:
                    gw_gone = time.monotonic() - t0
                await asyncio.sleep(0.02)
            loop.cancel()
            gw_loop.cancel()
            assert node_gone is not None and gw_gone is not None
            return node_gone, gw_gone
        finally:
            await coord.close()
    node_gone, gw_gone = asyncio.run(main())
    print(f"deleted key refused after: node {node_gone:.2f} s, gateway {gw_gone:.2f} s")
    assert node_gone <= BOUND and gw_gone <= BOUND, (node_gone, gw_gone)


def test_redis_holds_no_key_in_clear(fresh: RedisServer) -> None:
    n1 = node_store(fresh)
    team = n1.create_team("secretive")
    made = [n1.create_key(team.team_id, f"k{i}")[1] for i in range(3)]
    r = fresh.client(decode_responses=False)
    dump = b""
    for k in r.scan_iter("*"):
        kind = r.type(k)
        if kind == b"hash":
            dump += b"".join(a + b for a, b in r.hgetall(k).items())
        elif kind == b"string":
            dump += r.get(k) or b""
        elif kind == b"set":
            dump += b"".join(r.smembers(k))
    assert dump and b"salt" in dump
    for key in made:
        assert key.encode() not in dump and key[4:].encode() not in dump
    aof = b"".join(p.read_bytes() for p in fresh.workdir.rglob("*.aof*") if p.is_file())
    assert all(key[4:].encode() not in aof for key in made)


def test_a_copy_not_known_current_refuses_team_keys_until_redis_answers(
        fresh: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node or gateway cut off from Redis cannot know which keys were deleted meanwhile:
    past STALE_AFTER without reading the version, team keys get 503; the deployment key
    still works; once Redis answers again, so do team keys."""
    from aenv_api.server import shared_keys
    from aenv_fleet.coord import CoordError
    from aenv_fleet.gateway import team_auth
    monkeypatch.setattr(shared_keys, "STALE_AFTER", 0.3)
    monkeypatch.setattr(team_auth, "STALE_AFTER", 0.3)
    node = node_store(fresh)
    team = node.create_team("cut-off")
    _, key = node.create_key(team.team_id, "k")

    async def main() -> None:
        coord = Coordinator(fresh.url, FLEET_KEYS)
        gateway = TeamKeys(coord)
        await coord.add_api_key(DEPLOYMENT_KEY)
        try:
            assert await gateway.team_of(key) == team.team_id
            fresh.kill()
            try:
                with pytest.raises(KeyStoreError):
                    node.refresh()
                with pytest.raises(CoordError):
                    await gateway.refresh()
                await asyncio.sleep(0.4)
                with pytest.raises(KeyStoreError) as refused:
                    node.verify(key)
                assert refused.value.status == 503
                with pytest.raises(CoordError):
                    await gateway.team_of(key)
                assert node.verify(DEPLOYMENT_KEY) is not None
                assert await gateway.team_of(DEPLOYMENT_KEY) == DEFAULT_TEAM_ID
            finally:
                fresh.restart()
            assert node.refresh() is False and node.verify(key) is not None
            await gateway.refresh()
            assert await gateway.team_of(key) == team.team_id
        finally:
            await coord.close()
    asyncio.run(main())


def test_a_document_not_signed_with_the_fleet_secret_or_put_back_is_not_taken(fresh: RedisServer) -> None:
    """Whoever can write Redis but lacks the fleet secret can neither add a key nor bring a
    deleted one back: a forged or an older document is refused by node and gateway."""
    from aenv_fleet.coord import CoordError
    from aenv_fleet.gateway.team_auth import UnusableTeams
    n1, n2 = node_store(fresh), node_store(fresh)
    team = n1.create_team("guarded")
    _, old_key = n1.create_key(team.team_id, "old")
    r = fresh.client()
    old = r.hgetall(keys.TEAMS)
    n1.delete_key(team.team_id, n1.keys(team.team_id)[0].key_id)
    n2.refresh()
    assert n2.verify(old_key) is None
    # a stranger's document: its own key's salted hash, signed with another secret
    stranger = SharedKeyStore(RedisTeamsDocument(fresh.bare_url, RedisAuth(password=fresh.password),
                                                 FleetKeys.parse("not-the-fleet-secret-0123456789")), DEPLOYMENT_KEY)
    with pytest.raises(KeyStoreError):      # it cannot even read the fleet's document
        stranger.create_team("intruder")
    forged = dict(r.hgetall(keys.TEAMS))
    forged_store = SharedKeyStore(RedisTeamsDocument(fresh.bare_url, RedisAuth(password=fresh.password),
                                                     FleetKeys.parse("not-the-fleet-secret-0123456789")),
                                  DEPLOYMENT_KEY)
    r.delete(keys.TEAMS)
    forged_team = forged_store.create_team("intruder")
    _, forged_key = forged_store.create_key(forged_team.team_id, "k")
    r.hset(keys.TEAMS, "version", str(int(forged["version"]) + 5))   # newer than what the fleet has seen
    with pytest.raises(KeyStoreError) as refused:
        n2.refresh()
    assert refused.value.status == 503 and n2.verify(forged_key) is None

    async def at_gateway(expect: type[Exception] | None) -> None:
        coord = Coordinator(fresh.url, FLEET_KEYS)
        try:
            gateway = TeamKeys(coord)
            if expect is None:
                await gateway.refresh()
            else:
                with pytest.raises(expect):
                    await gateway.refresh()
            assert await gateway.team_of(forged_key) is None and await gateway.team_of(old_key) is None
        finally:
            await coord.close()
    asyncio.run(at_gateway(UnusableTeams))
    # the old, signed document put back: a deleted key would return; refused for going back
    r.delete(keys.TEAMS)
    r.hset(keys.TEAMS, mapping=old)
    with pytest.raises(KeyStoreError, match="went back"):
        n2.refresh()
    assert n2.verify(old_key) is None
    assert issubclass(UnusableTeams, CoordError)
