"""Per-sandbox fields of the API that the sandbox layer does not keep (alias,
autoResume, disk size, and what the proxy applies to traffic into the sandbox:
``allowPublicTraffic``, ``maskRequestHost``, ``httpsPorts``), in one small JSON
file beside the node's records: ``<data-dir>/api-sandboxes.json``, rewritten
whole (tmp + rename) on change. Fork children get their parent's. No secret
is kept here: a traffic access token is derived from the sandbox id (auth.py).

The same fields go into the sandbox's own record (``ANNOTATION``, written in the
record's one synchronous LMDB transaction at create, inherited by fork children,
moved with the sandbox), and that copy is the one that counts: this file is written
after the VM is up and without fsync, so it may be torn, lost or never written (a
full disk). ``record_extra`` reads the record's copy; the file only serves records
without one (made before the annotation existed)."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from aenv_wire.team_keys import TEAM_ANNOTATION

from .keystore import DEFAULT_TEAM_ID

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Extra:
    alias: str | None = None
    auto_resume: bool = False
    disk_mb: int = 0
    public_traffic: bool = True             # False: every guest port but envd's demands the traffic token
    mask_request_host: str | None = None    # the Host header of requests into the sandbox ("${PORT}" in it)
    https_ports: tuple[int, ...] = ()       # guest ports the proxy reaches over TLS

    @classmethod
    def from_json(cls, raw: dict) -> "Extra":
        return cls(**{**raw, "https_ports": tuple(raw.get("https_ports") or ())})

    def annotation(self) -> str:
        """These fields as the sandbox layer keeps them with the sandbox (``ANNOTATION``),
        so that they move with it to another node (docs/api.md "Moving sandboxes")."""
        return json.dumps({k: v for k, v in asdict(self).items() if k != "disk_mb"}, sort_keys=True,
                          separators=(",", ":"))

    @classmethod
    def from_annotation(cls, raw: str, disk_mb: int) -> "Extra":
        """ValueError/TypeError for something ``annotation`` did not write."""
        obj = json.loads(raw)
        if not isinstance(obj, dict) or "disk_mb" in obj:
            raise ValueError(f"not an {ANNOTATION} annotation: {raw[:80]!r}")
        return cls.from_json({**obj, "disk_mb": disk_mb})


ANNOTATION = "api.extra"    # the key of ``Extra.annotation`` among a sandbox's annotations
# The team that owns a sandbox (keystore.py), among its annotations: the sandbox layer keeps
# it durably in the sandbox's record, fork children inherit it, and it moves with the
# sandbox to another node (a fleet node copies it into the sandbox's Redis binding, for
# the gateways). A sandbox made before teams existed has none: the default team's.
# (TEAM_ANNOTATION, aenv_wire/team_keys.py)


def team_of(annotations: Mapping[str, str]) -> str:
    return annotations.get(TEAM_ANNOTATION) or DEFAULT_TEAM_ID


def record_extra(annotations: Mapping[str, str], disk_mb: int) -> Extra | None:
    """The fields a sandbox's own record carries, None when it carries none (a sandbox
    not made through this API, or made before the annotation). ValueError/TypeError
    when the annotation is there but unreadable: the caller must not guess rules then."""
    raw = annotations.get(ANNOTATION)
    return None if raw is None else Extra.from_annotation(raw, disk_mb)


class ApiExtras:
    """Per-sandbox API fields the sandbox layer does not keep."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._items: dict[str, Extra] = {}
        self.unreadable: str | None = None      # why the file could not be read at start, if it could not
        try:
            raw = json.loads(path.read_text())
            self._items = {k: Extra.from_json(v) for k, v in raw.items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError) as e:
            log.warning("ignoring unreadable %s: %s", path, e)
            self.unreadable = f"{path.name}: {e}"

    def get(self, sid: str) -> Extra:
        return self._items.get(sid) or Extra()

    def find(self, sid: str) -> Extra | None:
        """The sandbox's fields, None for a sandbox this API did not create."""
        return self._items.get(sid)

    def put(self, sid: str, extra: Extra) -> None:
        self._items[sid] = extra
        self._save()

    def drop(self, sids: list[str]) -> None:
        if any(s in self._items for s in sids):
            for s in sids:
                self._items.pop(s, None)
            self._save()

    def keep_only(self, sids: set[str]) -> None:
        self.drop([s for s in self._items if s not in sids])

    def _save(self) -> None:
        """Best effort: a failed write (a full disk) costs only what records without an
        annotation keep here; the proxy's rules come from the records (``record_extra``)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({k: asdict(v) for k, v in self._items.items()}, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not write %s: %s", self.path, e)
