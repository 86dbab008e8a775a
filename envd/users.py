"""Who an operation runs as: Basic-auth user, default user, fallbacks.

Users and groups are read from /etc/passwd and /etc/group themselves, not
through the C library's NSS: in an image booted with the guest tools envd runs
on the tools' glibc, and the image's /etc/nsswitch.conf (if any) names modules
of the image's own libc (musl has none), which that glibc must not load.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass

PASSWD = "/etc/passwd"
GROUP = "/etc/group"


class UnknownUser(Exception):
    pass


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str

    @property
    def groups(self) -> list[int]:
        """The primary group and every group of /etc/group listing the user."""
        out = [self.gid]
        for fields in _entries(GROUP):
            if len(fields) >= 4 and self.name in fields[3].split(","):
                gid = _int(fields[2])
                if gid is not None and gid not in out:
                    out.append(gid)
        return out


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _entries(path: str) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n").split(":") for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return []


def _user(fields: list[str]) -> User | None:
    if len(fields) < 7:
        return None
    uid, gid = _int(fields[2]), _int(fields[3])
    if uid is None or gid is None:
        return None
    return User(fields[0], uid, gid, fields[5] or "/", fields[6] or "/bin/sh")


def lookup(name: str) -> User:
    for fields in _entries(PASSWD):
        if fields[0] == name:
            user = _user(fields)
            if user is not None:
                return user
    raise UnknownUser(f"error looking up user '{name}': unknown user")


def by_uid(uid: int) -> User | None:
    for fields in _entries(PASSWD):
        user = _user(fields)
        if user is not None and user.uid == uid:
            return user
    return None


def current() -> User:
    uid = os.geteuid()
    return by_uid(uid) or User(str(uid), uid, os.getegid(), os.environ.get("HOME") or "/", "/bin/sh")


def basic_auth_user(header: str | None) -> str | None:
    """The user name of ``Authorization: Basic base64(user:)``, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic" or not token.strip():
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    name = decoded.partition(":")[0]
    return name or None


def group_name(gid: int) -> str:
    for fields in _entries(GROUP):
        if len(fields) >= 3 and _int(fields[2]) == gid:
            return fields[0]
    return str(gid)


def user_name(uid: int) -> str:
    user = by_uid(uid)
    return user.name if user is not None else str(uid)


def resolve_path(path: str, user: User) -> str:
    """Absolute, normalised path; relative paths and ``~`` start at the user's home."""
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    if not os.path.isabs(path):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)
