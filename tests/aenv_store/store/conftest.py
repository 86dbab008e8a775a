"""Helpers for store tests: settings for a data dir sharing one repository."""
from __future__ import annotations

from pathlib import Path

import pytest

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings


def make_settings(data_dir: Path, repo: Path | None = None, chunk_size: int = 4096,
                  pack_target: int = 64 << 10) -> StoreSettings:
    """Small chunks and packs so tests exercise many chunks and several packs cheaply.
    Each data dir has its own node cache; ``repo`` lets several share a repository."""
    return StoreSettings(
        paths=StorePaths(data_dir),
        repository=RepositoryConfig(path=str(repo) if repo else ""),
        store=StoreConfig(chunk_size=chunk_size, pack_target_size=pack_target),
        cache=CacheConfig(capacity=64 << 20, min_free_disk=0),
    )


@pytest.fixture
def settings_factory(tmp_path: Path):
    def factory(name: str = "node", **kw: object) -> StoreSettings:
        return make_settings(tmp_path / name, tmp_path / "repo", **kw)  # type: ignore[arg-type]
    return factory
