"""Typed configuration of the storage engine (the ``[store]``, ``[cache]``,
``[repository]`` and ``[p2p]`` sections of aenv's TOML config).
Defaults are documented next to each field and in docs/config.md."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from .diskfloor import DiskFloor
from .errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclass(frozen=True)
class RepositoryConfig:
    # "posix_fs" (a directory, default) or "oss" (S3-compatible).
    backend: str = "posix_fs"
    # posix_fs: the repository directory ("" = <data-dir>/repo).
    path: str = ""
    # oss: endpoint URL ("" = AWS default), bucket, key prefix, region (required for oss),
    # addressing style ("auto" | "path" | "virtual"), credentials profile / static keys.
    endpoint_url: str = ""
    bucket: str = ""
    prefix: str = ""
    region: str = ""
    addressing_style: str = "auto"
    profile: str = ""
    access_key_id: str = field(default="", repr=False)
    secret_access_key: str = field(default="", repr=False)
    # A temporary credential's session token (with the two keys above).
    session_token: str = field(default="", repr=False)
    # The same three read from files (a Kubernetes secret volume, compose `secrets:`,
    # systemd LoadCredential=), relative to the data dir unless absolute; "" = not. A key
    # and its file are exclusive. With neither and no profile, the node takes
    # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN from its environment
    # once at start and removes them there (aenv_cli/node_secrets.py).
    access_key_id_file: str = ""
    secret_access_key_file: str = ""
    session_token_file: str = ""
    # Upload concurrency (parts of a multipart pack upload in flight).
    max_concurrency: int = 8


@dataclass(frozen=True)
class StoreConfig:
    # Fixed chunk size for new artifacts: a power of two, 4 KiB .. 4 MiB.
    # 64 KiB: see docs/benchmarks.md (dedup of in-place ext4 edits vs index size).
    chunk_size: int = 64 * KiB
    # zstd level for chunks in packs (1..19). Level 1 keeps ingest fast.
    compression_level: int = 1
    # A pack is closed once it holds this many (compressed) bytes.
    pack_target_size: int = 32 * MiB


@dataclass(frozen=True)
class CacheConfig:
    # Node cache capacity in bytes (data of cached chunks).
    capacity: int = 8 * GiB
    # Eviction starts above high_watermark * capacity and stops at low_watermark * capacity.
    high_watermark: float = 0.95
    low_watermark: float = 0.80
    # Keep at least this many bytes free on the cache's filesystem (and every other
    # filesystem the node writes: sandboxes' disks, volumes, uploads, builds).
    min_free_disk: int = 1 * GiB
    # ... and this many inodes (what 1 GiB holds at ext4's default of one inode per
    # 16 KiB): a guest making empty files in a volume uses inodes, not bytes.
    min_free_inodes: int = 65536
    # "" = <data-dir>/cache
    path: str = ""

    @property
    def floor(self) -> DiskFloor:
        """The free-disk floor every writer of the node keeps (bytes and inodes)."""
        return DiskFloor(self.min_free_disk, self.min_free_inodes)


@dataclass(frozen=True)
class P2PConfig:
    enabled: bool = False
    # Static peers: iroh node tickets / addresses.
    peers: tuple[str, ...] = ()
    # How long to wait for peers before falling back to the repository.
    lookup_timeout_ms: int = 300
    # Local UDP port for the iroh endpoint (0 = any).
    port: int = 0
    # The IP address the endpoint binds and puts into its ticket: other nodes must
    # reach it. "" = 127.0.0.1 (a single node), or in a fleet the host of
    # [cluster] advertise_url when that is an IP address (aenv_cli.config resolves it).
    host: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"p2p.port must be in 0..65535, got {self.port}")
        if self.host:
            try:
                ip = ipaddress.ip_address(self.host)
            except ValueError:
                raise ConfigError(f"p2p.host must be an IP address, got {self.host!r}") from None
            if ip.is_unspecified:
                # the ticket must name one address peers can reach, not "any"
                raise ConfigError(f"p2p.host must be one address of this node, not {self.host!r}")

    def bind_host(self) -> str:
        return self.host or "127.0.0.1"


@dataclass(frozen=True)
class StorePaths:
    """Where a node keeps its local state under the data dir."""

    data_dir: Path

    @property
    def repo(self) -> Path:
        return self.data_dir / "repo"

    @property
    def cache(self) -> Path:
        return self.data_dir / "cache"

    @property
    def workspace(self) -> Path:
        return self.data_dir / "workspace"


@dataclass(frozen=True)
class StoreSettings:
    """Everything the store needs, gathered for ``Store.open``."""

    paths: StorePaths
    repository: RepositoryConfig = field(default_factory=RepositoryConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    p2p: P2PConfig = field(default_factory=P2PConfig)
