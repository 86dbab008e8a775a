"""One ``aenv server`` for the code interpreter tests (the session's), with
``code-interpreter-v1`` as a fresh node has it: built by the node itself at its first
start (``[server] code_interpreter``, aenv_cli/codeint_template.py), with no step from
the test; each test points the SDK at it by environment only."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.aenv_api.server.conftest import Server, start_server, use_sdk_env
from tests.seed import BaseSeed, Seed

from .template import NAME

BUILD_SECONDS: dict[str, float] = {}
# what a create from code-interpreter-v1 answered while the seed's node was building it
EARLY_CREATE = "early-create.json"


def wait_built(srv: Server, timeout: float = 1200) -> float:
    """Seconds until the node's own build of ``code-interpreter-v1`` is ready (its log says
    so); fails at once if the node reports it failed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = srv.log()
        if f"template {NAME!r} ready" in text:
            return time.monotonic() - t0
        if f"template {NAME!r}: the build" in text or f"template {NAME!r}: not built" in text:
            raise AssertionError("the node's build of code-interpreter-v1 failed:\n" + text[-4000:])
        assert srv.proc.poll() is None, "aenv server exited:\n" + text[-4000:]
        time.sleep(1)
    raise AssertionError(f"code-interpreter-v1 not built within {timeout} s:\n" + srv.log()[-4000:])


# the early create (CodeInterpreterSeed) waits 5 s for the build, not 45: a quiet machine
# builds the template within 45 s, and the 503 is what is checked
SERVER_ENV = {"AENV_VM__POOL_SIZE": "0", "AENV_TEMPLATES__READY_TIMEOUT": "600",
              "AENV_SERVER__CODE_INTERPRETER": "true", "AENV_TEMPLATES__FIRST_BUILD_WAIT": "5"}


@dataclass(frozen=True)
class CodeInterpreterSeed(Seed):
    """A repository holding ``base`` and the ``code-interpreter-v1`` a node made at its
    first start, once per run: the other servers on copies find it current."""
    base: BaseSeed | None = None
    name: str = "code-interpreter"

    def build(self, data_dir: Path) -> None:
        srv = start_server(data_dir, data_dir / "logs", env=SERVER_ENV, seed=self.base)
        try:
            # a create before the template is ready: the node is building it, so 503 with
            # Retry-After after a short wait (never 404); kept for test_state's check
            t0 = time.monotonic()
            status, headers, body = srv.request("POST", "/sandboxes", {"templateID": NAME})
            (data_dir / EARLY_CREATE).write_text(json.dumps({
                "status": status, "retryAfter": headers.get("Retry-After"), "body": body,
                "seconds": time.monotonic() - t0}))
            seconds = wait_built(srv)
            print(f"\ncode-interpreter-v1 built by the node in {seconds:.0f} s (the run's seed)")
        finally:
            srv.kill_all()
            srv.stop()


@pytest.fixture(scope="session")
def ci_seed(base_seed: BaseSeed) -> CodeInterpreterSeed:
    return CodeInterpreterSeed(base_seed.root, base=base_seed)


@pytest.fixture(scope="session")
def ci_server(tmp_path_factory: pytest.TempPathFactory, ci_seed: CodeInterpreterSeed) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("template builds need root (the guest image build)")
    # AENV_TEST_CODEINT_DATA: a data dir kept between runs (the node builds the template
    # there when its sources changed). Otherwise the run's seed: built once for every
    # worker; a node on a copy finds it current and builds nothing.
    keep = os.environ.get("AENV_TEST_CODEINT_DATA")
    data = Path(keep) if keep else tmp_path_factory.mktemp("ci-node")
    data.mkdir(parents=True, exist_ok=True)
    srv = start_server(data, tmp_path_factory.mktemp("ci-logs"), env=SERVER_ENV, seed=None if keep else ci_seed)
    try:
        BUILD_SECONDS[NAME] = wait_built(srv)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def ci(ci_server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    return use_sdk_env(ci_server, monkeypatch)
