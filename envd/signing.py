"""Signed file URLs: how a ``/files`` request proves it may read or write
without carrying the access token.

The E2B SDK's ``download_url``/``upload_url`` on a secured sandbox sign the
request with the envd access token: ``v1_`` + unpadded standard base64 of
SHA-256 over ``path:operation:username:token`` (``:expiration`` appended
when the URL expires; ``expiration`` is a Unix time in seconds). ``path``
and ``username`` are the query values exactly as sent (the username empty
for the default user). Pure functions: the API's proxy uses the same ones
to find which sandbox a signed URL is for.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Mapping

READ = "read"
WRITE = "write"

# E2B envd's messages, kept word for word: clients compare them.
MISSING = "missing signature query parameter"
INVALID = "invalid signature"
EXPIRED = "signature is already expired"
TOKEN_MISMATCH = "access token present in header but does not match"


def operation_of(method: str) -> str:
    return READ if method in ("GET", "HEAD") else WRITE


def sign(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode("utf-8")).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class SignedRequest:
    """What a ``/files`` request's query says about its signature."""

    path: str
    operation: str
    username: str
    signature: str | None
    expiration: int | None

    def matches(self, token: str) -> bool:
        if self.signature is None:
            return False
        expected = sign(self.path, self.operation, self.username, token, self.expiration)
        return hmac.compare_digest(expected.encode(), self.signature.encode("utf-8", "surrogateescape"))

    def expired(self, now: float | None = None) -> bool:
        return self.expiration is not None and self.expiration < int(time.time() if now is None else now)


class BadExpiration(ValueError):
    """``signature_expiration`` is not an integer."""


def parse(method: str, query: Mapping[str, str]) -> SignedRequest:
    """From the query values (the first of each name). BadExpiration on a non-integer expiry."""
    raw_exp = query.get("signature_expiration")
    expiration = None
    if raw_exp is not None and raw_exp != "":
        try:
            expiration = int(raw_exp)
        except ValueError:
            raise BadExpiration(f"invalid format for parameter signature_expiration: {raw_exp[:40]!r}") from None
    return SignedRequest(query.get("path", ""), operation_of(method), query.get("username", ""),
                         query.get("signature"), expiration)


def check(req: SignedRequest, token: str | None, header_token: str | None, now: float | None = None) -> str | None:
    """None when the request may go on, else E2B's reason for a 401. With no token set
    everything passes; a token in the header decides alone (right or wrong); else the
    signature must match, then must not have expired."""
    if token is None:
        return None
    if header_token:
        return None if hmac.compare_digest(header_token.encode(), token.encode()) else TOKEN_MISMATCH
    if req.signature is None:
        return MISSING
    if not req.matches(token):
        return INVALID
    if req.expired(now):
        return EXPIRED
    return None
