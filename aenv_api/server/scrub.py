"""The deployment's API key never reaches a guest, whichever way a client sent it.

``X-API-Key`` is dropped from every proxied request whatever it holds (proxy.py's
``_DROP_REQUEST``). A client may also send the key as ``Authorization: Bearer <key>``
(aenv_wire/api_key.py), or put it in a URL's query string; those headers and query
parameters are the guest's own otherwise (an app in a sandbox may use its own
``Authorization`` scheme and parameters), so they are removed only when their value
*is* the key (alone, or after ``Bearer``). The access log never writes query strings
(app.py), so a key or an upload URL's signature in one is not logged either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable
from urllib.parse import unquote_plus


@dataclass(frozen=True)
class KeyScrub:
    is_api_key: Callable[[str], bool]       # constant-time comparison with the deployment's key

    def carries_key(self, value: str) -> bool:
        v = value.strip()
        scheme, _, rest = v.partition(" ")
        return self.is_api_key(v) or (scheme.lower() == "bearer" and self.is_api_key(rest.strip()))

    def headers(self, items: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """``items`` without the headers whose value is the key."""
        return [(k, v) for k, v in items if not self.carries_key(v)]

    def target(self, raw: str) -> str:
        """A request target (``path?query``, as sent) without the query parameters whose
        value is the key; the rest byte for byte as the client sent it."""
        path, sep, query = raw.partition("?")
        if not sep:
            return raw
        kept = [p for p in query.split("&") if not self.carries_key(unquote_plus(p.partition("=")[2]))]
        return f"{path}?{'&'.join(kept)}" if kept else path


NO_KEY = KeyScrub(lambda _value: False)     # a proxy that knows no key (library use)
