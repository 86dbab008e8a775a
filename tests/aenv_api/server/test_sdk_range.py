"""E2B Python SDKs older than the pinned one, each in its own venv (tests/sdk_range/*.lock,
made by scripts/install.sh), run the core flows (scripts/sdk_range/flows.py: create,
commands, background, PTY, files, batch write, watch, pause then connect, templates,
kill) against a real node with only the E2B variables set:

* 2.10.0 sends its connect with the sandbox's routing headers (the node once took it
  for sandbox traffic: the sandbox stayed paused) and a connected sandbox's envd calls
  without them (the node finds the sandbox by the envd token they carry);
* 2.5.0 ignores ``E2B_SANDBOX_URL``: with ``E2B_DEBUG=true`` it sends every sandbox's
  envd calls to localhost:49983, which the node serves with ``[server]
  envd_debug_port`` (routed by token; a paused sandbox wakes, since that SDK's connect
  never calls the server in debug mode).

The whole spread of versions is scripts/sdk_range/run.py's (docs/conformance.md)."""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import REPO, Server, serving

pytestmark = [pytest.mark.qemu]

DEBUG_PORT = 49983      # where E2B SDKs in debug mode reach every sandbox's envd


@pytest.fixture(scope="module")
def server(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(node_data_dir, tmp_path_factory.mktemp("api-logs"),
                 env={"AENV_SERVER__ENVD_DEBUG_PORT": str(DEBUG_PORT)}) as srv:
        yield srv


def flows(server: Server, version: str, **env: str) -> dict[str, tuple[str, str]]:
    """``{flow: (PASS|FAIL|NONE, why)}`` of flows.py run by SDK ``version``."""
    py = REPO / ".venv-sdk" / f"e2b-{version}" / "bin" / "python"
    assert py.exists(), f"{py} is missing: scripts/install.sh makes it"
    full = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    full.update(server.sdk_env(), **env)
    done = subprocess.run([str(py), str(REPO / "scripts" / "sdk_range" / "flows.py")], env=full, cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    out = {}
    for line in done.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[0] == version:
            out[parts[1]] = (parts[2], parts[3] if len(parts) > 3 else "")
    assert out, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def test_sdk_2_10_every_core_flow(server: Server) -> None:
    got = flows(server, "2.10.0")
    failed = {k: v for k, v in got.items() if v[0] == "FAIL"}
    assert not failed, failed
    assert got["pause_connect"][0] == "PASS" and got["template"][0] == "PASS", got
    assert {k for k, v in got.items() if v[0] == "NONE"} == {"fork", "volumes"}, got   # not in 2.10


def test_sdk_2_5_in_debug_mode_through_the_envd_debug_port(server: Server) -> None:
    got = flows(server, "2.5.0", E2B_DEBUG="true")
    failed = {k: v for k, v in got.items() if v[0] == "FAIL"}
    assert not failed, failed
    assert got["commands"][0] == got["files"][0] == got["pause_connect"][0] == "PASS", got


def _debug_call(path: str, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{DEBUG_PORT}{path}", headers=headers, method="GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_the_envd_debug_port_serves_only_a_token_holder(server: Server) -> None:
    """No token, a wrong one, or the API's key: 401 in JSON, and no control plane there."""
    for headers in ({}, {"X-Access-Token": "not-a-token"}, {"X-API-Key": server.api_key}):
        status, body = _debug_call("/sandboxes", headers)
        assert status == 401 and body["code"] == 401, (headers, status, body)
    status, body = _debug_call("/health", {"X-Access-Token": "not-a-token"})
    assert status == 401 and "X-Access-Token" in body["message"], body
