"""The template flow from the e2b npm SDK (tests/aenv_api/server/node/template_flow.mjs)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.aenv_api.server.conftest import Server

NODE_DIR = Path(__file__).resolve().parents[2] / "aenv_api" / "server" / "node"


def test_node_sdk_template_flow(tpl_server: Server) -> None:
    if shutil.which("node") is None or not (NODE_DIR / "node_modules" / "e2b").is_dir():
        pytest.fail("node and the e2b npm package are installed by scripts/install.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(tpl_server.sdk_env())
    done = subprocess.run(["node", "template_flow.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["templateId"] == "npm-app" and result["exists"] is True and result["missing"] is False
    assert result["tags"] == ["default", "stable"]
    lines = result["stdout"].split("\n")
    assert lines[:4] == ["/home/user/npm", "yes", "from npm copy", "npm-built"], result["stdout"]
    assert "python3 -m http.server 8081" in result["stdout"]
    assert result["steps"] >= 6 and result["cachedAgain"] == result["steps"] + 1, result
