"""E2B's secret markers, ``${e2b.secrets.NAME}`` (the SDK's ``Secret.fill``): found in a
text and substituted (pure, standard library only).

A marker names a secret of the sandbox's team; the node's egress proxy replaces it with
the secret's value in requests to the hosts the sandbox's ``network.rules`` name
(aenv_vm/net/secret_relay.py), and nowhere else. Names are what the secrets API stores:
``[A-Za-z0-9_-]{1,128}``, compared lower-case (the API lower-cases them). Anything else
that looks like a marker (an empty name, a brace, a name too long) is no marker and is
left as it is.

Substitution is one pass over the original text: a value that itself contains marker
text is never expanded again, and an unknown name (``resolve`` answers None) keeps its
marker.
"""
from __future__ import annotations

import re
from typing import Callable

PREFIX = "${e2b.secrets."
MAX_NAME = 128
NAME_PATTERN = rf"[A-Za-z0-9_-]{{1,{MAX_NAME}}}"
_MARKER = re.compile(r"\$\{e2b\.secrets\.(" + NAME_PATTERN + r")\}")
_MARKER_BYTES = re.compile(rb"\$\{e2b\.secrets\.(" + NAME_PATTERN.encode() + rb")\}")


def marker(name: str) -> str:
    """The marker of ``name`` (``Secret.fill``)."""
    return PREFIX + name + "}"


def names_in(text: str) -> list[str]:
    """The secret names ``text``'s markers refer to, lower-case, in order, without repeats."""
    return list(dict.fromkeys(m.group(1).lower() for m in _MARKER.finditer(text)))


def has_marker_prefix(data: bytes) -> bool:
    """Whether ``data`` has anything that starts like a marker (cheap test before parsing)."""
    return PREFIX.encode() in data


def substitute(text: str, resolve: Callable[[str], str | None]) -> str:
    """``text`` with every marker whose (lower-case) name ``resolve`` knows replaced by its value."""
    def one(m: re.Match[str]) -> str:
        value = resolve(m.group(1).lower())
        return m.group(0) if value is None else value
    return _MARKER.sub(one, text)


def substitute_bytes(data: bytes, resolve: Callable[[str], bytes | None]) -> tuple[bytes, int]:
    """``substitute`` over bytes (a request head's field value); also how many markers
    were replaced."""
    count = 0

    def one(m: re.Match[bytes]) -> bytes:
        nonlocal count
        value = resolve(m.group(1).decode("ascii").lower())
        if value is None:
            return m.group(0)
        count += 1
        return value
    return _MARKER_BYTES.sub(one, data), count
