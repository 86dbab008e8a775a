"""The e2b npm SDK (pinned in tests/aenv_api/server/node/package-lock.json, installed by
scripts/install.sh) runs the core flow against `aenv server`: create (network
rules, a traffic token), run, write/read a file, updateNetwork, pause, resume
(connect), kill."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import Server
from tests.support import require

pytestmark = pytest.mark.qemu

NODE_DIR = Path(__file__).resolve().parent / "node"


def test_node_sdk_core_flow(server: Server) -> None:
    require(shutil.which("node") is not None, "node is not installed (scripts/install.sh installs it)")
    require((NODE_DIR / "node_modules" / "e2b").is_dir(), "e2b npm package missing: run scripts/install.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(server.sdk_env())
    done = subprocess.run(["node", "flow.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["resumed"] is True and result["killed"] is True and result["sandboxId"].startswith("sbx-")
    assert result["networkUpdated"] is True
    assert result["trafficAccessToken"] == server.traffic_token(result["sandboxId"])
    status, _, body = server.request("GET", f"/sandboxes/{result['sandboxId']}")
    assert status == 404 and body["code"] == 404
