"""A node's secrets (E2B's ``/secrets``): named, versioned values owned by a team,
encrypted at rest, never shown by any route and never logged.

**Where and how.** ``<data-dir>/secrets.json``, rewritten whole crash-safely
(keystore.py ``write_durably``, mode 0600); on a fleet node the same JSON is the
fleet's secrets document in its Redis (``aenv:secrets``, signed with the fleet secret:
aenv_fleet/teams_doc.py), so every node serves and resolves every secret. Every version's value is sealed with
AES-256-GCM under the deployment's secrets key (``AENV_SECRETS_KEY`` or ``[server]
secrets_key_file``: 32 bytes as 64 hex digits; never the config file, never
generated), a fresh 96-bit nonce each, and the secret's team, id and version as
associated data, so a sealed value copied to another secret, version or team fails
to open. Without the key the store does not exist (``SecretsUnavailable``: the routes
answer 503 saying how to configure it).

**What a record holds.** id (``sec_`` + 24 hex digits), team, name (``[a-z0-9_-]``,
lower-cased, 1..128, unique in the team, not ``sec_...``), metadata (E2B's limits:
32 entries, keys 128 bytes, values 1024, 8192 in all), created/updated times, and
its versions (the newest ``MAX_VERSIONS`` kept; ``currentVersion`` counts on).

A lookup of another team's secret answers as for one that does not exist (404).
``resolve`` (the egress proxy's question) opens the current version of a team's
secret by name.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from aenv_store.errors import ConfigError
from aenv_wire.secret_markers import MAX_NAME

from .keystore import write_durably
from .shared_keys import MAX_RETRIES, REFRESH_SECONDS, TeamsDocument

log = logging.getLogger(__name__)

SECRETS_FILE = "secrets.json"
SECRETS_KEY_ENV = "AENV_SECRETS_KEY"
FORMAT_VERSION = 1
ID_PREFIX = "sec_"
MAX_VALUE = 16 << 10            # bytes of one value (an API token, a PEM key)
MAX_VERSIONS = 10               # versions kept per secret (the newest)
MAX_SECRETS = 1000              # per team
MAX_META_ENTRIES, MAX_META_KEY, MAX_META_VALUE, MAX_META_TOTAL = 32, 128, 1024, 8192
_NAME = re.compile(rf"^[a-z0-9_-]{{1,{MAX_NAME}}}$")
_ID = re.compile(r"^sec_[0-9a-f]{24}$")
CONFIGURE = (f"set {SECRETS_KEY_ENV} or [server] secrets_key_file to 32 random bytes as 64 hex digits "
             f"(e.g. `openssl rand -hex 32`) and restart the node")


class SecretError(Exception):
    """A refused request; ``status`` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_key(text: str, where: str) -> bytes:
    """The 32-byte key of its 64 hex digits; ConfigError naming ``where`` otherwise."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError(f"the secrets key ({where}) must be 32 bytes as 64 hex digits")
    return key


def load_key(environ: Mapping[str, str], path: Path | None) -> bytes | None:
    """The deployment's secrets key: ``AENV_SECRETS_KEY``, else the file; None when neither is set."""
    if environ.get(SECRETS_KEY_ENV, "").strip():
        return parse_key(environ[SECRETS_KEY_ENV], SECRETS_KEY_ENV)
    if path is None:
        return None
    try:
        return parse_key(path.read_text(), str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"server.secrets_key_file: cannot read {path}: {e}") from None


@dataclass(frozen=True)
class Version:
    version: int
    nonce: str          # hex
    sealed: str         # hex: AES-GCM ciphertext and tag
    created: float


@dataclass(frozen=True)
class Secret:
    secret_id: str
    team_id: str
    name: str
    metadata: tuple[tuple[str, str], ...]
    created: float
    updated: float
    versions: tuple[Version, ...]

    @property
    def current(self) -> int:
        return self.versions[-1].version


def check_name(raw: str) -> str:
    name = raw.lower()
    if not _NAME.match(name):
        raise SecretError(400, f"name: a secret's name is 1..{MAX_NAME} characters of letters, digits, '_' "
                               f"and '-'")
    if name.startswith(ID_PREFIX):
        raise SecretError(400, f"name: the {ID_PREFIX} prefix is reserved for secret identifiers")
    return name


