"""Registry authentication: credentials, ``WWW-Authenticate`` challenges (pure
parsing), Basic headers and bearer tokens from a challenge's realm (the Docker
token protocol: ``GET realm?service=…&scope=…``, with the credentials as Basic
auth if there are any, else anonymously)."""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .errors import RegistryError

_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]*)")
_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s"]*))\s*(,|$)')


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def basic(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    def __repr__(self) -> str:            # never print a password
        return f"Credentials(username={self.username!r}, password=***)"


@dataclass(frozen=True)
class Challenge:
    scheme: str                              # lower case: "basic", "bearer"
    params: Mapping[str, str] = field(default_factory=dict)


def parse_challenges(header: str) -> list[Challenge]:
    """The challenges of one ``WWW-Authenticate`` value, e.g.
    ``Bearer realm="https://a/token",service="reg",scope="repository:x:pull"``.
    Several challenges may follow each other, separated by commas."""
    out: list[Challenge] = []
    pos = 0
    while pos < len(header):
        m = _SCHEME.match(header, pos)
        if not m:
            break
        scheme, pos = m.group(1).lower(), m.end()
        params: dict[str, str] = {}
        while True:
            p = _PARAM.match(header, pos)
            if not p:
                break
            value = p.group(2) if p.group(2) is not None else p.group(3)
            params[p.group(1).lower()] = re.sub(r"\\(.)", r"\1", value)
            pos = p.end()
            if p.group(4) == "":
                break
            # the next token may start a new challenge instead of another parameter
            if _SCHEME.match(header, pos) and not _PARAM.match(header, pos):
                break
        out.append(Challenge(scheme, params))
        while pos < len(header) and header[pos] in ", ":
            pos += 1
    return out


def token_from_answer(body: bytes) -> str:
    """The bearer token of a token endpoint's JSON answer (``token`` or ``access_token``)."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise RegistryError("token endpoint answered something that is not JSON") from None
    token = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
    if not isinstance(token, str) or not token:
        raise RegistryError("token endpoint answered without a token")
    return token


def credentials_from_file(path: Path, registry: str) -> Credentials | None:
    """Credentials for ``registry`` in a Docker-style config.json (``auths``), if any.
    Docker Hub is also looked up under its legacy key ``https://index.docker.io/v1/``."""
    try:
        doc = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RegistryError(f"credentials file {path}: {e}") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return None
    keys = [registry, f"https://{registry}", f"http://{registry}"]
    if registry == "docker.io":
        keys += ["https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io"]
    for key in keys:
        entry = auths.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("auth"), str):
            try:
                user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise RegistryError(f"credentials file {path}: bad auth entry for {key}") from None
            if sep:
                return Credentials(user, password)
    return None
