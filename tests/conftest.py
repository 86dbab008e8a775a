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

# The longest test files (minutes each under TCG, from the suite's --durations), run
# first: scripts/test.sh hands whole files to its two workers in collection order
# (--dist loadfile --no-loadscope-reorder), so a long file that came last would run
# alone at the end while the other worker idles. xdist's own reorder (files with the
# most tests first) put exactly these, which have one or two tests each, last.
LONGEST_FIRST = (
    "aenv_vm/isolation/test_base_trust.py",
    "aenv_fleet/test_fleet.py",
    "aenv_vm/sandboxes/test_faults.py",
    "aenv_vm/builds/test_ready_without_start.py",
    "aenv_api/server/hostile/test_secrets.py",
    "aenv_api/server/test_sdk_pause_modes.py",
    "aenv_vm/isolation/test_attack.py",
    "aenv_api/server/hostile/test_envd_answers.py",
    "aenv_api/server/hostile/test_uploads_builds.py",
    "aenv_vm/builds/test_bad_input.py",
    "aenv_api/server/test_load.py",
    "aenv_store/admin/test_crash.py",
    "codeint/test_sdk_sync.py",
    "aenv_api/server/test_cluster_moves.py",
    "aenv_api/server/test_rl_load.py",
    "aenv_vm/builds/test_sdk_build.py",
    "aenv_vm/builds/test_dockerfile_build.py",
    "aenv_api/server/test_fuzz.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (LONGEST_FIRST's order), every other in collection order;
    a file's own tests keep their order."""
    here = Path(__file__).parent
    rank = {str(here / f): i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))


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
