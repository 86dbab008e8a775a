"""X-Access-Token: off until /init sets it, then enforced on everything but /health."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator

import pytest
from e2b import Sandbox
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import AuthenticationException
from packaging.version import Version

from envd import ENVD_VERSION, VERSION_HEADER

from .conftest import TEST_USER, Envd, start_envd, stop_envd


@pytest.fixture
def fresh_envd(test_user) -> Iterator[Envd]:  # type: ignore[no-untyped-def]
    e = start_envd("--user", TEST_USER)
    try:
        yield e
    finally:
        stop_envd(e)


def _http(url: str, method: str = "GET", body: dict | None = None, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("X-Access-Token", token)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _sandbox(url: str, token: str | None) -> Sandbox:
    headers = {} if token is None else {"X-Access-Token": token}
    config = ConnectionConfig(debug=True, sandbox_url=url, api_key="test", extra_sandbox_headers=headers)
    return Sandbox(
        sandbox_id="auth-test", sandbox_domain=None, envd_version=Version("0.6.7"),
        envd_access_token=token, connection_config=config,
    )


def test_token_enforced_after_init(fresh_envd: Envd, workdir) -> None:  # type: ignore[no-untyped-def]
    url = fresh_envd.url
    # before /init: open
    assert _sandbox(url, None).commands.run("true").exit_code == 0
    status, _ = _http(url + "/init", "POST", {"accessToken": "s3cret", "envVars": {"GLOBAL_VAR": "from-init"}})
    assert status == 204

    anon, wrong, good = _sandbox(url, None), _sandbox(url, "nope"), _sandbox(url, "s3cret")
    for sbx in (anon, wrong):
        with pytest.raises(AuthenticationException):
            sbx.commands.run("true")
        with pytest.raises(AuthenticationException):
            sbx.files.read(str(workdir / "whatever"))
        with pytest.raises(AuthenticationException):
            sbx.files.write(str(workdir / "w.txt"), "x")
        with pytest.raises(AuthenticationException):
            sbx.files.list(str(workdir))
        assert sbx.is_running() is True  # /health stays public
    assert not (workdir / "w.txt").exists()

    # the right token works, and /init's env vars reach every process
    assert good.commands.run("echo $GLOBAL_VAR").stdout == "from-init\n"
    good.files.write(str(workdir / "ok.txt"), "fine")
    assert good.files.read(str(workdir / "ok.txt")) == "fine"

    for path in ("/envs", "/metrics"):
        status, body = _http(url + path)
        assert status == 401 and json.loads(body)["code"] == 401
        assert _http(url + path, token="s3cret")[0] == 200
    assert json.loads(_http(url + "/envs", token="s3cret")[1]) == {"GLOBAL_VAR": "from-init"}
    # raw Connect call: 401 with a Connect JSON error body
    req = urllib.request.Request(url + "/process.Process/List", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=10)
    assert ei.value.code == 401 and json.loads(ei.value.read())["code"] == "unauthenticated"

    # re-init needs the current token (header or body), then may rotate it
    assert _http(url + "/init", "POST", {"accessToken": "other"})[0] == 401
    assert _http(url + "/init", "POST", {"accessToken": "rotated"}, token="s3cret")[0] == 204
    with pytest.raises(AuthenticationException):
        good.commands.run("true")
    assert _sandbox(url, "rotated").commands.run("true").exit_code == 0


def test_metrics_and_health_shapes(fresh_envd: Envd) -> None:
    assert _http(fresh_envd.url + "/health")[0] == 204
    # /health names the envd version (templates record it at build: aenv_vm/templates/base.py)
    with urllib.request.urlopen(fresh_envd.url + "/health", timeout=10) as r:
        assert r.headers[VERSION_HEADER] == ENVD_VERSION
    status, body = _http(fresh_envd.url + "/metrics")
    m = json.loads(body)
    assert status == 200
    assert m["cpu_count"] >= 1 and 0 <= m["cpu_used_pct"] <= 100
    assert 0 < m["mem_used"] < m["mem_total"] and m["mem_total_mib"] == m["mem_total"] >> 20
    assert 0 < m["disk_used"] <= m["disk_total"]
    assert isinstance(m["ts"], int)


def test_default_user_falls_back_when_missing(test_user) -> None:  # type: ignore[no-untyped-def]
    e = start_envd("--user", "no-such-user-abc")
    try:
        sbx = Sandbox.create(debug=True, sandbox_url=e.url, api_key="test")
        assert sbx.commands.run("id -u").stdout.strip() == "0"  # the user envd runs as
        # /init can change the default user
        assert _http(e.url + "/init", "POST", {"defaultUser": TEST_USER})[0] == 204
        assert sbx.commands.run("id -un").stdout.strip() == TEST_USER
    finally:
        stop_envd(e)
