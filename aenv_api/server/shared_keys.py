"""Teams and keys of a fleet: the node's key store (keystore.py) over a document every
node and gateway shares (the fleet's Redis, aenv_fleet/teams_doc.py), instead of
``<data-dir>/teams.json``.

The document is keystore.py's JSON (salted key hashes, never a key) with a version that
every change increments. A change is a compare-and-set on that version: one made from a
stale copy (another node changed the document since this one read it) is redone on a
fresh copy, so two nodes creating keys at once both keep theirs.

**How a deleted key stops working everywhere.** The node that deletes it forgets it at
once (keystore.py). Every other node reads the version at least every
``REFRESH_SECONDS`` (``run``): a new version makes it read the document again and
forget every key it verified or refused, so a deleted key fails there within
``REFRESH_SECONDS`` plus one Redis round trip (the gateways do the same,
aenv_fleet/gateway/team_auth.py). A key created on another node is not missed meanwhile:
a key this node does not know makes it read the version at once (``refresh``) before it
answers 401. A node that could not read the version for ``STALE_AFTER`` seconds (Redis
down, or cut off from this node only) refuses every team key with 503 until it reads it
again -- it cannot know which were deleted meanwhile; the deployment key (the default
team's, configured on the node) keeps working."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Callable, Protocol, TypeVar

from .quotas import TeamQuota
from .keystore import DEFAULT_TEAM_ID, Caller, KeyStore, KeyStoreError, StoreContent, StoredKey, Team

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0       # how often a node reads the document's version
MAX_RETRIES = 8             # a change redone on a fresh copy at most this often
STALE_AFTER = 5.0           # seconds without reading the version after which team keys are refused

T = TypeVar("T")


class TeamsDocument(Protocol):
    """Where a fleet keeps its teams document. Every call may raise OSError (the
    store could not be reached, or what it holds is not the fleet's own)."""

    def read(self) -> tuple[str | None, int]:
        """The document (None: none yet) and its version (0: none yet)."""
        ...

    def version(self) -> int:
        ...

    def replace(self, text: str, expected_version: int) -> int | None:
        """Write ``text`` if the version is still ``expected_version``: the new version,
        or None when another writer came first."""
        ...


class StaleCopy(KeyStoreError):
    """The change was made from a copy older than the document (redone by the store)."""

    def __init__(self) -> None:
        super().__init__(409, "the fleet's teams changed on another node meanwhile: try again")


class SharedKeyStore(KeyStore):
    def __init__(self, document: TeamsDocument, default_key: str) -> None:
        self._document = document
        self._version = -1       # of the copy held; -1: none read yet (Redis was down)
        self._confirmed = time.monotonic()     # when the copy was last known current
        super().__init__(Path("fleet-redis:teams"), default_key)

    # --- the document ----------------------------------------------------------

    def _load(self) -> StoreContent:
        try:
            text, version = self._document.read()
        except OSError as e:
            if self._version < 0:
                log.warning("teams: the fleet's teams are not readable yet (%s); retrying", e)
                return StoreContent((), ())
            raise KeyStoreError(503, f"the fleet's teams are not readable: {e}") from None
        if version < self._version:     # an older document put back: a deleted key would come back
            raise KeyStoreError(503, f"the fleet's teams document went back from version {self._version} to "
                                     f"{version}: ignored")
        try:
            content = StoreContent.from_json(text) if text else StoreContent((), ())
        except ValueError as e:
            # a document no node wrote: keep the copy held (or none) rather than guess
            raise KeyStoreError(503, f"the fleet's teams document is not readable: {e}") from None
        self._version = version
        return content

    def _save(self, content: StoreContent) -> None:
        try:
            new = self._document.replace(content.to_json(), max(self._version, 0))
        except OSError as e:
            raise KeyStoreError(503, f"the fleet's Redis is unreachable, nothing changed: {e}") from None
        if new is None:
            raise StaleCopy()
        self._version = new
        self._content = content
        self._confirmed = time.monotonic()

    def refresh(self) -> bool:
        """Read the document again if its version moved; whether it did."""
        try:
            version = self._document.version()
        except OSError as e:
            raise KeyStoreError(503, f"the fleet's teams are not readable: {e}") from None
        changed = version != self._version
        if changed:
            self.reload()
        self._confirmed = time.monotonic()
        return changed

    def verify(self, key: str | None) -> Caller | None:
        """keystore's, and KeyStoreError 503 for a team key while the copy is not known to
        be current (``STALE_AFTER``)."""
        caller = super().verify(key)
        if caller is not None and caller.team_id != DEFAULT_TEAM_ID \
                and time.monotonic() - self._confirmed > STALE_AFTER:
            raise KeyStoreError(503, f"the fleet's teams have not been readable for over {STALE_AFTER:.0f} s: "
                                     f"team keys are refused until Redis answers (a key may have been deleted)")
        return caller

    async def refreshed(self) -> bool:
        """``refresh`` off the event loop; False when Redis does not answer."""
        try:
            return await asyncio.to_thread(self.refresh)
        except KeyStoreError:
            return False

    async def run(self) -> None:
        """Keep the copy within ``REFRESH_SECONDS`` of the document (until cancelled)."""
        failing = False
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await asyncio.to_thread(self.refresh)
                failing = False
            except KeyStoreError as e:
                if not failing:
                    log.warning("teams: %s (keeping the copy read last)", e)
                failing = True

    # --- changes, redone on a fresh copy when another node came first -----------

    def _redone(self, change: Callable[[], T]) -> T:
        for _ in range(MAX_RETRIES):
            try:
                return change()
            except StaleCopy:
                self.reload()
        raise StaleCopy()

    def create_team(self, name: str) -> Team:
        return self._redone(lambda: super(SharedKeyStore, self).create_team(name))

    def delete_team(self, team_id: str) -> None:
        self._redone(lambda: super(SharedKeyStore, self).delete_team(team_id))

    def create_key(self, team_id: str, name: str) -> tuple[StoredKey, str]:
        return self._redone(lambda: super(SharedKeyStore, self).create_key(team_id, name))

    def rename_key(self, team_id: str, key_id: str, name: str) -> StoredKey:
        return self._redone(lambda: super(SharedKeyStore, self).rename_key(team_id, key_id, name))

    def delete_key(self, team_id: str, key_id: str) -> None:
        self._redone(lambda: super(SharedKeyStore, self).delete_key(team_id, key_id))

    def set_quota(self, team_id: str, quota: TeamQuota) -> TeamQuota:
        return self._redone(lambda: super(SharedKeyStore, self).set_quota(team_id, quota))
