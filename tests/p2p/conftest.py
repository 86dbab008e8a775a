"""Fixtures for the P2P tests: the moto S3 server process from tests/remote
(loaded by path; the test tree is not a package) and node helpers."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

from aenv_store.config import RepositoryConfig


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


motoserver = _load("aenv_tests_motoserver", Path(__file__).parent.parent / "remote" / "motoserver.py")


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator["motoserver.MotoServer"]:
    server = motoserver.MotoServer.start(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def oss_repo(moto: "motoserver.MotoServer") -> RepositoryConfig:
    return RepositoryConfig(**moto.repository_config(moto.new_bucket()))  # type: ignore[arg-type]
