"""The volumes of one node: records on disk, their trees, who mounts them.

Layout under ``root`` (``<data dir>/volumes``, mode 0700)::

    <volume id>/volume.json   the record: id, name, token, created_at, and the volume's
                              own quota when it was created with one (mode 0600)
    <volume id>/tree/         the volume's files (a VolumeTree); the only part a
                              sandbox ever sees
    .new-<id>/, .trash-<id>/  a create or delete in progress (removed at start)

A create builds ``.new-<id>/`` completely (record written durably) and renames it
to ``<id>/``: a crash leaves either no volume or a whole one. A delete renames
``<id>/`` to ``.trash-<id>/`` first (the volume is gone at that instant) and then
removes the trash.

Volume ids are UUIDs like E2B's; a token is 32 random bytes (urlsafe base64),
checked in constant time. Names follow E2B's pattern ``^[a-zA-Z0-9_-]+$`` and are
unique on the node. Which sandboxes mount a volume is kept in memory only (a
restarted node has no mounts until its sandboxes mount again); a mounted volume
cannot be deleted (``VolumeInUse``).

Each volume's quota (quota.py) is its record's, else the node's ``[volumes]``
defaults; what it uses is scanned once per node process, at first use, and kept
by every writer (``usage``).

Thread-safe: one lock guards the records and the mounts.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv_store.diskfloor import DiskFloor
from aenv_store.durable import fsync_dir, write_file_durable

from ..errors import BadRequest, Conflict, NotFound, VmError
from .charged import ChargedTree
from .quota import VolumeQuota, VolumeUsage

NAME = re.compile(r"[a-zA-Z0-9_-]{1,255}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
RECORD = "volume.json"
TREE = "tree"
TREE_ROOT_MODE = 0o777      # like a directory E2B makes: any guest user may write in it


class VolumeError(VmError):
    """Base of the volume registry's errors."""


class VolumeNotFound(VolumeError, NotFound):
    """No volume with that id on this node."""


class InvalidVolumeName(VolumeError, BadRequest):
    """The name does not match ``^[a-zA-Z0-9_-]+$`` (or is over 255 characters)."""


class VolumeNameTaken(VolumeError, Conflict):
    """A volume of that name exists on this node (E2B answers this with a 400)."""


class VolumeInUse(VolumeError, Conflict):
    """The volume is mounted by a sandbox; it cannot be deleted now."""


def is_volume_id(value: str) -> bool:
    """Whether ``value`` has the form of a volume id (a lower-case UUID)."""
    return isinstance(value, str) and _UUID.fullmatch(value) is not None


@dataclass(frozen=True)
class VolumeRecord:
    volume_id: str
    name: str
    token: str
    created_at: float        # Unix seconds
    max_bytes: int | None = None     # the volume's own quota; None: the node's default
    max_inodes: int | None = None

    def token_matches(self, presented: str) -> bool:
        """Constant-time comparison of ``presented`` with this volume's token."""
        return secrets.compare_digest(presented.encode("utf-8", "surrogateescape"), self.token.encode())

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"volume_id": self.volume_id, "name": self.name, "token": self.token,
                                  "created_at": self.created_at}
        if self.max_bytes is not None:
            out["max_bytes"] = self.max_bytes
        if self.max_inodes is not None:
            out["max_inodes"] = self.max_inodes
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "VolumeRecord":
        limits = [d.get("max_bytes"), d.get("max_inodes")]
        if any(v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0) for v in limits):
            raise ValueError("malformed volume quota")
        rec = cls(str(d["volume_id"]), str(d["name"]), str(d["token"]), float(d["created_at"]), limits[0], limits[1])
        if not is_volume_id(rec.volume_id) or not NAME.fullmatch(rec.name) or not rec.token:
            raise ValueError("malformed volume record")
        return rec


