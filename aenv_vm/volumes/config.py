"""The ``[volumes]`` config section: what a volume may use of the node's disk (docs/config.md)."""
from __future__ import annotations

from dataclasses import dataclass

from aenv_store.errors import ConfigError

from .quota import VolumeQuota

GiB = 1 << 30


@dataclass(frozen=True)
class VolumesConfig:
    # Bytes a volume's files may take on the node's disk (allocated blocks; 0: no bound
    # but the node's free-disk floor). A volume created with its own ``maxBytes`` has that.
    max_bytes: int = 32 * GiB
    # Files, directories and symlinks a volume may hold (0: no bound but the floor's
    # inodes). A volume created with its own ``maxInodes`` has that.
    max_inodes: int = 1_000_000

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.max_inodes < 0:
            raise ConfigError("volumes.max_bytes and volumes.max_inodes must be >= 0 (0: no bound)")

    @property
    def quota(self) -> VolumeQuota:
        return VolumeQuota(self.max_bytes, self.max_inodes)
