"""Host-wide leases of the uids sandboxes' QEMUs run as: one uid per sandbox.

Why one per sandbox rather than one shared ``aenv-vmm`` user: processes of one
uid may signal, ``ptrace`` and ``process_vm_writev`` each other (QEMU's seccomp
filter allows all three), so with a shared uid an escaped QEMU could take over
every other sandbox's QEMU. With a uid of its own it reaches only its own
files. The uids need no passwd entry.

A lease is a lock file per uid (``<dir>/<uid>``) held with ``flock`` by the
node process for as long as the sandbox has a QEMU on this node: another node
on the same host (another server, a test) never gets the same uid, and a node
that dies releases its leases with its file descriptors (its QEMUs die with it:
PR_SET_PDEATHSIG). Lock files are never removed (unlinking a flocked file lets
two holders lock different inodes of one name).
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
from pathlib import Path

from .errors import ConfinementError

# Above the subordinate ranges useradd hands out (100000 + 65536 per user) and
# systemd's container range (524288-1879048191), below 2^31 (some tools treat
# larger uids as negative).
DEFAULT_UID_BASE = 1_900_000_000
DEFAULT_UID_COUNT = 65_536


class UidLeases:
    """Leases of uids ``first .. first + count - 1``. Use from one thread."""

    def __init__(self, directory: Path, first: int = DEFAULT_UID_BASE, count: int = DEFAULT_UID_COUNT) -> None:
        if first < 1000 or count < 1 or first + count > 2**31 - 1:
            raise ConfinementError(f"uid range {first}+{count} must lie within 1000..2^31-2")
        self.dir = directory
        self.first = first
        self.count = count
        self._held: dict[int, int] = {}     # uid -> fd of its locked file

    def acquire(self) -> int:
        """A uid no other holder on this host has; ConfinementError when all are taken."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        start = secrets.randbelow(self.count)   # nodes scanning from one place would collide
        for i in range(self.count):
            uid = self.first + (start + i) % self.count
            if uid in self._held:
                continue
            fd = os.open(self.dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue
                raise ConfinementError(f"cannot lock {self.dir / str(uid)}: {e.strerror}") from None
            self._held[uid] = fd
            return uid
        raise ConfinementError(f"all {self.count} uids from {self.first} are leased on this host")

    def leased(self, uid: int) -> bool:
        """Whether ``uid`` is leased now, by this holder or any other on the host."""
        if uid in self._held:
            return True
        try:
            fd = os.open(self.dir / str(uid), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)    # drops a lock taken just for the look

    def release(self, uid: int) -> None:
        fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)    # closing drops the flock

    def held(self) -> list[int]:
        return sorted(self._held)

    def close(self) -> None:
        for uid in list(self._held):
            self.release(uid)
