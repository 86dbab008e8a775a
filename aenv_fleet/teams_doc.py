"""The fleet's shared documents in Redis: the teams document (``aenv:teams``: the JSON
of the node's key store, aenv_api/server/keystore.py) and the secrets document
(``aenv:secrets``: the JSON of the node's secret store, its values sealed with the
deployment's secrets key, aenv_api/server/secret_store.py). Each is a hash of the
document, a version every change increments, and the signature of both with the fleet
secret's teams key (aenv_wire/fleet_auth.py; a document other than the teams one is
signed with its Redis key in front, so one cannot pass for another), as a node's store
reads and writes it (aenv_api/server/shared_keys.py ``TeamsDocument``). A document
whose signature fails (someone without the fleet secret wrote it) is not read:
``ForgedDocument``.

Synchronous on purpose: the key store's changes run in a worker thread (an fsync'd file
on a lone node), so its Redis calls do too, on a small connection pool of their own.
A change is a compare-and-set on the version (one Lua script: atomic in Redis)."""
from __future__ import annotations

from typing import cast

import redis
from redis.exceptions import RedisError

from aenv_wire.fleet_auth import FleetKeys

from . import keys
from .trust import RedisAuth, without_credentials

# KEYS[1] the hash; ARGV[1] the expected version, ARGV[2] the new document, ARGV[3] its
# signature as version ARGV[1] + 1
REPLACE = """
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if v ~= tonumber(ARGV[1]) then return -1 end
redis.call('HSET', KEYS[1], 'doc', ARGV[2], 'version', tostring(v + 1), 'sig', ARGV[3])
return v + 1
"""
TIMEOUT = 2.0   # seconds: a Redis that does not answer fails a change (503) rather than hang it


class ForgedDocument(OSError):
    """A document in Redis is not signed with the fleet secret."""


def _signed(key: str, doc: str) -> str:
    """What a document's signature covers: the teams document as it always was, any
    other with its Redis key in front."""
    return doc if key == keys.TEAMS else f"{key}\n{doc}"


def checked(fleet_keys: FleetKeys, doc: str | None, version: int, sig: str | None,
            key: str = keys.TEAMS) -> str | None:
    """``doc`` if its signature as ``version`` is good (None and version 0: no document
    yet); ForgedDocument otherwise."""
    if doc is None and version == 0:
        return None
    if doc is None or not sig or not fleet_keys.teams_ok(version, _signed(key, doc), sig):
        raise ForgedDocument(f"the fleet's document {key} (version {version}) is not signed with the fleet "
                             f"secret: someone without it wrote Redis; ignored")
    return doc


class RedisTeamsDocument:
    """One signed, versioned document of the fleet (``key``: ``aenv:teams`` by default)."""

    def __init__(self, url: str, auth: RedisAuth, fleet_keys: FleetKeys, key: str = keys.TEAMS) -> None:
        self.url = without_credentials(url)
        self.fleet_keys = fleet_keys
        self.key = key
        self.redis = redis.Redis.from_url(url, decode_responses=True, socket_timeout=TIMEOUT,
                                          socket_connect_timeout=TIMEOUT, **auth.client_kwargs())
        self._replace = self.redis.register_script(REPLACE)

    def read(self) -> tuple[str | None, int]:
        try:
            # redis-py types its sync and async replies as one union: this client's are sync
            doc, version, sig = cast("list[str | None]", self.redis.hmget(self.key, ["doc", "version", "sig"]))
        except RedisError as e:
            raise OSError(f"redis {self.url}: {e}") from None
        return checked(self.fleet_keys, doc, int(version or 0), sig, self.key), int(version or 0)

    def version(self) -> int:
        try:
            return int(cast("str | None", self.redis.hget(self.key, "version")) or 0)
        except RedisError as e:
            raise OSError(f"redis {self.url}: {e}") from None

    def replace(self, text: str, expected_version: int) -> int | None:
        try:
            new = int(self._replace(keys=[self.key], args=[
                expected_version, text, self.fleet_keys.teams_mac(expected_version + 1, _signed(self.key, text))]))
        except RedisError as e:
            raise OSError(f"redis {self.url}: {e}") from None
        return None if new < 0 else new

    def close(self) -> None:
        self.redis.close()
