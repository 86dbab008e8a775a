"""The e2b npm SDK's Volume (pinned in tests/aenv_api/server/node) against `aenv server`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.aenv_api.server.conftest import Server
from tests.aenv_api.server.test_sdk_node import NODE_DIR
from tests.support import require

pytestmark = pytest.mark.qemu


def test_node_sdk_volume_flow(vol_server: Server) -> None:
    require(shutil.which("node") is not None, "node is not installed (scripts/install.sh installs it)")
    require((NODE_DIR / "node_modules" / "e2b").is_dir(), "e2b npm package missing: run scripts/install.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(vol_server.sdk_env())
    done = subprocess.run(["node", "volume_flow.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["listed"] and r["sameToken"] and r["destroyed"] is True
    assert r["written"] == {"path": "/a/b/hello.txt", "size": 15, "mode": 0o640, "type": "file"}
    assert r["text"] == "hello from node"
    assert r["bigSize"] == 4 << 20 and r["bigSame"] is True
    assert r["listing"] == ["/a", "/a/b", "/a/b/hello.txt", "/big.bin", "/d", "/d/e"]
    assert r["mode"] == 0o600 and r["exists"] == [True, False]
    assert r["noForce"] and r["missing"] and r["wrongToken"] and r["removed"]
