"""The destination name of an outbound connection, read from its first bytes
(pure): the server name (SNI) of a TLS ClientHello, or the ``Host`` of an HTTP
request. The egress proxy (egress.py) matches hostname rules against it.

``sniff(data)`` answers ``Name(host)`` when the bytes say it, ``NEED_MORE``
when they are a plausible beginning that is still short, and ``None`` when
they will never say (another protocol, a ClientHello without SNI, garbage):
the caller then decides by address alone. Nothing here trusts a length field
beyond the bytes it has; limits keep a hostile guest from making the proxy
buffer much.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Final

MAX_SNIFF = 16 << 10        # bytes the proxy reads before deciding (a ClientHello is ~0.5-2 KiB)
_HOST = re.compile(rb"^[A-Za-z0-9.-]{1,253}$")


@dataclass(frozen=True)
class Name:
    host: str


class _NeedMore:
    def __repr__(self) -> str:
        return "NEED_MORE"


NEED_MORE: Final = _NeedMore()
Sniffed = Name | _NeedMore | None


def _hostname(raw: bytes) -> Name | None:
    raw = raw.rstrip(b".")
    if not _HOST.match(raw) or b".." in raw:
        return None
    return Name(raw.decode("ascii").lower())


def sniff(data: bytes) -> Sniffed:
    if not data:
        return NEED_MORE
    if data[0] == 0x16:
        return _tls_sni(data)
    return _http_host(data)


def _tls_sni(data: bytes) -> Sniffed:
    """SNI of a TLS record carrying a ClientHello (the first record of a connection)."""
    if len(data) < 5:
        return NEED_MORE
    _ctype, major, _minor, rec_len = struct.unpack_from(">BBBH", data)
    if major != 3 or rec_len < 4:
        return None
    if len(data) < 5 + rec_len:
        return NEED_MORE if 5 + rec_len <= MAX_SNIFF else None
    hs = data[5:5 + rec_len]
    if hs[0] != 1:                      # not a ClientHello
        return None
    hs_len = int.from_bytes(hs[1:4], "big")
    body = hs[4:4 + hs_len]
    if len(body) < hs_len:              # a ClientHello split over records: not followed here
        return None
    try:
        pos = 2 + 32                    # client version, random
        sid_len = body[pos]
        pos += 1 + sid_len
        (cs_len,) = struct.unpack_from(">H", body, pos)
        pos += 2 + cs_len
        comp_len = body[pos]
        pos += 1 + comp_len
        if pos == len(body):
            return None                 # no extensions
        (ext_total,) = struct.unpack_from(">H", body, pos)
        pos += 2
        end = min(len(body), pos + ext_total)
        while pos + 4 <= end:
            etype, elen = struct.unpack_from(">HH", body, pos)
            pos += 4
            if pos + elen > end:
                return None
            if etype == 0:              # server_name
                ext = body[pos:pos + elen]
                (list_len,) = struct.unpack_from(">H", ext, 0)
                p = 2
                while p + 3 <= min(len(ext), 2 + list_len):
                    ntype, nlen = struct.unpack_from(">BH", ext, p)
                    p += 3
                    name = ext[p:p + nlen]
                    if len(name) != nlen:
                        return None
                    if ntype == 0:      # host_name
                        return _hostname(name)
                    p += nlen
                return None
            pos += elen
    except (IndexError, struct.error):
        return None
    return None


_METHODS = (b"GET", b"POST", b"PUT", b"HEAD", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE")


def _http_host(data: bytes) -> Sniffed:
    """``Host`` of an HTTP/1.x request (port and case dropped)."""
    first = data.split(b" ", 1)[0]
    if not any(m.startswith(first) or first == m for m in _METHODS):
        return None
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return NEED_MORE if len(data) < MAX_SNIFF else None
    for line in data[:end].split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"host":
            host = value.strip()
            if host.startswith(b"["):
                return None             # an IPv6 literal: no name
            return _hostname(host.rsplit(b":", 1)[0] if host.count(b":") == 1 else host)
    return None
