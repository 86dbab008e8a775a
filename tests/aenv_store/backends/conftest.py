"""Fixtures for the remote-repository tests: the moto S3 server process (tests/conftest.py),
a fresh bucket per test, and a ``backend`` fixture parametrised over
posix_fs and oss so one suite checks both."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from aenv_store.config import RepositoryConfig
from aenv_store.repository.backends.base import Backend
from aenv_store.repository.backends.factory import open_backend

from .motoserver import MotoServer


@pytest.fixture
def oss_config(moto: MotoServer) -> RepositoryConfig:
    return RepositoryConfig(**moto.repository_config(moto.new_bucket()))  # type: ignore[arg-type]


def make_repository_config(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> RepositoryConfig:
    if kind == "posix_fs":
        return RepositoryConfig(backend="posix_fs", path=str(tmp_path / "repo"))
    server = request.getfixturevalue("moto")
    return RepositoryConfig(**server.repository_config(server.new_bucket()))


@pytest.fixture(params=["posix_fs", "oss"])
def repository_config(request: pytest.FixtureRequest, tmp_path: Path) -> RepositoryConfig:
    """The [repository] section for one backend kind; repository-level tests use this."""
    return make_repository_config(request.param, request, tmp_path)


@pytest.fixture
def backend(repository_config: RepositoryConfig, tmp_path: Path) -> Iterator[Backend]:
    b = open_backend(repository_config, tmp_path)
    try:
        yield b
    finally:
        b.close()
