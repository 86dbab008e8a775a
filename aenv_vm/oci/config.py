"""The ``[oci]`` section of aenv's config: registries, mirrors, the node's layer
cache and the disk size of pulled images (docs/config.md, docs/images.md)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import ConfigError

GiB = 1 << 30


@dataclass(frozen=True)
class OciConfig:
    # Docker's "registry-mirrors": base URLs (http:// or https://) of pull-through mirrors
    # of Docker Hub, tried in order before docker.io itself.
    registry_mirrors: tuple[str, ...] = ()
    # Mirrors of other registries, "REGISTRY=URL" (e.g. "ghcr.io=https://mirror.local"),
    # tried in order before that registry.
    mirrors: tuple[str, ...] = ()
    # Registries ("host" or "host:port") spoken to without verified TLS: HTTPS without
    # checking the certificate, else plain HTTP. Loopback registries need no entry.
    insecure_registries: tuple[str, ...] = ()
    # A Docker-style credentials file ({"auths": {"REGISTRY": {"auth": base64(user:pass)}}});
    # "" = none. Credentials given on the command line win.
    auth_file: str = ""
    # Where compressed layers are kept by digest; "" = <data-dir>/oci-cache.
    cache_path: str = ""
    # Bytes of layers the cache keeps (least recently used go first, after each pull).
    cache_capacity: int = 4 * GiB
    # Disk of a pulled image: the flattened tree's size * (1 + percent/100) + mib MiB.
    disk_headroom_percent: int = 50
    disk_headroom_mib: int = 256
    # Seconds to connect to a registry, and without any bytes on a response, before failing.
    timeout: float = 30.0
    # Layers downloaded at once.
    parallel_downloads: int = 3

    def __post_init__(self) -> None:
        for url in self.registry_mirrors:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"oci.registry_mirrors: {url!r} must start with http:// or https://")
        for item in self.mirrors:
            reg, sep, url = item.partition("=")
            if not sep or not reg or not url.startswith(("http://", "https://")):
                raise ConfigError(f"oci.mirrors: {item!r} must be REGISTRY=http(s)://HOST[:PORT]")
        if self.cache_capacity < 0:
            raise ConfigError("oci.cache_capacity must be >= 0")
        if not 0 <= self.disk_headroom_percent <= 1000 or self.disk_headroom_mib < 0:
            raise ConfigError("oci.disk_headroom_percent must be in 0..1000 and oci.disk_headroom_mib >= 0")
        if self.timeout <= 0 or not 1 <= self.parallel_downloads <= 16:
            raise ConfigError("oci.timeout must be > 0 and oci.parallel_downloads in 1..16")

    def cache_dir(self, data_dir: Path) -> Path:
        return Path(self.cache_path).expanduser() if self.cache_path else Path(data_dir) / "oci-cache"

    def mirrors_of(self, registry: str) -> list[str]:
        """Mirror base URLs for ``registry``, in the order to try them."""
        from .reference import DOCKER_HUB

        out = list(self.registry_mirrors) if registry == DOCKER_HUB else []
        for item in self.mirrors:
            reg, _, url = item.partition("=")
            if reg == registry:
                out.append(url)
        return [u.rstrip("/") for u in out]
