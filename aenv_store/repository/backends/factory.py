"""Open the configured repository backend (``[repository] backend = ...``).

Configuration mistakes surface here, at startup, as ``ConfigError`` naming the
key (e.g. ``repository.region``), before anything touches the network."""
from __future__ import annotations

from pathlib import Path

from ...config import RepositoryConfig, StoreSettings
from ...errors import ConfigError
from .base import Backend
from .retry import RetryBackend, RetryPolicy

BACKENDS = ("posix_fs", "oss")


def repository_path(cfg: RepositoryConfig, data_dir: Path) -> Path:
    """Where a posix_fs repository lives: ``repository.path`` or ``<data-dir>/repo``."""
    return Path(cfg.path).expanduser() if cfg.path else data_dir / "repo"


def validate(cfg: RepositoryConfig) -> None:
    """Check the [repository] section without opening anything."""
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"repository.backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    if cfg.backend == "oss":
        from .oss import check_config

        check_config(cfg)


def open_backend(cfg: RepositoryConfig, data_dir: Path, retry: RetryPolicy | None = None) -> Backend:
    """The backend for ``cfg``. Remote backends come wrapped in ``RetryBackend``."""
    validate(cfg)
    if cfg.backend == "posix_fs":
        from .posix_fs import PosixFsBackend

        return PosixFsBackend(repository_path(cfg, data_dir))
    from .oss import OssBackend

    return RetryBackend(OssBackend(cfg), retry)


def open_backend_for(settings: StoreSettings, retry: RetryPolicy | None = None) -> Backend:
    return open_backend(settings.repository, settings.paths.data_dir, retry)
