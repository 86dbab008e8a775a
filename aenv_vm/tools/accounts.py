"""The sandbox user in an image's account files: pure functions over the bytes of
/etc/passwd, /etc/group and /etc/shadow (no file access here; install.py reads
and writes them inside the image root).

E2B runs commands as ``user`` by default, so an image without such a user gets
one: uid and gid 1000 when free (the next free ids from 1000 otherwise), home
/home/user, the given shell, no password (locked in /etc/shadow). An existing
``user`` is left exactly as the image has it.
"""
from __future__ import annotations

from dataclasses import dataclass

SANDBOX_USER = "user"
PREFERRED_ID = 1000
ROOT_LINE = b"root:x:0:0:root:/root:/bin/sh\n"
ROOT_GROUP = b"root:x:0:\n"


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str
    shell: str


@dataclass(frozen=True)
class AccountFiles:
    passwd: bytes
    group: bytes
    shadow: bytes | None        # None: the image has no /etc/shadow (none is made)


def _fields(text: bytes) -> list[list[bytes]]:
    out = []
    for line in text.splitlines():
        if line.strip() and not line.startswith(b"#"):
            out.append(line.split(b":"))
    return out


def _ids(entries: list[list[bytes]], column: int) -> set[int]:
    ids = set()
    for f in entries:
        if len(f) > column:
            try:
                ids.add(int(f[column]))
            except ValueError:
                pass
    return ids


def _append(text: bytes, line: bytes) -> bytes:
    if text and not text.endswith(b"\n"):
        text += b"\n"
    return text + line


def find_account(passwd: bytes, name: str) -> Account | None:
    for f in _fields(passwd):
        if len(f) >= 7 and f[0] == name.encode():
            try:
                return Account(name, int(f[2]), int(f[3]), f[5].decode(errors="replace"),
                               f[6].decode(errors="replace"))
            except ValueError:
                return None
    return None


def free_id(taken: set[int], start: int = PREFERRED_ID) -> int:
    n = start
    while n in taken:
        n += 1
    return n


def ensure_user(files: AccountFiles, shell: str, name: str = SANDBOX_USER) -> tuple[AccountFiles, Account, bool]:
    """``files`` with ``name`` in them: (new files, the account, whether it was added).
    Files without a root entry get one (an image with no /etc/passwd at all)."""
    existing = find_account(files.passwd, name)
    if existing is not None:
        return files, existing, False
    passwd, group = files.passwd, files.group
    users = _fields(passwd)
    if not any(f[0] == b"root" for f in users):
        passwd = ROOT_LINE + passwd
        users = _fields(passwd)
    groups = _fields(group)
    if not any(f[0] == b"root" for f in groups):
        group = ROOT_GROUP + group
        groups = _fields(group)
    uid = free_id(_ids(users, 2))
    named_group = next((f for f in groups if f[0] == name.encode() and len(f) > 2), None)
    gid: int | None = None
    if named_group is not None:
        try:
            gid = int(named_group[2])
        except ValueError:
            gid = None
    if gid is None:
        taken = _ids(groups, 2)
        gid = uid if uid not in taken else free_id(taken)
        group = _append(group, f"{name}:x:{gid}:\n".encode())
    home = f"/home/{name}"
    passwd = _append(passwd, f"{name}:x:{uid}:{gid}::{home}:{shell}\n".encode())
    shadow = files.shadow
    if shadow is not None:
        # locked password, as useradd leaves it; day 1 as the last change (fixed: reproducible)
        shadow = _append(shadow, f"{name}:!:1:0:99999:7:::\n".encode())
    return AccountFiles(passwd, group, shadow), Account(name, uid, gid, home, shell), True
