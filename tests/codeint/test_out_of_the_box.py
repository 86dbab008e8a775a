"""``code-interpreter-v1`` without a step from the user (issue 30): the node builds it
at its first start, answers a create that comes before it is ready with 503 and
Retry-After (never 404), serves it as public, and does not build it again when it is
current."""
from __future__ import annotations

import json
import os

import pytest
from e2b_code_interpreter import Sandbox

from tests.aenv_api.server.conftest import Server

from .conftest import EARLY_CREATE, CodeInterpreterSeed
from .template import NAME


def test_a_create_during_the_first_build_is_told_to_retry(ci_server: Server, ci_seed: CodeInterpreterSeed) -> None:
    if os.environ.get("AENV_TEST_CODEINT_DATA"):
        pytest.skip("the template came from a kept data dir: no first build was watched")
    early = json.loads((ci_seed.data_dir / EARLY_CREATE).read_text())
    assert early["status"] == 503, early
    assert early["retryAfter"] is not None and int(early["retryAfter"]) > 0, early
    assert "being built" in early["body"]["message"], early
    assert early["seconds"] >= 4.5, early    # it waited for the build first ([templates] first_build_wait 5)


def test_the_sdk_default_template_works_out_of_the_box(ci: Server) -> None:
    with Sandbox.create() as sbx:       # the SDK's default: code-interpreter-v1, built by no one but the node
        assert sbx.run_code("x = 41; x + 1").text == "42"
    status, _, tpl = ci.request("GET", f"/templates/{NAME}")
    assert status == 200, tpl
    assert tpl["public"] is True, tpl


def test_a_node_on_a_current_template_builds_nothing(ci_server: Server) -> None:
    log = ci_server.log()
    assert f"template {NAME!r} ready" in log
    if not os.environ.get("AENV_TEST_CODEINT_DATA"):        # the seed's copy: current, so no build
        assert "building in the background" not in log, log[-3000:]
