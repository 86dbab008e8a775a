"""Fixtures for the snapshot tests: the cached guest image, one store with a
256 MiB base template built once per session, and a QEMU / namespace leak check.

Tests marked ``qemu`` skip on a developer machine without QEMU or root, never in
CI (CI=true), where that is a failure."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.aenv_vm.vm.procs import qemu_children

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_store.store import Store
from aenv_vm.guest import GuestImage, ensure_guest
from aenv_vm.templates.template import Template, find_template
from tests.seed import BaseSeed
from tests.support import require


@dataclass(frozen=True)
class Env:
    guest: GuestImage
    settings: StoreSettings
    store: Store
    template: Template
    root: Path


def store_settings(data: Path) -> StoreSettings:
    return StoreSettings(paths=StorePaths(data), repository=RepositoryConfig(), store=StoreConfig(),
                         cache=CacheConfig(capacity=4 << 30, min_free_disk=0))


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed):  # type: ignore[no-untyped-def]
    """A store holding the run's ``base`` (tests/seed.py; built like a node's first start,
    256 MiB) for in-process managers."""
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86_64 not installed")
    require(os.geteuid() == 0, "building the guest image and reading /proc/PID/mem need root")
    guest = ensure_guest(quiet=True)
    root = tmp_path_factory.mktemp("snap")
    settings = store_settings(root / "data")
    base_seed.copy_repository(root / "data" / "repo")
    store = Store.open(settings)
    try:
        tpl = find_template(store, "base")
        yield Env(guest, settings, store, tpl, root)
    finally:
        store.close()




@pytest.fixture(autouse=True)
def no_leaked_qemu():  # type: ignore[no-untyped-def]
    before = set(qemu_children())
    yield
    leaked = set(qemu_children()) - before
    assert not leaked, f"test left QEMU processes running: {sorted(leaked)}"
