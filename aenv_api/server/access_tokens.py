"""envd access tokens: the one the client holds, the one the guest holds.

A secured sandbox has two tokens, each a derivation of the deployment's envd secret
(auth.py) under a label of its own, so neither gives away the other:

- the **guest token** G = ``base64url(HMAC(K_guest, sandbox id))``: what envd is given
  at ``/init`` and checks. The sandbox layer's record keeps it (``access_token``), the
  node talks to envd with it (pool warm-up, pause, the re-keying of clones). It never
  leaves the node: the proxy puts it on requests after it has checked the client's.
- the **client token** C = ``base64url(HMAC(K_client, "<sandbox id>/<generation>"))``:
  ``envdAccessToken`` in the create/connect/get answers, and the only token the proxy
  accepts for the sandbox (``X-Access-Token``, signed ``/files`` URLs, the routing of
  envd calls that name no sandbox). It never enters the guest.

Why the split: a snapshot, a template or a fork child of sandbox A holds A's memory,
hence G_A. Since the proxy never takes a guest token from a client, what a clone finds
reaches nothing of A; the clone itself is re-keyed at its ``/init`` with its own G.

The generation makes C rotatable (``POST /sandboxes/{id}/rotate-token``): it is kept in
the sandbox's own record (annotation ``GENERATION_ANNOTATION``), so it survives
pause/resume and restarts, moves with the sandbox to another node of a fleet sharing the
secret, and is committed with every pause. Rotation bumps it: the old C fails at the
proxy at once, on every path. Rotation does not re-key G (clients never hold G; the node
would have to re-key envd in a running guest for nothing a client can use).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from aenv_wire.headers import ACCESS_TOKEN_HEADER

log = logging.getLogger(__name__)

GENERATION_ANNOTATION = "api.token_generation"    # among the sandbox's annotations (extras.py's sibling)
_GUEST_LABEL = b"aenv envd guest token v1"
_CLIENT_LABEL = b"aenv envd client token v1"
_GENERATION = re.compile(r"(0|[1-9][0-9]{0,17})")
_ACCESS = ACCESS_TOKEN_HEADER.lower()


class BadGeneration(ValueError):
    """A generation annotation this module did not write."""


def _mac(key: bytes, message: str) -> str:
    mac = hmac.new(key, message.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def _key(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


def parse_generation(raw: str | None) -> int:
    """The generation an annotation value says (absent: 0). BadGeneration otherwise."""
    if raw is None:
        return 0
    if not isinstance(raw, str) or not _GENERATION.fullmatch(raw):
        raise BadGeneration(f"not a token generation: {str(raw)[:40]!r}")
    return int(raw)


def generation_of(annotations: Mapping[str, str]) -> int:
    return parse_generation(annotations.get(GENERATION_ANNOTATION))


@dataclass(frozen=True)
class AccessTokens:
    """The two derivations of one deployment's envd secret."""

    secret: bytes = field(repr=False)
    # the two label keys, derived once: every view of a secured sandbox derives its client token
    _guest_key: bytes = field(init=False, repr=False, compare=False)
    _client_key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_guest_key", _key(self.secret, _GUEST_LABEL))
        object.__setattr__(self, "_client_key", _key(self.secret, _CLIENT_LABEL))

    @classmethod
    def ephemeral(cls) -> "AccessTokens":
        """A key of its own (library use, unit tests): tokens do not survive the process."""
        return cls(secrets.token_bytes(32))

    def guest(self, sandbox_id: str) -> str:
        return _mac(self._guest_key, sandbox_id)

    def client(self, sandbox_id: str, generation: int = 0) -> str:
        return _mac(self._client_key, f"{sandbox_id}/{generation}")

    def client_of(self, sandbox_id: str, annotations: Mapping[str, str]) -> str:
        """The client token of a secured sandbox whose record has these annotations. An
        unreadable generation fails closed: a token nobody holds, never an open sandbox."""
        try:
            return self.client(sandbox_id, generation_of(annotations))
        except BadGeneration as e:
            log.error("sandbox %s: %s; its client token is unknown", sandbox_id, e)
            return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class SandboxKeys:
    """A secured sandbox's two tokens as the proxy uses them (None: not secured)."""

    client: str | None
    guest: str | None = field(default=None, repr=False)

    def accepts(self, given: str | None) -> bool:
        return self.client is not None and given is not None and \
            hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.client.encode())


def upstream_headers(headers: Iterable[tuple[str, str]], keys: SandboxKeys | None,
                     given: str | None, checked: bool) -> list[tuple[str, str]]:
    """The request headers as they go into the sandbox, as far as the access token goes.

    Unsecured (``keys.client`` None): unchanged. Unknown (``keys`` None: the sandbox
    paused or went as the request passed): without any. Secured: the
    client's ``X-Access-Token`` never goes in as given; the guest token takes its place
    when the request was authorised by the client token: ``checked`` (the proxy checked
    the envd port's token or signature) or a header equal to the client token (another
    port: the code interpreter asks envd with it). Anything else goes in without one, so a
    guest token found in a clone is no key to the code interpreter of the sandbox either."""
    items = list(headers)
    if keys is not None and keys.client is None:
        return items
    out = [(k, v) for k, v in items if k.lower() != _ACCESS]
    if keys is not None and keys.guest is not None and (checked or keys.accepts(given)):
        out.append((ACCESS_TOKEN_HEADER, keys.guest))
    return out
