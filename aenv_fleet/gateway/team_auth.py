"""Who a request to the gateway is: the deployment's key (the default team; its
unsalted SHA-256 is in ``aenv:apikeys``, written by every node) or a team key of the
fleet's teams document (``aenv:teams``: salted hashes, aenv_wire/team_keys.py), which
the nodes write (aenv_api/server/shared_keys.py).

The gateway keeps a copy of the document's keys and its version. ``refresh`` (the fleet
view's loop, every second) reads the version and, when it moved, the keys again and
forgets every key it verified or refused: a key deleted on any node fails here within
that second plus a Redis round trip. A key the copy does not know makes the gateway
read the version at once before it answers 401, so a key just created works at once. A
gateway that could not read the version for ``STALE_AFTER`` seconds refuses team keys
(503, as anything else that needs Redis) until it reads it again: it cannot know which
were deleted meanwhile."""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import time
from collections import OrderedDict

from redis.exceptions import RedisError

from aenv_wire.team_keys import DEFAULT_TEAM_ID, KeyEntry, fingerprint, key_entries

from .. import keys
from ..coord import CoordError, Coordinator
from ..teams_doc import ForgedDocument, checked

log = logging.getLogger(__name__)

TEAM_KEY = "team"       # request[TEAM_KEY]: the caller's team, once its key checked out (app.py)
STALE_AFTER = 5.0       # seconds without reading the version after which team keys are refused
MAX_REFUSED = 4096      # refused keys remembered (a client repeating a junk key costs no HMACs)


class UnusableTeams(CoordError):
    """Redis answers, but its teams document is not the fleet's own (forged, or put back)."""


class TeamKeys:
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.version = -1                  # of the copy held; -1: none read yet
        self.deployment_digests: set[str] = set()
        self._entries: list[KeyEntry] = []
        self._verified: dict[bytes, str] = {}       # fingerprint of a verified key -> its team
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._confirmed = time.monotonic()     # when the copy was last known current

    async def refresh(self) -> bool:
        """Read the document again if its version moved (CoordError: Redis did not answer)."""
        try:
            async with self.coord.redis.pipeline(transaction=False) as p:
                p.smembers(keys.APIKEYS)
                p.hget(keys.TEAMS, "version")
                digests, version = await p.execute()
            self.deployment_digests = set(digests)
            if int(version or 0) == self.version:
                self._confirmed = time.monotonic()
                return False
            async with self.coord.redis.pipeline(transaction=False) as p:
                p.hmget(keys.TEAMS, ["doc", "version", "sig"])
                (doc, version, sig), = await p.execute()
        except (RedisError, OSError) as e:
            raise CoordError(f"redis {self.coord.url}: {e}") from None
        version = int(version or 0)
        try:
            if version < self.version:      # an older document put back: a deleted key would come back
                raise ValueError(f"the document went back from version {self.version} to {version}")
            doc = checked(self.coord.fleet_keys, doc, version, sig)
            entries = key_entries(doc) if doc else []
        except (ValueError, ForgedDocument) as e:
            # the copy is no longer known current: team keys are refused after STALE_AFTER
            raise UnusableTeams(f"the fleet's teams document is not usable: {e}") from None
        self._entries, self.version = entries, version
        self._verified.clear()
        self._refused.clear()
        self._confirmed = time.monotonic()
        return True

    def _check(self, key: str) -> str | None:
        digest = hashlib.sha256(key.encode()).hexdigest()
        if any(hmac.compare_digest(digest, d) for d in self.deployment_digests):
            return DEFAULT_TEAM_ID
        fp = fingerprint(key)
        if fp in self._verified:
            return self._verified[fp]
        if fp in self._refused:
            return None
        for e in self._entries:
            if e.matches(key):
                self._verified[fp] = e.team_id
                return e.team_id
        self._refused[fp] = None
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)
        return None

    async def team_of(self, key: str | None) -> str | None:
        """The team ``key`` belongs to, or None (no such key); CoordError for a team key
        while the copy is not known to be current (``STALE_AFTER``)."""
        if not key:
            return None
        team = self._check(key)
        if team is None:
            with contextlib.suppress(CoordError):   # a key made since the last refresh
                await self.refresh()
                team = self._check(key)
        if team is not None and team != DEFAULT_TEAM_ID and time.monotonic() - self._confirmed > STALE_AFTER:
            raise CoordError(f"the fleet's teams have not been readable for over {STALE_AFTER:.0f} s: team keys "
                             f"are refused until Redis answers")
        return team
