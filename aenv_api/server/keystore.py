"""A node's teams and their API keys (E2B's ``/teams`` and ``/api-keys``).

Every API key belongs to one team. The **default team** (``DEFAULT_TEAM_ID``, the nil
UUID, so every node names it alike) owns the deployment's key (``AENV_API_KEY`` / its
file, auth.py), which keeps working as it always has; it is not stored here. Other
teams and every key created through the API live in ``<data-dir>/teams.json``.

**Keys are never stored in clear.** A key is ``e2b_`` + 40 random hex digits (160
bits); the file keeps ``HMAC-SHA256(salt, key)`` with a random 16-byte salt per key,
plus E2B's mask (the key's first 2 and last 4 hex digits: 24 of its 160 bits). A fast
keyed hash and not scrypt: a 160-bit random key cannot be guessed however cheap a
guess is, so a deliberately slow hash would only cost every request; the salt keeps
two stores (or two keys) from being compared by hash. A presented key is checked
against every stored hash (one HMAC each, ~2 µs); a verified key is then kept in an
in-memory map from its SHA-256 to its (team, key id), emptied whenever a key or team
is deleted, so a deleted key fails at once, and stays out of any log. A key that
matched none is remembered too (the newest ``MAX_REFUSED``, until a key is created), so
a client repeating a junk key costs no HMACs.

The file is rewritten whole, crash-safely: a temporary file, fsync, rename over the
old one, fsync of the directory; mode 0600. A torn or foreign file is refused at
start (``ConfigError``) rather than read as "no keys".
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aenv_store.errors import ConfigError
from aenv_wire.team_keys import DEFAULT_TEAM_ID, salted_digest

from .quotas import TeamQuota

DEFAULT_TEAM_NAME = "default"
DEFAULT_KEY_ID = "00000000-0000-0000-0000-000000000001"    # the deployment key in /api-keys lists
TEAMS_FILE = "teams.json"
FORMAT_VERSION = 1
KEY_PREFIX = "e2b_"
MAX_NAME = 200
MAX_REFUSED = 4096      # refused keys remembered


class KeyStoreError(Exception):
    """A refused change; ``status`` is the HTTP answer (404 unknown id, 409 conflict, 400 bad name)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KeyMask:
    """E2B's ``IdentifierMaskingDetails``: enough to recognise a key, never to use it."""

    prefix: str
    value_length: int
    masked_value_prefix: str
    masked_value_suffix: str

    @classmethod
    def of(cls, key: str) -> "KeyMask":
        prefix = KEY_PREFIX if key.startswith(KEY_PREFIX) else ""
        value = key[len(prefix):]
        return cls(prefix, len(value), value[:2], value[-4:])

    def wire(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "valueLength": self.value_length,
                "maskedValuePrefix": self.masked_value_prefix, "maskedValueSuffix": self.masked_value_suffix}

    def text(self) -> str:
        return f"{self.prefix}{self.masked_value_prefix}…{self.masked_value_suffix}"


@dataclass(frozen=True)
class Team:
    team_id: str
    name: str
    created: float

    @property
    def is_default(self) -> bool:
        return self.team_id == DEFAULT_TEAM_ID


@dataclass(frozen=True)
class StoredKey:
    """One API key as the store keeps it: its salted hash, never the key."""

    key_id: str
    team_id: str
    name: str
    salt: str           # hex, 16 random bytes
    digest: str         # hex HMAC-SHA256(salt, key)
    mask: KeyMask
    created: float

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(_digest(bytes.fromhex(self.salt), key), self.digest)


@dataclass(frozen=True)
class Caller:
    """Who a request's API key says it is."""

    team_id: str
    key_id: str


def _digest(salt: bytes, key: str) -> str:
    return salted_digest(salt, key)


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_hex(20)


def _name(value: str, what: str) -> str:
    name = value.strip()
    if not name or len(name) > MAX_NAME or any(ord(c) < 32 for c in name):
        raise KeyStoreError(400, f"{what} must be 1..{MAX_NAME} printable characters")
    return name


