"""`aenv sandbox ...` as a client of the API in-process over a fake sandbox service
(inprocess.py): what the CLI and the API do without a guest. Moved from
test_sandbox_cli.py, which keeps what needs one."""
from __future__ import annotations

import json
import subprocess

from tests.aenv_api.server.conftest import AENV, REPO
from tests.aenv_api.server.inprocess import InProcessServer

from .test_sandbox_cli import aenv


def test_cli_errors_are_one_line(api: InProcessServer) -> None:
    bad_key = subprocess.run([*AENV, "sandbox", "ls", "--url", api.url, "--api-key", "e2b_wrong"],
                             cwd=REPO, capture_output=True, timeout=60)
    assert bad_key.returncode == 1 and bad_key.stderr.decode().startswith("aenv: error: server answered 401")
    down = subprocess.run([*AENV, "sandbox", "ls", "--url", "http://127.0.0.1:9", "--api-key", "k"],
                          cwd=REPO, capture_output=True, timeout=60)
    assert down.returncode == 1 and "cannot reach the aenv server" in down.stderr.decode()
    bad_meta = subprocess.run([*AENV, "sandbox", "create", "--url", api.url, "--api-key", api.api_key,
                               "-m", "novalue"], cwd=REPO, capture_output=True, timeout=60)
    assert bad_meta.returncode == 2 and b"KEY=VALUE" in bad_meta.stderr and b"Traceback" not in bad_meta.stderr


def test_timeout_expiry_reaches_the_logs(api: InProcessServer) -> None:
    """A TTL expiry (below the API) is logged for a paused sandbox, and a killed one
    leaves no logs or API state behind."""
    import time

    paused = aenv(api, "sandbox", "create", "--timeout", "2", "--auto-pause").stdout.decode().strip()
    killed = aenv(api, "sandbox", "create", "--timeout", "2").stdout.decode().strip()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = json.loads(aenv(api, "sandbox", "info", paused, "-o", "json").stdout)["state"]
            gone = api.request("GET", f"/sandboxes/{killed}")[0] == 404
            if state == "paused" and gone:
                break
            time.sleep(0.5)
        assert state == "paused" and gone
        messages = [e["message"] for e in json.loads(aenv(api, "sandbox", "logs", paused, "-o", "json").stdout)]
        assert messages == ["sandbox created", "sandbox paused: its timeout expired"]
        assert api.request("GET", f"/v2/sandboxes/{killed}/logs")[0] == 404
        assert not (api.data_dir / "sandbox-logs" / f"{killed}.jsonl").exists()
        assert killed not in (api.data_dir / "api-sandboxes.json").read_text()
    finally:
        aenv(api, "sandbox", "kill", paused, ok=False)
