"""Fixtures of the template build tests: one `aenv server` per module (the real E2B SDK
points at it through environment variables only), a COPY context directory."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.aenv_api.server.conftest import Server, start_server, use_sdk_env
from tests.seed import BaseSeed

REPO = Path(__file__).resolve().parents[3]
AENV = [sys.executable, "-m", "aenv_cli.main"]


@contextlib.contextmanager
def template_server(tmp_path_factory: pytest.TempPathFactory, ready_timeout: int = 15,
                    env: dict[str, str] | None = None, seed: BaseSeed | None = None) -> Iterator[Server]:
    """An `aenv server` on a data dir of its own (``env``: more settings; ``seed``: it
    starts with the run's ``base``), stopped (and checked) at the end."""
    if os.geteuid() != 0:
        pytest.skip("template builds need root (the guest image build)")
    data = tmp_path_factory.mktemp("tpl-node")
    srv = start_server(data, tmp_path_factory.mktemp("tpl-logs"),
                       env={"AENV_VM__POOL_SIZE": "0", "AENV_TEMPLATES__READY_TIMEOUT": str(ready_timeout),
                            "AENV_TEMPLATES__STEP_TIMEOUT": "120", **(env or {})}, seed=seed)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tpl_server(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed) -> Iterator[Server]:
    with template_server(tmp_path_factory, seed=base_seed) as srv:
        yield srv


@pytest.fixture
def sdk(tpl_server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    return use_sdk_env(tpl_server, monkeypatch)


def run_aenv(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AENV, *args, "--data-dir", str(data_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
