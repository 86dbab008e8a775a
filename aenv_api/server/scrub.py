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

import hmac
from dataclasses import dataclass
from typing import Iterable
from urllib.parse import unquote_plus


@dataclass(frozen=True)
class KeyScrub:
    api_key: str        # the deployment's key ("": none, nothing is removed)

    def _is_key(self, value: str) -> bool:
        # surrogateescape: a header may carry any bytes (aiohttp keeps invalid UTF-8 as surrogates)
        return bool(self.api_key) and hmac.compare_digest(value.encode("utf-8", "surrogateescape"),
                                                          self.api_key.encode())

    def carries_key(self, value: str) -> bool:
        v = value.strip()
        scheme, _, rest = v.partition(" ")
        return self._is_key(v) or (scheme.lower() == "bearer" and self._is_key(rest.strip()))

    def headers(self, items: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """``items`` without the headers whose value is the key."""
        return [(k, v) for k, v in items if not self.carries_key(v)]

    def target(self, raw: str) -> str:
        """A request target (``path?query``, as sent) without the query parameters whose
        value is the key; the rest byte for byte as the client sent it."""
        path, sep, query = raw.partition("?")
        if not sep or not self.api_key:
            return raw
        kept = [p for p in query.split("&") if not self.carries_key(unquote_plus(p.partition("=")[2]))]
        return f"{path}?{'&'.join(kept)}" if kept else path


NO_KEY = KeyScrub("")     # a proxy that knows no key (library use)
