"""Fixtures shared by every test package."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from .aenv_store.backends.motoserver import MotoServer
from .seed import BaseSeed, seed_root
from .support import require


WEIGHTS = Path(__file__).resolve().parent / "file_weights.json"
# The network namespace the tests run in. The fleet tests move the test thread into a
# hub namespace of their own for a module; one that failed to move it back would leave
# every later test of the worker unable to reach its loopback servers.
_HOME_NETNS = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
_libc = ctypes.CDLL(None, use_errno=True)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest test files first (tests/file_weights.json, written from a whole run by
    scripts/test_weights.py), each file's tests in their own order: with --dist loadfile
    the workers take files in this order, so a long file never starts last while the
    other worker has nothing left (longest first keeps the run's tail short)."""
    try:
        weights: dict[str, float] = json.loads(WEIGHTS.read_text())
    except (OSError, ValueError):
        return
    root = Path(str(config.rootpath))

    def weight(item: pytest.Item) -> float:
        try:
            rel = Path(str(item.path)).resolve().relative_to(root).as_posix()
        except ValueError:
            return 0.0
        return weights.get(rel, 0.0)
    items.sort(key=weight, reverse=True)        # stable: a file's tests keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of a module (its module fixtures are gone), the test thread
    must be back in its own network namespace: put it back and fail that teardown."""
    result = yield
    if nextitem is not None and nextitem.path == item.path:
        return result
    if os.stat("/proc/thread-self/ns/net").st_ino == os.fstat(_HOME_NETNS).st_ino:
        return result
    if _libc.setns(_HOME_NETNS, 0x40000000) != 0:     # CLONE_NEWNET
        pytest.exit(f"the test thread is stuck in another network namespace (errno {ctypes.get_errno()})")
    raise AssertionError(f"{item.path.name} left the test thread in another network namespace (moved back)")


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A fresh aenv data dir (config, repository, cache, workspace live under it)."""
    d = tmp_path / "aenv-data"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def _isolate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Tests never touch the user's real data dir or pick up a developer's AENV_* overrides
    # (but the guest cache, and AENV_FAULT_SEED: the seed of the crash tests' random points).
    for name in list(os.environ):
        if name.startswith("AENV_") and name not in ("AENV_GUEST_CACHE", "AENV_FAULT_SEED"):
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
