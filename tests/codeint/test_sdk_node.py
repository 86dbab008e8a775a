"""The @e2b/code-interpreter npm SDK (pinned in tests/codeint/node/package-lock.json,
installed by scripts/install.sh) through the core flow (issue 15, acceptance 2)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.aenv_api.server.conftest import Server
from tests.support import require

NODE_DIR = Path(__file__).resolve().parent / "node"


def test_node_sdk_core_flow(ci: Server) -> None:
    require(shutil.which("node") is not None, "node is not installed (scripts/install.sh installs it)")
    require((NODE_DIR / "node_modules" / "@e2b" / "code-interpreter").is_dir(),
             "@e2b/code-interpreter npm package missing: run scripts/install.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")} | ci.sdk_env()
    done = subprocess.run(["node", "flow.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ok"] is True and out["timeoutError"], out
