"""Fixtures shared by every test package."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from .aenv_store.backends.motoserver import MotoServer
from .seed import BaseSeed, seed_root
from .support import require


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A fresh aenv data dir (config, repository, cache, workspace live under it)."""
    d = tmp_path / "aenv-data"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def _isolate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Tests never touch the user's real data dir or pick up a developer's AENV_* overrides.
    for name in list(os.environ):
        if name.startswith("AENV_") and name not in ("AENV_GUEST_CACHE",):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AENV_DATA_DIR", str(tmp_path / "default-data-dir"))
    # an in-process node builds no code-interpreter-v1 in the background (tests/codeint does)
    monkeypatch.setenv("AENV_SERVER__CODE_INTERPRETER", "false")


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One real moto S3 server process for the whole session (started on first use);
    tests take a fresh bucket each (``moto.new_bucket()``)."""
    server = MotoServer.start(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def node_data_dir(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed) -> Path:
    """One node data dir for the session's servers and in-process nodes (tests/aenv_api/server,
    tests/aenv_cli), its repository holding the run's ``base`` (tests/seed.py). A first
    start that builds ``base`` itself is the isolation, fleet and cluster tests' (their
    nodes start on empty data dirs)."""
    d = tmp_path_factory.mktemp("api-node")
    base_seed.fill(d, {})
    return d


@pytest.fixture(scope="session")
def base_seed(tmp_path_factory: pytest.TempPathFactory) -> BaseSeed:
    """The run's ``base`` template for fresh node data dirs (tests/seed.py), built on first use."""
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86_64 not installed")
    require(os.geteuid() == 0, "building the guest image needs root")
    return BaseSeed(seed_root(tmp_path_factory.getbasetemp()))
