"""Team API keys as every part of a deployment checks them (the node's key store,
aenv_api/server/keystore.py, and a fleet's gateway): the salted hash a key is kept as,
and the keys of a stored teams document (the JSON keystore.py writes: its ``keys``
list, each with ``key_id``, ``team_id``, ``salt`` (hex) and ``digest`` (hex)).

Standard library only, so the gateway reads the fleet's teams document without the
node's API package."""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

DEFAULT_TEAM_ID = "00000000-0000-0000-0000-000000000000"
# the sandbox annotation that names the team owning it (the node's API writes it; a fleet
# node copies it into the sandbox's Redis binding, so a gateway knows the owner too)
TEAM_ANNOTATION = "api.team"


def salted_digest(salt: bytes, key: str) -> str:
    """``HMAC-SHA256(salt, key)`` in hex: what a stored key is kept as."""
    return hmac.new(salt, key.encode(), hashlib.sha256).hexdigest()


def fingerprint(key: str) -> bytes:
    """SHA-256 of a presented key: what a checker's in-memory caches of verified and
    refused keys are keyed by (never the key itself)."""
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class KeyEntry:
    key_id: str
    team_id: str
    salt: bytes
    digest: str

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(salted_digest(self.salt, key), self.digest)


def key_entries(document: str) -> list[KeyEntry]:
    """The keys of a teams document; ValueError when it is not one."""
    raw = json.loads(document)
    if not isinstance(raw, dict) or not isinstance(raw.get("keys"), list):
        raise ValueError("not a teams document")
    try:
        return [KeyEntry(str(k["key_id"]), str(k["team_id"]), bytes.fromhex(str(k["salt"])), str(k["digest"]))
                for k in raw["keys"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed teams document: {e!r}") from None
