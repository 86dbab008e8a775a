"""E2B's error body, and the errors of this package's parsers.

Every error E2B's API answers is JSON ``{"code": <int>, "message": <str>}`` (its
``Error`` schema), the code equal to the HTTP status; a machine-readable
``error_code`` (a string, "not a closed set" in E2B's words) says what happened where
a client must act on it. aenv uses ``error_code`` for E2B's own codes
(``GUEST_UNRESPONSIVE``) and for the node <-> gateway contract (``cluster.ClusterCode``).

The parsers of this package raise ``WireError`` subclasses, never anything else, on
bad input: their message is what the API answers with its 400.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ERROR_CODE_FIELD = "error_code"
# E2B's error_code for a memory resume of a pause taken while envd did not answer (the
# SDK raises GuestUnresponsiveException for it)
GUEST_UNRESPONSIVE = "sandbox_snapshot_guest_agent_unresponsive"


class WireError(ValueError):
    """Input that is not what the wire format allows; the message says what is wrong."""


class BadToken(WireError):
    """A page token this server (or gateway) did not issue."""


class BadRoute(WireError):
    """Sandbox traffic whose routing headers or path are malformed."""


class MalformedBuild(WireError):
    """A template build request (steps, base, commands) that cannot be built."""


class BadNodeChange(WireError):
    """A ``NodeStatusChange`` that is not one (unknown status, a bad cluster id)."""


def error_body(status: int, message: str, error_code: str | None = None, **extra: Any) -> dict[str, Any]:
    """E2B's ``Error``: ``{"code", "message"}``, ``error_code`` when given, then ``extra``
    (aenv adds e.g. ``sandboxId``, ``state``)."""
    body: dict[str, Any] = {"code": status, "message": message}
    if error_code is not None:
        body[ERROR_CODE_FIELD] = error_code
    body.update(extra)
    return body


@dataclass(frozen=True)
class ErrorBody:
    """An error answer as read back (by the gateway, from a node)."""

    code: int
    message: str
    error_code: str | None = None


def read_error(raw: bytes) -> ErrorBody | None:
    """The ``Error`` in ``raw``, or None when ``raw`` is not one (any bytes: never raises)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    code, message, error_code = obj.get("code"), obj.get("message"), obj.get(ERROR_CODE_FIELD)
    if not isinstance(code, int) or isinstance(code, bool) or not isinstance(message, str):
        return None
    return ErrorBody(code, message, error_code if isinstance(error_code, str) else None)