def check_metadata(raw: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if len(raw) > MAX_META_ENTRIES:
        raise SecretError(400, f"metadata: at most {MAX_META_ENTRIES} entries")
    total = 0
    for k, v in raw.items():
        if not isinstance(v, str):
            raise SecretError(400, "metadata: values are strings")
        kb, vb = len(k.encode()), len(v.encode())
        if kb > MAX_META_KEY or vb > MAX_META_VALUE:
            raise SecretError(400, f"metadata: keys are at most {MAX_META_KEY} bytes, values {MAX_META_VALUE}")
        total += kb + vb
    if total > MAX_META_TOTAL:
        raise SecretError(400, f"metadata: at most {MAX_META_TOTAL} bytes in all")
    return tuple(sorted(raw.items()))


def _check_value(value: str) -> bytes:
    raw = value.encode()
    if not raw or len(raw) > MAX_VALUE:
        raise SecretError(400, f"value: 1..{MAX_VALUE} bytes")
    return raw


def _to_json(items: tuple[Secret, ...]) -> str:
    def one(s: Secret) -> dict[str, Any]:
        return {**dataclasses.asdict(s), "metadata": dict(s.metadata)}
    return json.dumps({"version": FORMAT_VERSION, "secrets": [one(s) for s in items]}, sort_keys=True, indent=1)


def _from_json(text: str) -> tuple[Secret, ...]:
    raw = json.loads(text)
    if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION:
        raise ValueError(f"not a version {FORMAT_VERSION} secrets file")
    try:
        return tuple(Secret(str(s["secret_id"]), str(s["team_id"]), str(s["name"]),
                            tuple(sorted((str(k), str(v)) for k, v in dict(s["metadata"]).items())),
                            float(s["created"]), float(s["updated"]),
                            tuple(Version(int(v["version"]), str(v["nonce"]), str(v["sealed"]),
                                          float(v["created"])) for v in s["versions"]))
                     for s in raw["secrets"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed secrets file: {e!r}") from None


def _find(items: tuple[Secret, ...], team_id: str, ref: str) -> Secret:
    """``team_id``'s secret named or identified by ``ref``; 404 otherwise (another team's too)."""
    by_id = bool(_ID.match(ref))
    name = ref.lower()
    for s in items:
        if s.team_id == team_id and (s.secret_id == ref if by_id else s.name == name):
            return s
    raise SecretError(404, f"secret {ref[:140]!r} not found")


T = TypeVar("T")
Change = Callable[[tuple[Secret, ...]], tuple[tuple[Secret, ...], T]]


class SecretStore:
    """The secrets of one node, or of a fleet (``shared``: the fleet's secrets document,
    aenv_fleet/teams_doc.py, every node holding the same secrets key). Thread-safe; a
    change is durable when its method returns.

    Shared: a change is made on a fresh copy of the document and written by compare-and-set
    on its version (redone on a newer copy when another node came first, as the teams
    document's: shared_keys.py); reads use this node's copy, which ``run`` brings up to
    date every ``REFRESH_SECONDS``: a secret changed or deleted on one node is resolved so
    on every other within that (while Redis answers; a node cut off keeps its last copy)."""

    def __init__(self, path: Path | None, key: bytes, shared: TeamsDocument | None = None) -> None:
        self.path = path
        self._aead = AESGCM(key)
        self._lock = threading.Lock()
        self._shared = shared
        self._items: tuple[Secret, ...] = ()
        self._version = -1          # of the shared document this copy is (-1: not read yet)
        self._unread = ""           # why it could not be read yet
        if shared is not None:
            try:
                self._items, self._version = self._read_shared()
            except SecretError as e:    # Redis away at start: ``run`` reads it later
                self._unread = str(e)
            return
        assert path is not None
        try:
            self._items = _from_json(path.read_text())
        except FileNotFoundError:
            self._items = ()
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the secrets file {path}: {e}") from None

    @property
    def shared(self) -> bool:
        """The fleet's secrets (a document in its Redis), not this node's file."""
        return self._shared is not None

    def _read_shared(self) -> tuple[tuple[Secret, ...], int]:
        assert self._shared is not None
        try:
            doc, version = self._shared.read()
            items = _from_json(doc) if doc is not None else ()
        except (OSError, ValueError) as e:
            raise SecretError(503, f"the fleet's secrets cannot be read: {e}") from None
        if version < self._version:     # a signed document, but an old one: a deleted secret would come back
            raise SecretError(503, f"the fleet's secrets document in Redis (version {version}) is older than the "
                                   f"one this node read last ({self._version}): not taken")
        return items, version

    def _change(self, change: "Change[T]") -> T:
        """Apply ``change`` to the current secrets and keep what it made, durably."""
        with self._lock:
            if self._shared is None:
                items, result = change(self._items)
                assert self.path is not None
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_durably(self.path, _to_json(items))
                self._items = items
                return result
            for _ in range(MAX_RETRIES):
                current, version = self._read_shared()
                items, result = change(current)
                try:
                    written = self._shared.replace(_to_json(items), version)
                except OSError as e:
                    raise SecretError(503, f"the fleet's secrets cannot be written: {e}") from None
                if written is not None:
                    self._items, self._version = items, written
                    return result
            raise SecretError(503, f"the fleet's secrets changed under each of {MAX_RETRIES} tries: send it again")

    def refresh(self) -> bool:
        """A shared store: read the document again if its version moved (True then). OSError
        or SecretError when Redis cannot be reached."""
        if self._shared is None or self._shared.version() == self._version:
            return False
        with self._lock:
            try:
                self._items, self._version = self._read_shared()
            except SecretError as e:
                self._unread = str(e)
                raise
        return True

    async def run(self) -> None:
        """Keep a shared store's copy up to date (until cancelled)."""
        failing = False
        while True:
            try:
                await asyncio.to_thread(self.refresh)
                failing = False
            except (OSError, SecretError) as e:
                if not failing:
                    log.warning("secrets: the fleet's document is not readable (keeping the copy read last): %s", e)
                failing = True
            await asyncio.sleep(REFRESH_SECONDS)

    def _ready(self) -> None:
        if self._shared is not None and self._version < 0:
            raise SecretError(503, f"the fleet's secrets have not been read from its Redis yet ({self._unread}): "
                                   f"retry")

    @staticmethod
    def _ad(team_id: str, secret_id: str, version: int) -> bytes:
        return f"aenv secret v1\0{team_id}\0{secret_id}\0{version}".encode()

    def _seal(self, team_id: str, secret_id: str, version: int, value: bytes) -> Version:
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, value, self._ad(team_id, secret_id, version))
        return Version(version, nonce.hex(), sealed.hex(), time.time())

    # --- reading ---------------------------------------------------------------

    def list(self, team_id: str) -> list[Secret]:
        """``team_id``'s secrets, oldest first (ties by id)."""
        self._ready()
        return sorted((s for s in self._items if s.team_id == team_id), key=lambda s: (s.created, s.secret_id))

    def get(self, team_id: str, ref: str) -> Secret:
        """``team_id``'s secret named or identified by ``ref``; 404 otherwise (another team's too)."""
        self._ready()
        return _find(self._items, team_id, ref)

    def exists(self, team_id: str, name: str) -> bool:
        self._ready()
        return any(s.team_id == team_id and s.name == name for s in self._items)

    def resolve(self, team_id: str, name: str) -> bytes | None:
        """The current value of ``team_id``'s secret ``name`` (lower-case), None if it has none."""
        for s in self._items:
            if s.team_id == team_id and s.name == name:
                v = s.versions[-1]
                try:
                    return self._aead.decrypt(bytes.fromhex(v.nonce), bytes.fromhex(v.sealed),
                                              self._ad(team_id, s.secret_id, v.version))
                except (InvalidTag, ValueError):
                    return None     # another key's file, or a tampered one: no value
        return None

    # --- changes ---------------------------------------------------------------

    def create(self, team_id: str, name: str, value: str, metadata: Mapping[str, Any] | None) -> Secret:
        name = check_name(name)
        meta = check_metadata(metadata)
        raw = _check_value(value)

        def change(items: tuple[Secret, ...]) -> tuple[tuple[Secret, ...], Secret]:
            if any(s.team_id == team_id and s.name == name for s in items):
                raise SecretError(409, f"a secret named {name!r} exists")
            if sum(1 for s in items if s.team_id == team_id) >= MAX_SECRETS:
                raise SecretError(409, f"a team keeps at most {MAX_SECRETS} secrets")
            sid = ID_PREFIX + secrets.token_hex(12)
            now = time.time()
            made = Secret(sid, team_id, name, meta, now, now, (self._seal(team_id, sid, 1, raw),))
            return items + (made,), made
        return self._change(change)

    def update(self, team_id: str, ref: str, value: str, metadata: Mapping[str, Any] | None) -> Secret:
        """A new current version; ``metadata`` replaces the old when given."""
        raw = _check_value(value)
        meta = None if metadata is None else check_metadata(metadata)

        def change(items: tuple[Secret, ...]) -> tuple[tuple[Secret, ...], Secret]:
            old = _find(items, team_id, ref)
            version = self._seal(team_id, old.secret_id, old.current + 1, raw)
            new = dataclasses.replace(old, metadata=old.metadata if meta is None else meta, updated=time.time(),
                                      versions=(old.versions + (version,))[-MAX_VERSIONS:])
            return tuple(new if s.secret_id == old.secret_id else s for s in items), new
        return self._change(change)

    def delete(self, team_id: str, ref: str) -> None:
        def change(items: tuple[Secret, ...]) -> tuple[tuple[Secret, ...], None]:
            old = _find(items, team_id, ref)
            return tuple(s for s in items if s.secret_id != old.secret_id), None
        self._change(change)

    def drop_team(self, team_id: str) -> None:
        """Every secret of a deleted team."""
        self._change(lambda items: (tuple(s for s in items if s.team_id != team_id), None))
