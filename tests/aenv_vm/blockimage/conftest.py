"""Fixtures: a real Store (posix_fs repository + node cache) in a temp data dir."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_store.store import Store


def store_settings(data_dir: Path, repo: Path | None = None, chunk_size: int = 64 * 1024) -> StoreSettings:
    return StoreSettings(
        paths=StorePaths(data_dir),
        repository=RepositoryConfig(path=str(repo) if repo else ""),
        store=StoreConfig(chunk_size=chunk_size, pack_target_size=4 << 20),
        cache=CacheConfig(capacity=1 << 30, min_free_disk=0),
    )


@pytest.fixture
def store(data_dir: Path) -> Iterator[Store]:
    s = Store.open(store_settings(data_dir), create=True)
    try:
        yield s
    finally:
        s.close()
