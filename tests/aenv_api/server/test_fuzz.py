"""Bad input against the API server: schemathesis over every operation of the served
OpenAPI document (valid and invalid bodies, queries, headers), and hypothesis-driven
junk in the proxy's routing headers. Never a 5xx, always E2B's JSON error shape.

The server is the real API in-process (inprocess.py: ApiServer, Lifecycle, the
template and volume APIs) over a fake sandbox service: what is fuzzed is the API, and
every sandbox a generated request creates, connects, forks or snapshots costs nothing
(on a node those were VMs, minutes of the run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from .conftest import HttpClient
from .inprocess import InProcessServer

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    srv = InProcessServer.start(tmp_path_factory.mktemp("fuzz"), templates=True, secrets_key="cd" * 32)
    try:
        yield srv
    finally:
        srv.stop()


def _schemathesis(server: HttpClient, key: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    seed = os.environ.get("AENV_FUZZ_SEED", "")
    # An invalid body over the server's 1 MiB control-plane limit is refused with 413
    # before it is parsed (schemathesis's defaults, 400/401/403/404/405/406/409/415/422/
    # 428/429/5xx, miss it: a generated 2 MB body of a build request was reported as
    # "accepted"). 5xx stays in the list only because the not_a_server_error check
    # judges those.
    config = tmp_path / "schemathesis.toml"
    config.write_text('[checks.negative_data_rejection]\nexpected-statuses = ["400", "401", "403", "404", "405", '
                      '"406", "409", "413", "415", "422", "428", "429", "5XX"]\n')
    argv = [str(SCHEMATHESIS), "--config-file", str(config), "run", f"{server.url}/openapi.json",
            "-H", f"X-API-Key: {key}",
            "--max-examples", os.environ.get("AENV_FUZZ_EXAMPLES", "25"), "--workers", "1",
            "--report", "junit", "--report-dir", str(tmp_path),
            "--request-timeout", "120", *extra]
    if seed:
        argv += ["--seed", seed]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900)


def test_schemathesis_every_operation(server: InProcessServer, tmp_path: Path) -> None:
    # positive_data_acceptance is left out on purpose: some valid-looking inputs depend on
    # server state or rules OpenAPI 3.0 cannot state (a nextToken this server issued,
    # no NUL in env var names), and 400 is the right answer for them.
    # ensure_resource_availability is left out too: E2B's paths delete a sandbox at
    # /sandboxes/{id} but create and connect it under /v2/sandboxes, and schemathesis
    # counts a DELETE only on a prefix of the path it checks, so a stateful scenario that
    # kills a sandbox and then connects to it reported the (correct) 404 as a created
    # resource gone missing. Create -> connect is tested with the SDKs.
    done = _schemathesis(server, server.api_key, tmp_path, "--exclude-checks",
                         "positive_data_acceptance,ensure_resource_availability")
    out = done.stdout[-6000:]
    assert done.returncode == 0, out
    assert "passed" in out and " 0 passed" not in out
    assert "Traceback" not in server.log()


def test_schemathesis_wrong_key_is_401_everywhere(server: InProcessServer, tmp_path: Path) -> None:
    done = _schemathesis(server, "e2b_" + "f" * 40, tmp_path, "--checks",
                         "not_a_server_error,status_code_conformance,content_type_conformance,"
                         "response_schema_conformance", "--max-examples", "5")
    assert done.returncode == 0, done.stdout[-6000:]
    for path in ("/v2/sandboxes", "/sandboxes/x", "/snapshots", "/metrics"):
        status, _, body = server.request("GET", path, key="e2b_" + "f" * 40)
        assert status == 401 and body == {"code": 401, "message": body["message"]} and body["message"]


def test_malformed_bodies(server: InProcessServer) -> None:
    cases = [b"{", b"[]", b"null", b'{"templateID": 5}', b'{"templateID": "base", "timeout": "5"}',
             b'{"templateID": "base", "timeout": -1}', b'{"templateID": "base", "timeout": 1e12}',
             b'{"templateID": "base", "metadata": {"a": 1}}', b'{"templateID": "base", "envVars": []}',
             b'{"templateID": "base", "autoResume": "yes"}', b'{"templateID": NaN}', "\udcff".encode(errors="surrogatepass"),
             b'{"templateID": "base", "timeout": 5.5}', b'{"templateID": "base", "secure": 1}']
    for raw in cases:
        status, headers, body = server.request("POST", "/v2/sandboxes", raw=raw,
                                               headers={"Content-Type": "application/json"})
        assert status == 400, (raw, status, body)
        assert headers["Content-Type"].startswith("application/json")
        assert set(body) == {"code", "message"} and body["code"] == 400 and body["message"]
    for raw in (b"\x0b", b"\x0c", b" \x0b\n"):   # not JSON whitespace: invalid JSON, not "no body"
        status, _, body = server.request("POST", "/sandboxes/sbx-nope/snapshots", raw=raw,
                                         headers={"Content-Type": "application/json"})
        assert status == 400 and body["code"] == 400, (raw, status, body)
    status, _, body = server.request("POST", "/sandboxes/sbx-nope/snapshots", raw=b" \t\r\n",
                                     headers={"Content-Type": "application/json"})
    assert status == 404, body      # JSON whitespace alone is no body: the id is looked up
    status, _, body = server.request("POST", "/v2/sandboxes", body={"templateID": "no-such-template"})
    assert status == 404 and "not found" in body["message"]
    status, _, body = server.request("POST", "/sandboxes/sbx-nope/timeout", body={"timeout": 10})
    assert status == 404 and body["code"] == 404
    status, _, body = server.request("POST", "/sandboxes/sbx-nope/fork", body={"count": 10_000})
    assert status == 400  # validated before the id is looked up
    status, _, body = server.request("GET", "/v2/sandboxes?limit=0")
    assert status == 400 and "limit" in body["message"]
    status, _, body = server.request("GET", "/v2/sandboxes?state=sleeping")
    assert status == 400 and "state" in body["message"]
    for empty in ("state=,", "state=running,", "state="):   # an empty item is outside the enum too
        status, _, body = server.request("GET", f"/v2/sandboxes?{empty}")
        assert status == 400 and "state" in body["message"], empty
    status, _, body = server.request("GET", "/v2/sandboxes?nextToken=garbage")
    assert status == 400 and body["code"] == 400
    status, _, body = server.request("GET", "/no/such/path")
    assert status == 404 and body["code"] == 404
    status, _, body = server.request("PUT", "/v2/sandboxes", body={})
    assert status == 405 and body["code"] == 405
    status, _, body = server.request("POST", "/v2/sandboxes", raw=b"x" * (2 << 20),
                                     headers={"Content-Type": "application/json"})
    assert status == 413 and body["code"] == 413


_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sid=_header_text, port=_header_text, token=_header_text, path=st.sampled_from(
    ["/health", "/files?path=/etc/hostname", "/process.Process/List", "/x/../../y"]))
def test_proxy_routing_headers_fuzz(server: InProcessServer, sid: str, port: str, token: str, path: str) -> None:
    status, headers, body = server.request("POST" if "Process" in path else "GET", path, key=None,
                                           raw=b"{}" if "Process" in path else None,
                                           headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": port,
                                                    "X-Access-Token": token, "Content-Type": "application/json"})
    assert status in (400, 401, 502), (sid, port, status, body)
    assert headers["Content-Type"].startswith("application/json") and body["code"] == status
    if status == 502:
        assert "was not found" in body["message"]


def test_empty_and_overlong_sandbox_ids(server: InProcessServer) -> None:
    """Ids no sandbox can have (empty, or past the record store's key size) are a 400 or
    a not-found like any unknown id, never a 500 (an empty header once reached LMDB)."""
    for sid in ("", "   ", "x" * 600):
        status, _, body = server.request("GET", "/health", key=None, headers={"E2b-Sandbox-Id": sid})
        assert status in (400, 502) and body["code"] == status, (sid[:10], status, body)
        if status == 502:
            assert "was not found" in body["message"]
    status, _, body = server.request("GET", "/sandboxes/" + "x" * 600)
    assert status == 404 and body["code"] == 404, body
    status, _, body = server.request("DELETE", "/sandboxes/" + "x" * 600)
    assert status == 404 and body["code"] == 404, body


def test_openapi_document_is_valid_and_matches_routes(server: InProcessServer) -> None:
    from openapi_spec_validator import validate

    status, _, doc = server.request("GET", "/openapi.json", key=None)
    assert status == 200
    validate(doc)
    ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    for op in [("POST", "/v2/sandboxes"), ("POST", "/sandboxes"), ("GET", "/v2/sandboxes"),
               ("POST", "/v2/sandboxes/{sandboxID}/connect"), ("DELETE", "/sandboxes/{sandboxID}"),
               ("POST", "/sandboxes/{sandboxID}/timeout"), ("GET", "/sandboxes/{sandboxID}"),
               ("POST", "/sandboxes/{sandboxID}/pause"), ("POST", "/sandboxes/{sandboxID}/snapshots"),
               ("GET", "/snapshots"), ("DELETE", "/templates/{templateID}"),
               ("POST", "/sandboxes/{sandboxID}/fork"), ("GET", "/sandboxes/{sandboxID}/metrics"),
               ("GET", "/health"), ("GET", "/metrics"), ("GET", "/openapi.json")]:
        assert op in ops, op
    assert json.dumps(doc).count('"ApiKeyAuth"') >= 10
