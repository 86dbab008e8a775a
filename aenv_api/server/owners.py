"""Which team owns each of a kind of thing the node's API made that outlives any
sandbox record: volumes (``POST /volumes``, ``<data-dir>/api-volume-teams.json``) and
the named snapshots recorded before a snapshot's record named its team
(``<data-dir>/api-snapshot-teams.json``: only read now, and an entry dropped with its
snapshot; a newer snapshot's owner is in its record, templates/meta.py ``team``, which
every node sharing the repository reads). Id → team id, written durably
(keystore.write_durably). A thing with no entry — made before teams existed, or on
another node of a fleet — is the default team's, so a deployment without teams sees
everything as before (and its map stays empty: the default needs no entry)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

from aenv_store.errors import ConfigError

from .keystore import DEFAULT_TEAM_ID, write_durably

SNAPSHOT_TEAMS_FILE = "api-snapshot-teams.json"
VOLUME_TEAMS_FILE = "api-volume-teams.json"


class OwnerMap:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._owners: dict[str, str] = {}
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
                raise ValueError("not an object of strings")
            self._owners = {str(k): v for k, v in raw.items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            # a lost map would hand every team's things to the default team: refuse to guess
            raise ConfigError(f"cannot read the owners file {path}: {e}") from None

    def owner(self, thing_id: str) -> str:
        return self._owners.get(thing_id, DEFAULT_TEAM_ID)

    def put(self, thing_id: str, team: str) -> None:
        if team == DEFAULT_TEAM_ID and thing_id not in self._owners:
            return      # the default needs no entry
        with self._lock:
            self._owners[thing_id] = team
            write_durably(self.path, json.dumps(self._owners, sort_keys=True))

    def drop(self, thing_id: str) -> None:
        with self._lock:
            if self._owners.pop(thing_id, None) is not None:
                write_durably(self.path, json.dumps(self._owners, sort_keys=True))