@dataclass(frozen=True)
class StoreContent:
    """What ``teams.json`` holds (the default team and its key are implicit). ``quotas``:
    the teams whose quota the admin set (quotas.py; a file without it: none set)."""

    teams: tuple[Team, ...]
    keys: tuple[StoredKey, ...]
    quotas: tuple[tuple[str, TeamQuota], ...] = ()

    def to_json(self) -> str:
        def key_json(k: StoredKey) -> dict[str, Any]:
            return {**asdict(k), "mask": asdict(k.mask)}
        return json.dumps({"version": FORMAT_VERSION, "teams": [asdict(t) for t in self.teams],
                           "keys": [key_json(k) for k in self.keys],
                           "quotas": {tid: q.wire() for tid, q in self.quotas}}, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "StoreContent":
        """ValueError for anything ``to_json`` did not write."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a version {FORMAT_VERSION} teams file")
        try:
            teams = tuple(Team(str(t["team_id"]), str(t["name"]), float(t["created"])) for t in raw["teams"])
            keys = tuple(StoredKey(str(k["key_id"]), str(k["team_id"]), str(k["name"]), str(k["salt"]),
                                   str(k["digest"]), KeyMask(**k["mask"]), float(k["created"]))
                         for k in raw["keys"])
            quotas = tuple((str(tid), TeamQuota.from_wire(q)) for tid, q in dict(raw.get("quotas", {})).items())
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed teams file: {e!r}") from None
        known = {t.team_id for t in teams} | {DEFAULT_TEAM_ID}
        if any(k.team_id not in known for k in keys):
            raise ValueError("a key names a team the file does not have")
        if any(tid not in known for tid, _ in quotas):
            raise ValueError("a quota names a team the file does not have")
        return cls(teams, keys, quotas)


def write_durably(path: Path, text: str) -> None:
    """``text`` as ``path``'s whole content, or the old content after a crash: never torn."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)       # the rename itself survives a power cut
    finally:
        os.close(dfd)


class KeyStore:
    """Teams and keys of one node. Thread-safe; changes are durable when a method returns."""

    def __init__(self, path: Path, default_key: str) -> None:
        self.path = path
        self._default_key = default_key
        self._lock = threading.Lock()
        self._verified: dict[bytes, Caller] = {}    # SHA-256 of a verified key → who it is
        # SHA-256 of keys that matched none, newest last: a client retrying a junk key costs one
        # dict lookup, not an HMAC per stored key; emptied when a key is created
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._content = self._load()

    def _load(self) -> StoreContent:
        try:
            return StoreContent.from_json(self.path.read_text())
        except FileNotFoundError:
            return StoreContent((), ())
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the teams file {self.path}: {e}") from None

    def _save(self, content: StoreContent) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_durably(self.path, content.to_json())
        self._content = content

    def reload(self) -> None:
        """Read the store again (another process changed it): every key verified or
        refused so far is checked afresh."""
        with self._lock:     # not between a change's read and its write
            self._content = self._load()
            self._verified.clear()
            self._refused.clear()

    # --- authentication ------------------------------------------------------

    def verify(self, key: str | None) -> Caller | None:
        """The team and key ``key`` is, or None."""
        if not key:
            return None
        if hmac.compare_digest(key.encode(), self._default_key.encode()):
            return Caller(DEFAULT_TEAM_ID, DEFAULT_KEY_ID)
        fingerprint = hashlib.sha256(key.encode()).digest()
        known = self._verified.get(fingerprint)
        if known is not None:
            return known
        if fingerprint in self._refused:
            return None
        content = self._content
        for stored in content.keys:
            if stored.matches(key):
                caller = Caller(stored.team_id, stored.key_id)
                with self._lock:
                    if self._content is content:     # not deleted meanwhile
                        self._verified[fingerprint] = caller
                return caller
        with self._lock:
            if self._content is content:             # no key created meanwhile
                self._refused[fingerprint] = None
                while len(self._refused) > MAX_REFUSED:
                    self._refused.popitem(last=False)
        return None

    # --- teams ---------------------------------------------------------------

    def teams(self) -> list[Team]:
        return [Team(DEFAULT_TEAM_ID, DEFAULT_TEAM_NAME, 0.0), *self._content.teams]

    def team(self, team_id: str) -> Team:
        for t in self.teams():
            if t.team_id == team_id:
                return t
        raise KeyStoreError(404, f"team {team_id!r} not found")

    def create_team(self, name: str) -> Team:
        name = _name(name, "a team's name")
        with self._lock:
            if any(t.name == name for t in self.teams()):
                raise KeyStoreError(409, f"a team named {name!r} exists")
            team = Team(str(uuid.uuid4()), name, time.time())
            self._save(dataclasses.replace(self._content, teams=self._content.teams + (team,)))
        return team

    def delete_team(self, team_id: str) -> None:
        """The team and all its keys (its keys fail from now on)."""
        with self._lock:
            if team_id == DEFAULT_TEAM_ID:
                raise KeyStoreError(409, "the default team cannot be deleted")
            self.team(team_id)
            c = self._content
            self._save(StoreContent(tuple(t for t in c.teams if t.team_id != team_id),
                                    tuple(k for k in c.keys if k.team_id != team_id),
                                    tuple(q for q in c.quotas if q[0] != team_id)))
            self._verified.clear()

    # --- keys ----------------------------------------------------------------

    def keys(self, team_id: str) -> list[StoredKey]:
        self.team(team_id)
        out = [k for k in self._content.keys if k.team_id == team_id]
        if team_id == DEFAULT_TEAM_ID:
            out.insert(0, StoredKey(DEFAULT_KEY_ID, DEFAULT_TEAM_ID, "deployment key", "", "",
                                    KeyMask.of(self._default_key), 0.0))
        return out

    def create_key(self, team_id: str, name: str) -> tuple[StoredKey, str]:
        """A new key of ``team_id``: its record and the key itself (shown this once)."""
        name = _name(name, "a key's name")
        key = generate_key()
        salt = secrets.token_bytes(16)
        with self._lock:
            self.team(team_id)
            stored = StoredKey(str(uuid.uuid4()), team_id, name, salt.hex(), _digest(salt, key), KeyMask.of(key),
                               time.time())
            self._save(dataclasses.replace(self._content, keys=self._content.keys + (stored,)))
            self._refused.clear()
        return stored, key

    def _key(self, team_id: str, key_id: str) -> StoredKey:
        if key_id == DEFAULT_KEY_ID and team_id == DEFAULT_TEAM_ID:
            raise KeyStoreError(409, "the deployment key is configured (AENV_API_KEY or [server] api_key_file), "
                                     "not managed through the API")
        for k in self._content.keys:
            if k.key_id == key_id and k.team_id == team_id:
                return k
        raise KeyStoreError(404, f"API key {key_id!r} not found")

    def rename_key(self, team_id: str, key_id: str, name: str) -> StoredKey:
        name = _name(name, "a key's name")
        with self._lock:
            old = self._key(team_id, key_id)
            new = StoredKey(old.key_id, old.team_id, name, old.salt, old.digest, old.mask, old.created)
            self._save(dataclasses.replace(
                self._content, keys=tuple(new if k.key_id == key_id else k for k in self._content.keys)))
        return new

    def delete_key(self, team_id: str, key_id: str) -> None:
        with self._lock:
            self._key(team_id, key_id)
            self._save(dataclasses.replace(
                self._content, keys=tuple(k for k in self._content.keys if k.key_id != key_id)))
            self._verified.clear()

    # --- quotas (quotas.py) ----------------------------------------------------

    def quota(self, team_id: str) -> TeamQuota:
        """``team_id``'s quota (unlimited when none was set). Hot path of every create: a scan
        of the teams that have one."""
        for tid, q in self._content.quotas:
            if tid == team_id:
                return q
        return TeamQuota()

    def set_quota(self, team_id: str, quota: TeamQuota) -> TeamQuota:
        with self._lock:
            self.team(team_id)
            kept = tuple(q for q in self._content.quotas if q[0] != team_id)
            self._save(dataclasses.replace(self._content,
                                           quotas=kept if quota.unlimited else kept + ((team_id, quota),)))
        return quota
