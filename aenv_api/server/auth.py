"""Credentials of one deployment.

- The **API key** (header ``X-API-KEY``) guards the control plane. It comes
  from ``AENV_API_KEY``, else the file ``[server] api_key_file`` (default
  ``<data-dir>/api-key``), else is generated on first start (``e2b_`` + 40 hex
  digits, so the SDK's format checks pass) and written there with mode 0600.
  ``aenv server`` removes both variables from its environment once read
  (aenv_cli/node_secrets.py); deployments give the secrets as files.
- A sandbox's envd tokens (the client's ``envdAccessToken`` and the guest's own,
  access_tokens.py) are HMAC-SHA256 derivations of the envd secret, per
  deployment: ``AENV_ENVD_SECRET``, else the file ``[server] envd_secret_file``
  (default ``<data-dir>/envd-secret``), else generated there on first start (32
  random bytes as hex, mode 0600). Tokens therefore survive restarts (paused
  sandboxes resume with the token their clients hold), every sandbox — fork
  children and sandboxes created from a snapshot too — has its own, and nodes
  sharing the secret agree on them. ``check_token`` compares in constant time.
- A sandbox created with ``allowPublicTraffic: false`` has a
  ``trafficAccessToken``: ``base64url(HMAC-SHA256(K, sandbox id))`` with its own
  key ``K = HMAC-SHA256(secret, "aenv traffic access token v1")``, so it never
  equals an envd token and one never gives away the other. Derived, not
  stored: it survives restarts and pause/resume with the secret, fork children
  and sandboxes created from a snapshot get the token of their own id, and
  the guest never learns it (the proxy drops the header).
- The **admin credential** (header ``X-Admin-Token``) manages teams and their keys
  (keystore.py, teams_api.py): ``AENV_ADMIN_TOKEN``, else the file ``[server]
  teams_admin_token_file``; never the config file itself, never generated (a node without
  one answers its admin routes 403). At least 16 characters.
- The **secrets key** encrypts the teams' secrets at rest (secret_store.py):
  ``AENV_SECRETS_KEY``, else the file ``[server] secrets_key_file`` (32 bytes as 64 hex
  digits); never the config file, never generated (a node without one keeps no secrets:
  its ``/secrets`` routes answer 503).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from aenv_store.errors import ConfigError

from .access_tokens import AccessTokens
from .secret_store import load_key as load_secrets_key

API_KEY_ENV = "AENV_API_KEY"
API_KEY_FILE = "api-key"
ENVD_SECRET_ENV = "AENV_ENVD_SECRET"
ENVD_SECRET_FILE = "envd-secret"
ADMIN_TOKEN_ENV = "AENV_ADMIN_TOKEN"
MIN_ADMIN_TOKEN = 16


def _read_or_create(path: Path, make: str) -> str:
    """The file's stripped content, or ``make`` written to it atomically with mode 0600."""
    try:
        value = path.read_text().strip()
        if value:
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)  # a key readable by others is not a secret
            return value
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)    # whatever the umask
            os.write(fd, (make + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a key another process wrote meanwhile
        except FileExistsError:
            tmp.unlink()
            return path.read_text().strip()
        tmp.unlink()
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write a new secret to {path}: {e}") from None
    return make


def generate_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


_TRAFFIC_LABEL = b"aenv traffic access token v1"


def traffic_token(secret: bytes, sandbox_id: str) -> str:
    """The traffic access token of ``sandbox_id``: ``base64url(HMAC-SHA256(K, id))``, unpadded,
    ``K`` the secret's key for traffic tokens alone."""
    key = hmac.new(secret, _TRAFFIC_LABEL, hashlib.sha256).digest()
    mac = hmac.new(key, sandbox_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


@dataclass(frozen=True)
class Credentials:
    api_key: str = field(repr=False)
    api_key_source: str    # "env" | "file" | "generated" (for the start banner)
    envd_secret: bytes = field(default=b"", repr=False)
    admin_token: str = field(default="", repr=False)     # "" = no admin credential: admin routes answer 403
    secrets_key: bytes | None = field(default=None, repr=False)  # None: no secrets (secret_store.py)

    @classmethod
    def load(cls, data_dir: Path, environ: Mapping[str, str] | None = None,
             envd_secret_file: Path | None = None, api_key_file: Path | None = None,
             admin_token_file: Path | None = None, secrets_key_file: Path | None = None) -> "Credentials":
        """``envd_secret_file``, ``api_key_file``: where the envd token secret and the API
        key live (default ``<data_dir>/envd-secret``, ``<data_dir>/api-key``);
        ``admin_token_file``: the admin credential's file, if any (``AENV_ADMIN_TOKEN`` wins);
        ``secrets_key_file``: the secrets key's (``AENV_SECRETS_KEY`` wins; secret_store.py)."""
        env = os.environ if environ is None else environ
        key_file = api_key_file or data_dir / API_KEY_FILE
        if env.get(API_KEY_ENV):
            key, source = env[API_KEY_ENV].strip(), "env"
        else:
            existed = key_file.exists()
            key = _read_or_create(key_file, generate_api_key())
            source = "file" if existed else "generated"
        if not key or any(c.isspace() for c in key):
            raise ConfigError("the API key must be a non-empty string without spaces")
        if env.get(ENVD_SECRET_ENV, "").strip():
            secret = env[ENVD_SECRET_ENV].strip()
        else:
            secret = _read_or_create(envd_secret_file or data_dir / ENVD_SECRET_FILE, secrets.token_hex(32))
        if len(secret) < 16:
            raise ConfigError(f"the envd token secret must be at least 16 characters, got {len(secret)}")
        return cls(key, source, secret.encode(), _admin_token(env, admin_token_file),
                   load_secrets_key(env, secrets_key_file))

    @property
    def access_tokens(self) -> AccessTokens:
        """The envd token derivations of this deployment (access_tokens.py)."""
        return AccessTokens(self.envd_secret)

    def traffic_token(self, sandbox_id: str) -> str:
        return traffic_token(self.envd_secret, sandbox_id)

    def check_api_key(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.api_key.encode())


def _admin_token(env: Mapping[str, str], path: Path | None) -> str:
    if env.get(ADMIN_TOKEN_ENV, "").strip():
        token, where = env[ADMIN_TOKEN_ENV].strip(), ADMIN_TOKEN_ENV
    elif path is not None:
        try:
            token, where = path.read_text().strip(), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"server.teams_admin_token_file: cannot read {path}: {e}") from None
    else:
        return ""
    if len(token) < MIN_ADMIN_TOKEN or any(c.isspace() for c in token):
        raise ConfigError(f"the admin credential ({where}) must be at least {MIN_ADMIN_TOKEN} characters "
                          f"without spaces")
    return token


def check_token(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
