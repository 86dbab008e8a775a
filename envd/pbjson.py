"""Reading proto3-JSON request messages (lowerCamelCase or snake_case)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from .connect import Code, ConnectError


def _bad(name: str, want: str) -> ConnectError:
    return ConnectError(Code.INVALID_ARGUMENT, f"field {name!r} must be {want}")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def raw(msg: dict[str, Any], name: str) -> Any:
    """Field by its proto (snake_case) name, accepting the JSON (camel) name too."""
    camel = _camel(name)
    if camel in msg:
        return msg[camel]
    return msg.get(name)


def get_str(msg: dict[str, Any], name: str, default: str = "") -> str:
    v = raw(msg, name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _bad(name, "a string")
    return v


def get_opt_str(msg: dict[str, Any], name: str) -> str | None:
    v = raw(msg, name)
    return None if v is None else get_str(msg, name)


def get_bool(msg: dict[str, Any], name: str, default: bool = False) -> bool:
    v = raw(msg, name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "a boolean")
    return v


def get_uint(msg: dict[str, Any], name: str, default: int = 0, bits: int = 32) -> int:
    v = raw(msg, name)
    if v is None:
        return default
    if isinstance(v, str) and v.isascii() and v.isdigit():  # int64 and friends travel as strings
        v = int(v)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < (1 << bits):
        raise _bad(name, f"an unsigned {bits}-bit integer")
    return v


def get_bytes(msg: dict[str, Any], name: str) -> bytes | None:
    v = raw(msg, name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _bad(name, "base64 bytes")
    s = v.replace("-", "+").replace("_", "/")  # proto3 JSON accepts both alphabets
    try:
        return base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(name, "base64 bytes") from None


def get_obj(msg: dict[str, Any], name: str) -> dict[str, Any] | None:
    v = raw(msg, name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(name, "an object")
    return v


def get_str_list(msg: dict[str, Any], name: str) -> list[str]:
    v = raw(msg, name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _bad(name, "a list of strings")
    return v


def get_str_map(msg: dict[str, Any], name: str) -> dict[str, str]:
    v = raw(msg, name)
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
        raise _bad(name, "a map of strings")
    return v


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
