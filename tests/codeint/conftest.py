"""One ``aenv server`` for the code interpreter tests (the session's: building the
template boots a VM and warms a kernel under TCG, a minute or more), with
``code-interpreter-v1`` built through the real e2b SDK's Template API; each test points
the SDK at it by environment only."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from e2b import Template

from tests.aenv_api.server.conftest import Server, start_server, use_sdk_env
from tests.seed import BaseSeed, Seed

from .template import NAME, code_interpreter_template

BUILD_SECONDS: dict[str, float] = {}


def _build_code_interpreter(srv: Server) -> float:
    """``code-interpreter-v1`` built on ``srv`` through the SDK; the seconds it took."""
    saved = {k: os.environ.get(k) for k in srv.sdk_env()}
    os.environ.update(srv.sdk_env())
    try:
        t0 = time.monotonic()
        Template.build(code_interpreter_template(), NAME, cpu_count=2, memory_mb=1024)
        return time.monotonic() - t0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


SERVER_ENV = {"AENV_VM__POOL_SIZE": "0", "AENV_TEMPLATES__READY_TIMEOUT": "600"}


@dataclass(frozen=True)
class CodeInterpreterSeed(Seed):
    """A repository holding ``base`` and ``code-interpreter-v1`` with its build cache, built
    once per run: another worker's build of the template on a copy hits the cache."""
    base: BaseSeed | None = None
    name: str = "code-interpreter"

    def build(self, data_dir: Path) -> None:
        srv = start_server(data_dir, data_dir / "logs", env=SERVER_ENV, seed=self.base)
        try:
            seconds = _build_code_interpreter(srv)
            print(f"\ncode-interpreter-v1 built in {seconds:.0f} s (the run's seed)")
        finally:
            srv.stop()


@pytest.fixture(scope="session")
def ci_server(tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("template builds need root (the guest image build)")
    # AENV_TEST_CODEINT_DATA: a data dir kept between runs (its build cache then holds the
    # steps: an unchanged template is not rebuilt). Otherwise the run's seed: the template
    # is built once for every worker (a build on its copy finds every step cached).
    keep = os.environ.get("AENV_TEST_CODEINT_DATA")
    data = Path(keep) if keep else tmp_path_factory.mktemp("ci-node")
    data.mkdir(parents=True, exist_ok=True)
    seed = None if keep else CodeInterpreterSeed(base_seed.root, base=base_seed)
    srv = start_server(data, tmp_path_factory.mktemp("ci-logs"), env=SERVER_ENV, seed=seed)
    try:
        BUILD_SECONDS[NAME] = _build_code_interpreter(srv)
        print(f"\ncode-interpreter-v1 built in {BUILD_SECONDS[NAME]:.0f} s")
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def ci(ci_server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    return use_sdk_env(ci_server, monkeypatch)
