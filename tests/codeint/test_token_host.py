"""The code interpreter's access-token check (issue 28), on this host: a real envd
(``python -m envd``) holding a token and the sandbox's envs, and the code interpreter
server asking it. ``/execute`` without the token or with a wrong one is 401 before
anything runs; the owner's envs reach the kernel afterwards all the same; envd gone is a
503 (the check fails closed); the server's own rehearsal needs no token (it warms with a
token set, else /health would never say 200)."""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.envd.conftest import Envd, start_envd, stop_envd
from tests.support import free_port, require

from .test_server_host import PY, REPO, _has_ipython

TOKEN = "owner-token-0123456789"


def _request(port: int, body: dict, token: str | None = None, timeout: float = 120) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["X-Access-Token"] = token
    c.request("POST", "/execute", json.dumps(body), headers)
    r = c.getresponse()
    return r.status, r.read()


def _results(raw: bytes) -> list[str]:
    lines = [json.loads(x) for x in raw.splitlines()]
    return [x.get("text") for x in lines if x["type"] in ("result", "stdout")]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Envd]]:
    """envd with a token and envs (what the node's /init does at a restore), then codeint."""
    require(_has_ipython(), "the host's python3 has no IPython (scripts/install.sh installs python3-ipykernel)")
    envd = start_envd()
    proc = None
    try:
        c = http.client.HTTPConnection("127.0.0.1", envd.port, timeout=10)
        c.request("POST", "/init", json.dumps({"accessToken": TOKEN, "envVars": {"OWNER_VAR": "from-create"}}),
                  {"Content-Type": "application/json"})
        assert c.getresponse().status == 204
        port = free_port()
        logs = tmp_path_factory.mktemp("codeint-token")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        with open(logs / "server.log", "wb") as log:
            proc = subprocess.Popen([PY, "-m", "codeint", "--host", "127.0.0.1", "--port", str(port),
                                     "--envd-port", str(envd.port), "--cwd", str(logs), "--log-dir", str(logs)],
                                    cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                h = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                h.request("GET", "/health")
                if h.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (logs / "server.log").read_text()[-2000:]
            time.sleep(0.3)
        yield port, envd
    finally:
        if proc is not None:
            kids = psutil.Process(proc.pid).children(recursive=True)
            proc.terminate()
            proc.wait(timeout=30)
            for k in kids:
                if k.is_running():
                    k.kill()
            psutil.wait_procs(kids, timeout=10)
        stop_envd(envd)


def test_execute_needs_the_token_and_envs_still_arrive(secured: tuple[int, Envd], tmp_path: Path) -> None:
    port, _ = secured
    flag = tmp_path / "ran"
    code = f"open({str(flag)!r}, 'w').close()"
    status, body = _request(port, {"code": code})
    assert status == 401, body
    assert json.loads(body) == {"error": "unauthorized access, please provide a valid access token", "code": 401}
    status, body = _request(port, {"code": code}, token="not-the-token")
    assert status == 401 and json.loads(body)["error"] == "invalid access token"
    status, body = _request(port, {"code": code, "language": "bash"})
    assert status == 401, body
    status, body = _request(port, {"code": "x"})    # not even a body is looked at first
    assert status == 401, body
    assert not flag.exists()
    # the owner's first cells: the sandbox's envs reach both kernels
    status, body = _request(port, {"code": "import os; os.environ.get('OWNER_VAR')"}, token=TOKEN)
    assert status == 200 and _results(body) == ["from-create"], body
    status, body = _request(port, {"code": "echo $OWNER_VAR", "language": "bash"}, token=TOKEN)
    assert status == 200 and _results(body) == ["from-create\n"], body
    status, body = _request(port, {"code": "1 + 1"})
    assert status == 401, body


def test_envd_gone_fails_closed(secured: tuple[int, Envd]) -> None:
    port, envd = secured
    stop_envd(envd)
    status, body = _request(port, {"code": "1"}, token=TOKEN)
    assert status == 503 and "envd does not answer" in json.loads(body)["error"], body
