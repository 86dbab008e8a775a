"""smolagents' E2B executor on aenv, unchanged (issue 30): its ``CodeAgent`` with
``executor_type="e2b"`` runs a scripted three-step task (tests/harness/smolagents_flow.py)
in the harness's own venv, pinned by tests/harness/smolagents.lock, with only the E2B_*
variables set; the sandbox is the node's own code-interpreter-v1."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.aenv_api.server.conftest import Server
from tests.seed import clean_env

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-harness" / "smolagents" / "bin" / "python"


def test_smolagents_code_agent_runs_on_aenv(ci_server: Server) -> None:
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: scripts/install.sh makes it from tests/harness/smolagents.lock")
    env = {**clean_env(), **ci_server.sdk_env()}
    done = subprocess.run([str(PYTHON), str(REPO / "tests" / "harness" / "smolagents_flow.py")], env=env,
                          capture_output=True, text=True, timeout=600, cwd="/")
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["answer"] == {"total": 24, "python": 3}, out
    assert out["steps"] == 3, out
    # the failing cell's output and error came back to the model as its observation
    assert "total 24" in out["observations"][1] and "on purpose" in out["observations"][1], out
    assert "rows 12" in out["observations"][0], out
    # the agent's exit killed its sandbox
    status, _, _ = ci_server.request("GET", f"/sandboxes/{out['sandbox']}")
    assert status == 404
