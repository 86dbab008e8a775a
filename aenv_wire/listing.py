"""What E2B's lists show and how they page: the sandbox fields every node and the
gateway fill in the same way, the times as the API writes them, the SDK's metadata
filter, and the node's page token.

A node pages with keysets: its ``nextToken`` is the key of the last record of the page,
``(startedAt as a float, sandboxID)`` as base64url JSON (``encode_token``). The fleet's
gateway asks nodes with such tokens (aenv_fleet/gateway/list_merge.py) and issues its own.
"""
from __future__ import annotations

import base64
import datetime
import json
import urllib.parse

from .errors import BadToken

CLIENT_ID = "aenv"
# envdVersion of a sandbox whose template recorded none: the oldest version whose
# features the SDK needs (octet-stream uploads). Templates built since record the
# version their guest's envd reports (aenv_vm/templates/base.py).
FALLBACK_ENVD_VERSION = "0.5.7"

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_US = datetime.timedelta(microseconds=1)


def iso(ts: float) -> str:
    """RFC 3339 UTC timestamp as E2B writes them, always with microseconds (isoformat
    drops them on a whole second, and "...:03Z" sorts after "...:03.026000Z")."""
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(
        timespec="microseconds").replace("+00:00", "Z")


def micros(ts: float) -> int:
    """``ts`` in whole microseconds, rounded exactly as ``iso`` shows it. Times a client
    sends back (``startedAfter``) were read from ``iso``: they are compared with the
    records at this precision, not with the unrounded float (which ``iso`` may have
    rounded up, so a sandbox would seem to start after its own start time)."""
    return (datetime.datetime.fromtimestamp(ts, datetime.timezone.utc) - _EPOCH) // _US


def micros_of(stamp: str) -> int:
    """Whole microseconds of an RFC 3339 time (``iso``'s, or a client's with an offset;
    none is UTC, as the node reads ``startedAfter``). ValueError when it is not one."""
    dt = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.timezone.utc)
    delta = dt - _EPOCH
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def started_at_or_after(started_at: float, after: float) -> bool:
    """The list filter ``startedAfter``, compared at the microseconds the API shows: a
    client that passes a sandbox's own ``startedAt`` back finds that sandbox."""
    return micros(started_at) >= micros(after)


def parse_metadata_filter(raw: str) -> dict[str, str]:
    """The SDK's metadata filter: a form whose keys and values are URL-encoded once more
    (the HTTP layer has already decoded the query string itself once)."""
    pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True)
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def encode_token(started_at: float, sid: str) -> str:
    """A node's page token: the key ``(startedAt, sandboxID)`` a page continues after."""
    return base64.urlsafe_b64encode(json.dumps([started_at, sid]).encode()).decode().rstrip("=")


def decode_token(token: str) -> tuple[float, str]:
    """The key in a node's page token (BadToken: not one ``encode_token`` made)."""
    try:
        started, sid = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if not isinstance(sid, str) or isinstance(started, bool) or not isinstance(started, (int, float)):
            raise ValueError
        return float(started), sid
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise BadToken("nextToken is not a token this server issued") from None
