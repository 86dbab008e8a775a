"""How a control-plane request presents the deployment's API key.

E2B's SDKs send it in ``X-API-Key``; some clients also (or only) send
``Authorization: Bearer <key>``. Envd access tokens and traffic tokens travel in
other headers (headers.py) and never count here.
"""
from __future__ import annotations

import hmac


def presented_api_key(api_keys: list[str], authorizations: list[str]) -> str | None:
    """The API key a request presents, given every ``X-API-Key`` and ``Authorization``
    value it carries, or None: none, more than one ``X-API-Key``, or an ``Authorization``
    that is not ``Bearer <that same key>`` (a request naming two credentials is refused
    rather than guessed at)."""
    if len(api_keys) != 1 or len(authorizations) > 1:
        return None
    key = api_keys[0].strip()
    if authorizations:
        scheme, _, value = authorizations[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), key.encode()):
            return None
    return key
