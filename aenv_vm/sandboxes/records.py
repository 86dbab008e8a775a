"""Sandbox records: what this node knows about each sandbox, kept in LMDB so a
paused sandbox survives a restart of the server.

One LMDB environment per node run directory (``<run_root>/records``), one
database ``sandboxes``: key = sandbox id, value = the record as canonical JSON.
Every change is one synchronous write transaction (records change a few times
per sandbox lifetime; durability matters more than speed here). A sync takes tens
of milliseconds on a busy disk: the manager makes the writes of its hot paths
(create, fork children, kill) on a worker thread, not on the event loop.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
from typing import Any

from ..errors import VmError
from ..net.policy import NetworkPolicy
from ..service import SandboxState
from ..volumes.mounts import VolumeMount


class RecordError(VmError):
    """The record store cannot be opened or holds something unreadable."""


@dataclass(frozen=True)
class SnapshotRef:
    """The latest pause of a sandbox. ``local`` is a directory with ``memory.delta``
    and ``device-state``; the ``*_id`` fields are store manifests once committed."""
    seq: int
    local: str
    base: str                       # hex id of the base memory image (full)
    disk_top: str | None            # committed layer the disk's upper layer sits on / was sealed into
    committed: bool = False         # disk sealed, delta + state + catalog record in the store
    memory_id: str | None = None
    state_id: str | None = None
    created: float = 0.0


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    template: str
    state: SandboxState
    started_at: float
    end_at: float                   # TTL deadline (unix time)
    auto_pause: bool = True
    timeout: float = 300.0          # seconds the TTL is set to on create/resume
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    # Egress of the sandbox (tap: its namespace's filter; user: restrict=on), kept across
    # pause/resume. None = not set at create (allowed, and shown as null, as E2B does).
    allow_internet_access: bool | None = None
    # The egress rules in force (net/policy.py NetworkPolicy.to_json), kept across
    # pause/resume, inherited by fork children; {} = none (everything public allowed).
    network: dict = field(default_factory=dict)
    memory_mib: int = 0
    vcpus: int = 0
    envd_port: int | None = None
    snapshot: SnapshotRef | None = None
    note: str = ""
    pause_memory: bool = True       # a TTL auto-pause keeps memory (False: filesystem only)
    cold_boot: bool = False         # paused filesystem-only: the next resume boots from the disk
    envd_unresponsive: bool = False # the last pause found envd not answering: resume by cold boot only
    # Volumes mounted into the guest (aenv_vm/volumes/mounts.py VolumeMount.to_json), mounted
    # again on resume and cold boot, inherited by fork children.
    volume_mounts: list = field(default_factory=list)
    # Fields of the layer above (the API's per-sandbox settings: alias, autoResume, proxy
    # rules), opaque here: kept, inherited by fork children and committed with every
    # pause, so that a node adopting the sandbox (handover.py) gets them too.
    annotations: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "SandboxRecord":
        d = json.loads(raw)
        d["state"] = SandboxState(d["state"])
        if d.get("snapshot") is not None:
            d["snapshot"] = SnapshotRef(**d["snapshot"])
        return cls(**d)

    @property
    def mounts(self) -> list[VolumeMount]:
        return [VolumeMount.from_json(m) for m in self.volume_mounts]

    @property
    def policy(self) -> NetworkPolicy:
        return NetworkPolicy.from_json(self.network)

    def replace(self, **changes: Any) -> "SandboxRecord":
        return dataclasses.replace(self, **changes)

    def remaining(self, now: float | None = None) -> float:
        return self.end_at - (time.time() if now is None else now)


_MAX_KEY = 511   # LMDB's default maximum key size


class RecordStore:
    """Sandbox records of one node. Thread-safe (LMDB transactions)."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        try:
            self._env = lmdb.open(str(path), map_size=256 << 20, max_dbs=2, subdir=True, sync=True)
        except lmdb.Error as e:
            raise RecordError(f"cannot open sandbox records at {path}: {e}") from None
        self._db = self._env.open_db(b"sandboxes")

    def put(self, rec: SandboxRecord) -> None:
        self.put_many([rec])

    def put_many(self, recs: list[SandboxRecord]) -> None:
        """Write ``recs`` in one transaction (one sync to disk)."""
        if not recs:
            return
        with self._env.begin(write=True, db=self._db) as txn:
            for rec in recs:
                txn.put(rec.id.encode(), rec.to_json())

    def get(self, sid: str) -> SandboxRecord | None:
        key = sid.encode()
        if not 0 < len(key) <= _MAX_KEY:   # no sandbox has such an id (and LMDB rejects the key)
            return None
        with self._env.begin(db=self._db) as txn:
            raw = txn.get(key)
        return None if raw is None else self._decode(sid, raw)

    def delete(self, sid: str) -> None:
        key = sid.encode()
        if not 0 < len(key) <= _MAX_KEY:
            return
        with self._env.begin(write=True, db=self._db) as txn:
            txn.delete(key)

    def all(self) -> list[SandboxRecord]:
        with self._env.begin(db=self._db) as txn:
            items = [(bytes(k).decode(), bytes(v)) for k, v in txn.cursor()]
        return [self._decode(k, v) for k, v in items]

    @staticmethod
    def _decode(sid: str, raw: bytes) -> SandboxRecord:
        try:
            return SandboxRecord.from_json(raw)
        except (ValueError, TypeError, KeyError) as e:
            raise RecordError(f"sandbox record {sid} is unreadable: {e}") from None

    def close(self) -> None:
        self._env.close()
