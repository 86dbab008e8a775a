"""Fixtures for the P2P tests: a fresh bucket of the session's moto S3 server
(tests/conftest.py)."""
from __future__ import annotations

import pytest

from aenv_store.config import RepositoryConfig

from tests.aenv_store.backends.motoserver import MotoServer


@pytest.fixture
def oss_repo(moto: MotoServer) -> RepositoryConfig:
    return RepositoryConfig(**moto.repository_config(moto.new_bucket()))  # type: ignore[arg-type]
