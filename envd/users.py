"""Who an operation runs as: Basic-auth user, default user, fallbacks."""

from __future__ import annotations

import base64
import binascii
import grp
import os
import pwd
from dataclasses import dataclass


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
        try:
            return os.getgrouplist(self.name, self.gid)
        except OSError:
            return [self.gid]


def lookup(name: str) -> User:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise UnknownUser(f"error looking up user '{name}': unknown user") from None
    return User(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir or "/", pw.pw_shell or "/bin/sh")


def current() -> User:
    pw = pwd.getpwuid(os.geteuid())
    return User(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir or "/", pw.pw_shell or "/bin/sh")


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
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def resolve_path(path: str, user: User) -> str:
    """Absolute, normalised path; relative paths and ``~`` start at the user's home."""
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    if not os.path.isabs(path):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)
