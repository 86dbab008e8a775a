"""The fleet's secrets with a real redis-server (password-protected, as a fleet's must
be): two nodes' secret stores (aenv_api/server/secret_store.py over the fleet's secrets
document, aenv_fleet/teams_doc.py ``aenv:secrets``) sharing one document and one secrets
key. A secret made on one node is listed and resolved on the other; changes made on two
nodes at once all survive (compare-and-set); an update or a delete reaches the other
node's egress within the refresh; another team's secret is not there; Redis never holds a
value in clear; a document someone without the fleet secret wrote is not read."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json

import pytest

from aenv_api.server.secret_store import REFRESH_SECONDS, SecretError, SecretStore
from aenv_fleet import keys
from aenv_fleet.teams_doc import RedisTeamsDocument
from aenv_fleet.trust import RedisAuth
from aenv_wire.fleet_auth import FleetKeys

from .redisserver import RedisServer

FLEET_KEYS = FleetKeys.parse("fleet-secrets-test-secret-0123456789")
SECRETS_KEY = bytes(range(32))
VALUE = "sk-live-" + "q" * 24


@pytest.fixture
def fresh(redis_server: RedisServer) -> RedisServer:
    redis_server.client().flushall()
    return redis_server


def node_store(srv: RedisServer, fleet_keys: FleetKeys = FLEET_KEYS) -> SecretStore:
    return SecretStore(None, SECRETS_KEY, shared=RedisTeamsDocument(
        srv.bare_url, RedisAuth(password=srv.password), fleet_keys, key=keys.SECRETS))


def test_a_secret_made_on_one_node_is_resolved_on_another(fresh: RedisServer) -> None:
    n1, n2 = node_store(fresh), node_store(fresh)
    made = n1.create("team-a", "API_TOKEN", VALUE, {"owner": "ci"})
    assert n2.refresh() and [s.secret_id for s in n2.list("team-a")] == [made.secret_id]
    assert n2.resolve("team-a", "api_token") == VALUE.encode()
    assert n2.resolve("team-b", "api_token") is None and n2.list("team-b") == []
    with pytest.raises(SecretError) as e:
        n2.get("team-b", made.secret_id)
    assert e.value.status == 404
    raw = fresh.client().hget(keys.SECRETS, "doc") or ""
    assert VALUE not in raw and "q" * 24 not in raw and json.loads(raw)["secrets"][0]["name"] == "api_token"
    # an update on n2, a delete on n1: each reaches the other with its next refresh
    n2.update("team-a", "api_token", VALUE + "-v2", None)
    assert n1.resolve("team-a", "api_token") == VALUE.encode()      # not refreshed yet
    assert n1.refresh() and n1.resolve("team-a", "api_token") == (VALUE + "-v2").encode()
    n1.delete("team-a", made.secret_id)
    assert n2.refresh() and n2.resolve("team-a", "api_token") is None and not n2.refresh()


def test_changes_on_two_nodes_at_once_all_survive(fresh: RedisServer) -> None:
    n1, n2 = node_store(fresh), node_store(fresh)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda i: (n1 if i % 2 else n2).create("team-a", f"s{i}", f"v{i}", None), range(16)))
    assert len({m.secret_id for m in made}) == 16
    n3 = node_store(fresh)
    assert sorted(s.name for s in n3.list("team-a")) == sorted(f"s{i}" for i in range(16))
    assert all(n3.resolve("team-a", f"s{i}") == f"v{i}".encode() for i in range(16))
    with pytest.raises(SecretError) as e:                            # a name stays unique in the fleet
        n1.create("team-a", "s3", "again", None)
    assert e.value.status == 409


def test_run_keeps_a_nodes_copy_up_to_date(fresh: RedisServer) -> None:
    n1, n2 = node_store(fresh), node_store(fresh)

    async def main() -> None:
        task = asyncio.ensure_future(n2.run())
        try:
            await asyncio.to_thread(n1.create, "team-a", "tok", VALUE, None)
            await asyncio.sleep(REFRESH_SECONDS + 1.0)
            assert n2.resolve("team-a", "tok") == VALUE.encode()
        finally:
            task.cancel()
    asyncio.run(main())


def test_a_document_without_the_fleet_secrets_signature_is_not_read(fresh: RedisServer) -> None:
    n1 = node_store(fresh)
    n1.create("team-a", "tok", VALUE, None)
    # an older signed version written back (a deleted secret would come back): not taken
    old = fresh.client().hgetall(keys.SECRETS)
    n1.create("team-a", "other", VALUE, None)
    n1.delete("team-a", "tok")
    fresh.client().hset(keys.SECRETS, mapping=old)
    with pytest.raises(SecretError) as e:
        n1.refresh()
    assert e.value.status == 503 and "older" in e.value.args[0]
    assert n1.resolve("team-a", "tok") is None and n1.resolve("team-a", "other") == VALUE.encode()
    fresh.client().delete(keys.SECRETS)
    n1 = node_store(fresh)
    n1.create("team-a", "tok", VALUE, None)
    # written by someone with the Redis password but another fleet secret: not the fleet's
    stranger = node_store(fresh, FleetKeys.parse("another-fleets-secret-0123456789"))
    with pytest.raises(SecretError) as e:
        stranger.list("team-a")
    assert e.value.status == 503
    # the teams document's signature does not make a secrets document (nor the reverse)
    fresh.client().hset(keys.SECRETS, mapping={"doc": fresh.client().hget(keys.SECRETS, "doc") or "",
                                                "sig": FLEET_KEYS.teams_mac(1, "x")})
    with pytest.raises(SecretError) as e:
        node_store(fresh).list("team-a")
    assert e.value.status == 503 and "not signed" in e.value.args[0]
    assert n1.resolve("team-a", "tok") == VALUE.encode()          # the copy read last is kept
