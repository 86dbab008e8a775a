"""The egress proxy's rewrite of a guest's HTTP request to a domain the sandbox's
``network.rules`` name (transforms.py): the rule's headers set, and every secret
marker in the header values replaced by the value of the team's secret. Pure (the
secret lookup is a function handed in).

Only the first request of a connection is rewritten, and it goes out with
``Connection: close``: the server answers it and closes, so a second request on the
connection (whose bytes the proxy relays as they are) never leaves with a value and
the client opens a new connection for it. The request head is parsed by h11, bounded
by ``MAX_HEAD``; its body is relayed as it comes (the caller pumps it). A request that
does not parse, whose ``Host`` is not the name the connection was allowed for, or
whose substituted values would not be a valid header value (a secret holding CR, LF
or NUL) is not rewritten: ``Rewrite.refused`` says why, and the caller drops the
connection. Nothing here logs or returns a value other than in the new head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import h11

from aenv_wire.secret_markers import substitute_bytes

from .hostnames import host_matches
from .transforms import DomainRule

MAX_HEAD = 64 << 10         # bytes of a request head the proxy parses
Resolve = Callable[[str, str], "bytes | None"]      # (team, secret name) -> value, None if none
_DROPPED = frozenset({b"connection", b"keep-alive", b"proxy-connection"})
_BAD_IN_VALUE = (b"\r", b"\n", b"\0")


@dataclass(frozen=True)
class Rewrite:
    head: bytes             # the request head to send (the original when not rewritten)
    rest: bytes             # what followed the head in the bytes read (body bytes)
    substituted: int = 0    # markers replaced by values
    refused: str = ""       # not "" : drop the connection, for this reason


def split_head(data: bytes) -> tuple[bytes, bytes] | None:
    """``(head with its blank line, rest)``; None when ``data`` holds no complete head."""
    end = data.find(b"\r\n\r\n")
    return None if end < 0 or end + 4 > MAX_HEAD else (data[:end + 4], data[end + 4:])


def _host(value: bytes) -> str:
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def rewrite(data: bytes, name: str, rule: DomainRule, team: str, resolve: Resolve) -> Rewrite:
    """``data`` (the bytes read so far of a connection allowed for ``name``) with its first
    request rewritten by ``rule``."""
    parts = split_head(data)
    if parts is None:
        return Rewrite(data, b"", refused="no complete request head within the bound")
    head, rest = parts
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    try:
        conn.receive_data(head)
        event = conn.next_event()
    except h11.RemoteProtocolError as e:
        return Rewrite(data, b"", refused=f"not an HTTP/1 request: {e}")
    if not isinstance(event, h11.Request):
        return Rewrite(data, b"", refused="not an HTTP/1 request")
    items = list(event.headers.raw_items())
    hosts = [v for n, v in items if n.lower() == b"host"]
    if len(hosts) != 1 or not host_matches(name, _host(hosts[0])):
        return Rewrite(data, b"", refused="the request's Host is not the name the connection was allowed for")
    setting = {h.lower().encode(): (h.encode(), v.encode()) for h, v in rule.headers}
    out: list[tuple[bytes, bytes]] = []
    for n, v in items:
        if n.lower() in _DROPPED or n.lower() in setting:
            continue
        out.append((n, v))
    out += list(setting.values())
    out.append((b"Connection", b"close"))
    count = 0
    lines = [event.method + b" " + event.target + b" HTTP/" + event.http_version]
    for n, v in out:
        v, k = substitute_bytes(v, lambda secret: resolve(team, secret))
        count += k
        if any(b in v for b in _BAD_IN_VALUE):
            return Rewrite(data, b"", refused=f"a secret in header {n.decode('latin-1')!r} is no valid header value")
        lines.append(n + b": " + v)
    return Rewrite(b"\r\n".join(lines) + b"\r\n\r\n", rest, count)
