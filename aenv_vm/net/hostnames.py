"""Hostnames as egress rules name them (pure): ``example.com`` or a ``*.`` suffix."""
from __future__ import annotations

import re

_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})+$")


def is_hostname(entry: str) -> bool:
    """A lower-case hostname or ``*.`` suffix, as ``allow_out`` takes them."""
    return bool(_HOSTNAME.match(entry))


def host_matches(pattern: str, name: str) -> bool:
    """``example.com`` matches itself; ``*.example.com`` matches every name below it
    (not ``example.com`` itself, as TLS wildcards)."""
    name = name.lower().rstrip(".")
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern
