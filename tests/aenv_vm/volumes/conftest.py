"""One `aenv server` for the volume API tests (its own data dir, no sandbox pool: the
volume API needs no VM, only the server's first start boots one to build its base
template). The real E2B SDK reaches it through environment variables only."""
from __future__ import annotations

import os
import shutil
from typing import Iterator

import pytest

from tests.aenv_api.server.conftest import Server, start_server, use_sdk_env
from tests.seed import BaseSeed


@pytest.fixture(scope="module")
def vol_server(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed) -> Iterator[Server]:
    if os.geteuid() != 0 or shutil.which("qemu-system-x86_64") is None:
        if os.environ.get("CI"):
            pytest.fail("the volume API tests need root and qemu-system-x86_64 (required in CI)")
        pytest.skip("aenv server needs root and qemu-system-x86_64")
    srv = start_server(tmp_path_factory.mktemp("vol-node"), tmp_path_factory.mktemp("vol-logs"),
                       env={"AENV_VM__POOL_SIZE": "0"}, seed=base_seed)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def sdk(vol_server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    return use_sdk_env(vol_server, monkeypatch)
