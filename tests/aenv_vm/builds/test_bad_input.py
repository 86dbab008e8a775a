"""Every bad input of a template build gets a clear answer: a 4xx JSON error from the
API for malformed requests, a build status ``error`` with a reason naming the step and
that step's log for failures during the build; no half-made template becomes visible,
and afterwards the repository verifies clean and gc finds nothing orphaned."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest
from e2b import Template
from e2b.exceptions import BuildException

from tests.aenv_api.server.conftest import Server
from tests.aenv_vm.oci.ocibuild import D, F, Layer, OciLayout
from tests.aenv_vm.oci.registryproc import Registry

from .conftest import run_aenv


def _request(srv: Server, name: str) -> tuple[str, str]:
    status, _, body = srv.request("POST", "/v3/templates", {"name": name})
    assert status == 202, body
    return body["templateID"], body["buildID"]


def _start(srv: Server, name: str, build: dict[str, Any]) -> tuple[int, Any, str, str]:
    tid, bid = _request(srv, name)
    status, _, body = srv.request("POST", f"/v2/templates/{tid}/builds/{bid}", build)
    return status, body, tid, bid


def _fails(sdk: Server, template: Template, name: str) -> BuildException:
    with pytest.raises(BuildException) as err:
        Template.build(template, name)
    assert not Template.exists(name)
    status, _, body = sdk.request("GET", "/templates")
    assert name not in {t["templateID"] for t in body}
    return err.value


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry.start(tmp_path_factory.mktemp("reg"), auth=True)
    layout = OciLayout(tmp_path_factory.mktemp("layout"))
    desc, _ = layout.image([Layer([D("etc"), F("etc/os-release", "ID=tiny\n")])], {"Env": ["PATH=/bin"]})
    layout.tag("v1", desc)
    reg.push(layout.root, "v1", "private/tiny:v1")
    try:
        yield reg
    finally:
        reg.stop()


def test_malformed_requests_are_4xx(sdk: Server) -> None:
    cases = [
        ({"fromTemplate": "base", "steps": [{"type": "FROB", "args": []}]}, "unknown step type"),
        ({"fromTemplate": "base", "steps": "RUN ls"}, "steps must be an array"),
        ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": []}]}, "RUN takes"),
        ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": [1]}]}, "list of strings"),
        ({"steps": []}, "exactly one of fromImage and fromTemplate"),
        ({"fromImage": "x", "fromTemplate": "base"}, "exactly one of fromImage and fromTemplate"),
        ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["../etc/passwd", "/x"],
                                             "filesHash": "a" * 64}]}, "outside the build context"),
        ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["/etc/passwd", "/x"],
                                             "filesHash": "a" * 64}]}, "outside the build context"),
        ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a.txt", "/x"], "filesHash": "b" * 64}]},
         "were not uploaded"),
        ({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["1BAD", "v"]}]}, "bad environment variable"),
        ({"fromTemplate": "base", "steps": [{"type": "USER", "args": ["a b"]}]}, "USER takes"),
        ({"fromImage": "x", "fromImageRegistry": {"type": "aws", "awsAccessKeyId": "k"}}, "not supported"),
        ({"fromTemplate": "base", "force": "yes"}, "force must be a boolean"),
    ]
    for i, (body, words) in enumerate(cases):
        status, answer, tid, bid = _start(sdk, f"bad-{i}", body)
        assert status == 400 and words in answer["message"], (body, answer)
        assert answer["code"] == 400
    status, _, answer = sdk.request("POST", "/v3/templates", {"name": "Bad Name!"})
    assert status == 400 and "template name" in answer["message"]
    status, _, answer = sdk.request("POST", "/v3/templates", {"name": "ok-name", "cpuCount": 999})
    assert status == 400 and "cpuCount" in answer["message"]
    status, _, answer = sdk.request("POST", "/v3/templates", {"name": "base"})
    assert status == 409
    status, _, answer = sdk.request("POST", "/v2/templates/nope/builds/00000000-0000-4000-8000-000000000000",
                                    {"fromTemplate": "base"})
    assert status == 404
    status, _, answer = sdk.request("GET", "/templates/nope/builds/00000000-0000-4000-8000-000000000000/status")
    assert status == 404 and answer["code"] == 404
    status, _, answer = sdk.request("POST", "/v3/templates", raw=b"{not json",
                                    headers={"Content-Type": "application/json"})
    assert status == 400
    # a started build cannot be started twice
    status, _, tid, bid = _start(sdk, "once", {"fromTemplate": "base", "steps": []})
    assert status == 202
    status, _, answer = sdk.request("POST", f"/v2/templates/{tid}/builds/{bid}", {"fromTemplate": "base"})
    assert status == 409


def test_upload_url_is_signed(sdk: Server) -> None:
    tid, _ = _request(sdk, "upl")
    status, _, body = sdk.request("GET", f"/templates/{tid}/files/{'c' * 64}")
    assert status == 201 and body["present"] is False and "/_aenv/template-files/" in body["url"]
    url = body["url"]

    def put(u: str, data: bytes = b"x") -> int:
        req = urllib.request.Request(u, data=data, method="PUT")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            assert json.loads(e.read())["code"] == e.code
            return e.code
    assert put(url.replace("signature=", "signature=0")) == 401
    assert put(url.replace(f"{'c' * 64}", "d" * 64)) == 401          # a signature is for one hash
    signed, _, signature = url.partition("&signature=")
    expired = re.sub(r"expires=\d+", "expires=1", signed)
    assert put(f"{expired}&signature={signature}") == 401
    assert put(f"{signed}&signature=%CA%87%C7%9D%C9%AF") == 401   # non-ASCII (was a 500)
    status, _, body = sdk.request("GET", f"/templates/unknown-tpl/files/{'c' * 64}")
    assert status == 404


def test_build_failures_name_the_step(sdk: Server, registry: Registry) -> None:
    err = _fails(sdk, Template().from_template("base").run_cmd("echo ok").run_cmd("echo boom >&2; exit 3"),
                 "fail-run")
    assert "exited with code 3" in str(err) and "RUN echo boom" in str(err)

    err = _fails(sdk, Template().from_template("base").set_start_cmd("sleep 600", "false"), "fail-ready")
    assert "ready command" in str(err) and "did not succeed within 15 s" in str(err)

    err = _fails(sdk, Template().from_template("base").set_start_cmd("exit 4", "sleep 5; false"), "fail-start")
    assert "start command exited with code 4" in str(err)
    # a start command that finishes with 0 is a one-shot setup, not a failure (E2B's
    # finalize): the ready command still decides, and the build succeeds
    info = Template.build(Template().from_template("base").set_start_cmd("echo one-shot", "sleep 3"),
                          "start-exits-0", skip_cache=True)
    assert info.template_id

    err = _fails(sdk, Template().from_template("no-such-template"), "fail-base")
    assert "unknown template 'no-such-template'" in str(err)

    err = _fails(sdk, Template().from_image(f"{registry.host}/private/tiny:v1"), "fail-auth")
    assert "pulling" in str(err) and "needs credentials" in str(err)

    err = _fails(sdk, Template().from_image(f"{registry.host}/private/tiny:v1", username="aenv",
                                             password="wrong"), "fail-creds")
    assert "pulling" in str(err)

    err = _fails(sdk, Template().from_image(f"{registry.host}/private/missing:v1", username="aenv",
                                             password="s3cret-pass"), "fail-missing")
    assert "pulling" in str(err) and "not found" in str(err).lower()

    err = _fails(sdk, Template().from_image("127.0.0.1:1/nothing/here:v1"), "fail-unreachable")
    assert "pulling" in str(err)

    # the status names the failing step and carries its log
    tid, bid = _request(sdk, "fail-status")
    status, _, _ = sdk.request("POST", f"/v2/templates/{tid}/builds/{bid}", {
        "fromTemplate": "base", "steps": [{"type": "RUN", "args": ["echo fine"]},
                                          {"type": "RUN", "args": ["echo the-error-line; exit 9"]}]})
    assert status == 202
    import time
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status, _, st = sdk.request("GET", f"/templates/{tid}/builds/{bid}/status")
        if st["status"] in ("ready", "error"):
            break
        time.sleep(0.5)
    assert st["status"] == "error" and st["reason"]["step"] == "2", st
    assert any(e["message"] == "the-error-line" for e in st["reason"]["logEntries"]), st["reason"]
    assert all(e.get("step") == "2" for e in st["reason"]["logEntries"])


def test_repository_clean_after_failures(sdk: Server) -> None:
    """After every failure above (this module's server), nothing is orphaned."""
    verify = run_aenv(sdk.data_dir, "repo", "verify", "--read-data")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    gc = run_aenv(sdk.data_dir, "repo", "gc", "--grace", "0", "--output", "json")
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    assert report["packs_deleted"] == 0, report
    verify = run_aenv(sdk.data_dir, "repo", "verify", "--read-data")
    assert verify.returncode == 0, verify.stdout + verify.stderr
