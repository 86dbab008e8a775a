"""Fixtures for the API tests: a real ``aenv server`` subprocess on a free port.

One data dir is shared by the session (``node_data_dir``, tests/conftest.py: the
first server start builds the ``base`` template into it, later starts find it);
each test module starts its own server on it (modules run one after another). Stopping a server
checks that it exits cleanly and leaves no QEMU process behind."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

import pytest

from tests.aenv_vm.vm.procs import qemu_children
from tests.seed import BaseSeed, clean_env

if TYPE_CHECKING:
    from .inprocess import InProcessServer

REPO = Path(__file__).resolve().parents[3]
S = TypeVar("S", bound="HttpClient")
AENV = [sys.executable, "-m", "aenv_cli.main"]


@dataclass
class HttpClient:
    """What a test needs of a server it talks HTTP to: its URL, API key and data dir."""
    url: str
    api_key: str
    data_dir: Path

    def sdk_env(self) -> dict[str, str]:
        return {"E2B_API_KEY": self.api_key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url,
                "E2B_VOLUME_API_URL": self.url}

    def envd_token(self, sandbox_id: str, generation: int = 0) -> str:
        """The client's envd token docs/security.md specifies, computed independently:
        base64url(HMAC-SHA256(K, "<sandbox id>/<generation>")), unpadded, with the key
        K = HMAC-SHA256(the deployment's secret file, "aenv envd client token v1")."""
        return self._derived(b"aenv envd client token v1", f"{sandbox_id}/{generation}")

    def guest_token(self, sandbox_id: str) -> str:
        """The token the sandbox's own envd holds (never a client's), computed independently."""
        return self._derived(b"aenv envd guest token v1", sandbox_id)

    def _derived(self, label: bytes, message: str) -> str:
        secret = (self.data_dir / "envd-secret").read_text().strip().encode()
        key = hmac.new(secret, label, hashlib.sha256).digest()
        mac = hmac.new(key, message.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def traffic_token(self, sandbox_id: str) -> str:
        """The traffic access token docs/api.md specifies, computed independently: the envd
        derivation under the key HMAC-SHA256(secret, "aenv traffic access token v1")."""
        secret = (self.data_dir / "envd-secret").read_text().strip().encode()
        key = hmac.new(secret, b"aenv traffic access token v1", hashlib.sha256).digest()
        mac = hmac.new(key, sandbox_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                key: str | None = "default", raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
        """One HTTP request; (status, headers, parsed JSON body or raw bytes)."""
        hdrs = dict(headers or {})
        if key == "default":
            hdrs["X-API-Key"] = self.api_key
        elif key is not None:
            hdrs["X-API-Key"] = key
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, rh, payload = r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            status, rh, payload = e.code, dict(e.headers), e.read()
        ctype = rh.get("Content-Type", "")
        return status, rh, json.loads(payload) if payload and "json" in ctype else payload


@dataclass
class Server(HttpClient):
    """A real `aenv server` subprocess (and its QEMUs)."""
    proc: subprocess.Popen
    stderr_path: Path
    env: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill_all(self) -> int:
        """Kill every sandbox the node holds, running or paused (a module's leftovers
        would otherwise count against the next module's ``max_sandboxes`` on the shared
        data dir). Returns how many were killed."""
        ids: list[str] = []
        token: str | None = None
        while True:
            q = "/v2/sandboxes?state=running&state=paused&limit=100" + (f"&nextToken={token}" if token else "")
            status, headers, page = self.request("GET", q)
            assert status == 200, (status, page)
            ids += [s["sandboxID"] for s in page]
            token = headers.get("X-Next-Token")
            if not token:
                break
        for sid in ids:
            status, _, body = self.request("DELETE", f"/sandboxes/{sid}")
            assert status in (204, 404), (sid, status, body)
        return len(ids)

    def stop(self) -> None:
        if self.proc.poll() is None:
            qemus = qemu_children(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("aenv server did not stop within 60 s of SIGTERM:\n" + self.log()[-3000:])
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in qemus):
                time.sleep(0.1)
            left = [p for p in qemus if Path(f"/proc/{p}/stat").exists()
                    and "qemu" in Path(f"/proc/{p}/stat").read_text()]
            for p in left:
                os.kill(p, signal.SIGKILL)
            assert not left, f"QEMU processes outlived the server: {left}"
            assert self.proc.returncode == 0, f"server exit code {self.proc.returncode}:\n{self.log()[-3000:]}"


def start_server(data_dir: Path, log_dir: Path, *, env: dict[str, str] | None = None, timeout: float = 900.0,
                 extra_args: tuple[str, ...] = (), seed: BaseSeed | None = None) -> Server:
    """``aenv server`` on ``data_dir``; ``seed``: a fresh data dir gets the run's ``base``
    template instead of building its own (tests/seed.py). The server binds a port the
    kernel picks (``--port 0``) and prints its URL: a port probed free beforehand may be
    taken by another process's connection before the server binds it."""
    full_env = clean_env()
    full_env["AENV_VM__POOL_SIZE"] = "1"
    full_env["AENV_SERVER__DOMAIN"] = "aenv.test"  # host-routed sandbox traffic is tested too
    full_env.update(env or {})
    if seed is not None:
        seed.fill(data_dir, full_env)
    log_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=log_dir)
    stderr_path = Path(name)
    with open(fd, "wb") as err:
        proc = subprocess.Popen([*AENV, "server", "--data-dir", str(data_dir), "--port", "0", *extra_args],
                                cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    values: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(values) < 3:
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=10)
            raise AssertionError(f"aenv server exited ({proc.returncode}) before printing its E2B_* variables:\n"
                                 + stderr_path.read_text(errors="replace")[-4000:])
        if line.startswith("export E2B_"):
            name, _, value = line[len("export "):].strip().partition("=")
            values[name] = value
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("aenv server did not start in time")
    proc.stdout.close()
    assert re.fullmatch(r"http://127\.0\.0\.1:[1-9][0-9]*", values["E2B_API_URL"]), values
    assert values["E2B_SANDBOX_URL"] == values["E2B_API_URL"], values
    return Server(values["E2B_API_URL"], values["E2B_API_KEY"], data_dir, proc=proc, stderr_path=stderr_path,
                  env=full_env)


@contextlib.contextmanager
def serving(data_dir: Path, log_dir: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A server for the length of the block; it kills every sandbox it still holds
    before it stops (tests clean up: the next module starts with an empty node)."""
    srv = start_server(data_dir, log_dir, env=env)
    try:
        yield srv
    finally:
        try:
            if srv.proc.poll() is None:
                srv.kill_all()
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def server(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(node_data_dir, tmp_path_factory.mktemp("api-logs")) as srv:
        yield srv


def use_sdk_env(server: S, monkeypatch: pytest.MonkeyPatch) -> S:
    """Point the E2B SDK at ``server`` through environment variables only, as a user would."""
    for name in [n for n in os.environ if n.startswith("E2B_")]:
        monkeypatch.delenv(name)
    for name, value in server.sdk_env().items():
        monkeypatch.setenv(name, value)
    return server


@pytest.fixture
def sdk_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    return use_sdk_env(server, monkeypatch)


# -- the API in-process over a FakeSandboxService (inprocess.py): no QEMU -------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator["InProcessServer"]:
    """The API's semantics without a VM: one in-process server per module; each test
    starts with no sandboxes (``api_env`` kills what the previous one left)."""
    from .inprocess import InProcessServer

    srv = InProcessServer.start(tmp_path_factory.mktemp("api-fake"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def api_env(api: "InProcessServer", monkeypatch: pytest.MonkeyPatch) -> Iterator["InProcessServer"]:
    """``api`` with the E2B SDK pointed at it through environment variables only."""
    use_sdk_env(api, monkeypatch)
    try:
        yield api
    finally:
        api.kill_all()
