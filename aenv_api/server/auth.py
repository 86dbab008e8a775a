"""Credentials of one deployment.

- The **API key** (header ``X-API-KEY``) guards the control plane. It comes
  from ``AENV_API_KEY``, else ``<data-dir>/api-key``, else is generated on
  first start (``e2b_`` + 40 hex digits, so the SDK's format checks pass) and
  written there with mode 0600.
- Sandboxes' ``envdAccessToken``s are random per sandbox and live in the
  sandbox records (see lifecycle.py); ``check_token`` compares in constant time.
"""
from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import ConfigError

API_KEY_ENV = "AENV_API_KEY"
API_KEY_FILE = "api-key"


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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
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
    return make


def generate_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


@dataclass(frozen=True)
class Credentials:
    api_key: str
    api_key_source: str    # "env" | "file" | "generated" (for the start banner)

    @classmethod
    def load(cls, data_dir: Path, environ: dict[str, str] | None = None) -> "Credentials":
        env = os.environ if environ is None else environ
        key_file = data_dir / API_KEY_FILE
        if env.get(API_KEY_ENV):
            key, source = env[API_KEY_ENV].strip(), "env"
        else:
            existed = key_file.exists()
            key = _read_or_create(key_file, generate_api_key())
            source = "file" if existed else "generated"
        if not key or any(c.isspace() for c in key):
            raise ConfigError("the API key must be a non-empty string without spaces")
        return cls(key, source)

    def check_api_key(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.api_key.encode())

def check_token(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