class VolumeRegistry:
    def __init__(self, root: Path, quota: VolumeQuota | None = None, floor: DiskFloor | None = None) -> None:
        """``quota``: what a volume created without its own may use (none by default);
        ``floor``: what every write into a volume leaves free on the node's disk."""
        self.root = Path(root)
        self.default_quota = quota if quota is not None else VolumeQuota()
        self.floor = floor if floor is not None else DiskFloor()
        self._lock = threading.Lock()
        self._records: dict[str, VolumeRecord] = {}
        self._mounts: dict[str, set[str]] = {}
        self._usage: dict[str, VolumeUsage] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._load()

    def _load(self) -> None:
        for entry in sorted(os.listdir(self.root)):
            path = self.root / entry
            if entry.startswith((".new-", ".trash-")):
                shutil.rmtree(path, ignore_errors=True)     # an interrupted create or delete
                continue
            if not is_volume_id(entry):
                continue
            try:
                rec = VolumeRecord.from_json(json.loads((path / RECORD).read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue       # not a volume (left alone for an operator to look at)
            if rec.volume_id == entry and (path / TREE).is_dir():
                self._records[rec.volume_id] = rec

    # ------------------------------------------------------------- records

    def create(self, name: str, max_bytes: int | None = None, max_inodes: int | None = None) -> VolumeRecord:
        """A new, empty volume (its own quota when given; 0: that bound off).
        ``InvalidVolumeName``, ``VolumeNameTaken``, ``BadRequest`` for a negative quota."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidVolumeName("a volume name matches ^[a-zA-Z0-9_-]+$ (at most 255 characters)")
        for what, v in (("maxBytes", max_bytes), ("maxInodes", max_inodes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise BadRequest(f"{what} must be an integer >= 0 (0: no bound)")
        with self._lock:
            if any(r.name == name for r in self._records.values()):
                raise VolumeNameTaken(f"Volume with name '{name}' already exists")
            rec = VolumeRecord(str(uuid.uuid4()), name, secrets.token_urlsafe(32), time.time(), max_bytes,
                               max_inodes)
            staging = self.root / f".new-{rec.volume_id}"
            try:
                staging.mkdir(mode=0o700)
                (staging / TREE).mkdir()
                os.chmod(staging / TREE, TREE_ROOT_MODE)
                write_file_durable(staging / RECORD, json.dumps(rec.to_json()).encode())
                os.chmod(staging / RECORD, 0o600)
                fsync_dir(staging)
                os.rename(staging, self.root / rec.volume_id)
                fsync_dir(self.root)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            self._records[rec.volume_id] = rec
            return rec

    def find(self, volume_id: str) -> VolumeRecord | None:
        with self._lock:
            return self._records.get(volume_id) if isinstance(volume_id, str) else None

    def get(self, volume_id: str) -> VolumeRecord:
        """The record, or ``VolumeNotFound``."""
        rec = self.find(volume_id)
        if rec is None:
            raise VolumeNotFound(f"Volume {str(volume_id)[:64]} not found")
        return rec

    def by_name(self, name: str) -> VolumeRecord | None:
        """The volume called ``name`` on this node (sandboxes mount volumes by name)."""
        with self._lock:
            return next((r for r in self._records.values() if r.name == name), None)

    def list(self) -> list[VolumeRecord]:
        """Every volume, oldest first."""
        with self._lock:
            return sorted(self._records.values(), key=lambda r: (r.created_at, r.volume_id))

    def delete(self, volume_id: str) -> None:
        """Remove the volume and its tree. ``VolumeNotFound``; ``VolumeInUse`` while a
        sandbox mounts it."""
        with self._lock:
            if volume_id not in self._records:
                raise VolumeNotFound(f"Volume {str(volume_id)[:64]} not found")
            users = self._mounts.get(volume_id)
            if users:
                raise VolumeInUse(f"volume {volume_id} is mounted by sandbox(es) {', '.join(sorted(users))}: "
                                  f"delete it when no sandbox mounts it")
            trash = self.root / f".trash-{volume_id}-{secrets.token_hex(4)}"
            os.rename(self.root / volume_id, trash)
            fsync_dir(self.root)
            del self._records[volume_id]
            self._mounts.pop(volume_id, None)
            self._usage.pop(volume_id, None)
        # outside the lock: a big tree takes a while; fd-based, never follows a symlink
        shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------- trees

    def tree_path(self, volume_id: str) -> Path:
        """Where the volume's files are on the host (for mounting). ``VolumeNotFound``."""
        return self.root / self.get(volume_id).volume_id / TREE

    def tree(self, volume_id: str) -> ChargedTree:
        """The volume's tree, its writes charged to its quota. ``VolumeNotFound``."""
        return ChargedTree(self.tree_path(volume_id), self.usage(volume_id), self.floor)

    def quota(self, rec: VolumeRecord) -> VolumeQuota:
        """The volume's bounds: its own where it has them, else the node's default."""
        d = self.default_quota
        return VolumeQuota(d.max_bytes if rec.max_bytes is None else rec.max_bytes,
                           d.max_inodes if rec.max_inodes is None else rec.max_inodes)

    def usage(self, volume_id: str) -> VolumeUsage | None:
        """What the volume uses, shared by every writer of it on this node (None: it has
        no quota, nothing is counted). ``VolumeNotFound``."""
        rec = self.get(volume_id)
        quota = self.quota(rec)
        if not quota.active:
            return None
        with self._lock:
            usage = self._usage.get(volume_id)
            if usage is None:
                usage = self._usage[volume_id] = VolumeUsage(self.root / volume_id / TREE, quota)
            return usage

    # ------------------------------------------------------------- mounts

    def mark_mounted(self, volume_id: str, sandbox_id: str) -> None:
        """Record that ``sandbox_id`` mounts the volume. ``VolumeNotFound``."""
        with self._lock:
            if volume_id not in self._records:
                raise VolumeNotFound(f"Volume {str(volume_id)[:64]} not found")
            self._mounts.setdefault(volume_id, set()).add(sandbox_id)

    def unmark(self, volume_id: str, sandbox_id: str) -> None:
        """Forget that ``sandbox_id`` mounts the volume (no error if it did not)."""
        with self._lock:
            users = self._mounts.get(volume_id)
            if users is not None:
                users.discard(sandbox_id)
                if not users:
                    del self._mounts[volume_id]

    def mounted_by(self, volume_id: str) -> frozenset[str]:
        """The sandboxes that mount the volume now."""
        with self._lock:
            return frozenset(self._mounts.get(volume_id, ()))
