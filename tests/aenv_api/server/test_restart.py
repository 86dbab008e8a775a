"""Graceful shutdown pauses running sandboxes; the next start lists them as paused
and `connect` resumes them with their files and processes."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from .conftest import start_server

pytestmark = pytest.mark.qemu


def test_shutdown_pauses_and_restart_restores(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    logs = tmp_path_factory.mktemp("restart-logs")
    first = start_server(node_data_dir, logs)
    try:
        for k, v in first.sdk_env().items():
            monkeypatch.setenv(k, v)
        s = Sandbox.create(metadata={"suite": "restart"}, timeout=600,
                           network={"allow_out": ["example.com"], "deny_out": ["203.0.113.0/24"],
                                    "allow_public_traffic": False, "mask_request_host": "${PORT}-kept.test"})
        network = s.get_info().network
        s.files.write("/home/user/state.txt", "before restart")
        pid = s.commands.run("sleep 1000", background=True).pid
    finally:
        first.stop()  # SIGTERM: pauses the sandbox, kills the pool, exits 0, no QEMU left
    assert "stopping sandboxes" in first.log()

    second = start_server(node_data_dir, logs)
    try:
        for k, v in second.sdk_env().items():
            monkeypatch.setenv(k, v)
        assert second.api_key == first.api_key  # the key file persists
        assert s._envd_access_token == second.envd_token(s.sandbox_id)  # the secret persists too
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "restart"})).next_items()
        assert [(x.sandbox_id, x.state) for x in listed] == [(s.sandbox_id, SandboxState.PAUSED)]
        back = Sandbox.connect(s.sandbox_id)
        assert back.files.read("/home/user/state.txt") == "before restart"
        assert str(pid) in back.commands.run("ps -eo pid,args").stdout
        assert back._envd_access_token == s._envd_access_token
        # the network settings came back: rules from the node's records, the rest from the API's
        assert back.get_info().network == network and back.traffic_access_token == s.traffic_access_token
        port = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8080"}
        assert second.request("GET", "/", headers=port, key=None)[0] == 403       # no traffic token
        status, _, body = second.request("GET", "/", headers={**port, "e2b-traffic-access-token":
                                                               s.traffic_access_token}, key=None)
        assert status == 502 and "port 8080" in body["message"]                  # let through: nothing listens
        hdr = {"E2b-Sandbox-Id": s.sandbox_id}  # the token clients held before the restart still opens it
        status, _, body = second.request("GET", "/files?path=/home/user/state.txt", key=None,
                                         headers={**hdr, "X-Access-Token": s._envd_access_token})
        assert status == 200 and body == b"before restart"
        status, _, _ = second.request("GET", "/files?path=/home/user/state.txt", key=None,
                                      headers={**hdr, "X-Access-Token": second.envd_token("sbx-other")})
        assert status == 401
        back.kill()
        assert Sandbox.list(query=SandboxQuery(metadata={"suite": "restart"})).next_items() == []
    finally:
        second.stop()
    assert os.path.exists(node_data_dir / "api-key")
    assert stat.S_IMODE(os.stat(node_data_dir / "envd-secret").st_mode) == 0o600
