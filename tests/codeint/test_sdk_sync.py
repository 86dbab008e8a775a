"""The real ``e2b-code-interpreter`` SDK (sync) against ``aenv server`` and the
``code-interpreter-v1`` template (issue 15, acceptance 1 and 4)."""
from __future__ import annotations

import base64
import time
from typing import Iterator

import pytest
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import ChartType, LineChart
from e2b_code_interpreter.models import Context

from tests.aenv_api.server.conftest import Server


@pytest.fixture
def sbx(ci: Server) -> Iterator[Sandbox]:
    s = Sandbox.create(envs={"SBX_LEVEL": "from-create"})
    try:
        yield s
    finally:
        s.kill()


def test_state_output_and_callbacks(sbx: Sandbox) -> None:
    assert sbx.run_code("x = 1").error is None
    r = sbx.run_code("x + 1")
    assert r.results[0].text == "2" and r.text == "2" and r.results[0].is_main_result
    assert r.error is None and r.execution_count is not None and r.execution_count >= 2
    r = sbx.run_code("print('hello'); import sys; print('oops', file=sys.stderr)")
    assert r.logs.stdout == ["hello\n"] and r.logs.stderr == ["oops\n"] and not r.results

    seen: list[tuple[str, str, float]] = []
    t0 = time.monotonic()
    r = sbx.run_code(
        "import sys, time\nprint('first', flush=True)\ntime.sleep(2)\n"
        "print('second', file=sys.stderr, flush=True)\ntime.sleep(1)\n"
        "from IPython.display import display, HTML\ndisplay(HTML('<b>shown</b>'))\n'last'",
        on_stdout=lambda m: seen.append(("stdout", m.line, time.monotonic())),
        on_stderr=lambda m: seen.append(("stderr", m.line, time.monotonic())),
        on_result=lambda res: seen.append(("result", res.text or res.html or "", time.monotonic())))
    done = time.monotonic()
    assert [(k, v) for k, v, _ in seen] == [("stdout", "first\n"), ("stderr", "second\n"),
                                            ("result", "<IPython.core.display.HTML object>"), ("result", "last")]
    # while the cell ran (the guest's sleep under TCG is not quite the host's seconds)
    assert seen[0][2] < seen[1][2] - 1 < done - 1.5, (seen, done, t0)
    assert r.results[0].html == "<b>shown</b>" and not r.results[0].is_main_result
    assert r.results[1].is_main_result and r.text == "last"


def test_rich_results(sbx: Sandbox) -> None:
    r = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [4, 1, 9], label='growth')\nplt.title('Growth')\nplt.xlabel('time (s)')\n"
        "plt.ylabel('size [m]')\nplt.show()")
    assert r.error is None, r.error
    png = [res for res in r.results if res.png]
    assert len(png) == 1 and base64.b64decode(png[0].png)[:8] == b"\x89PNG\r\n\x1a\n"
    chart = png[0].chart
    assert isinstance(chart, LineChart) and chart.type == ChartType.LINE and chart.title == "Growth"
    assert chart.x_label == "time (s)" and chart.x_unit == "s" and chart.y_unit == "m"
    assert chart.elements[0].label == "growth" and chart.elements[0].points == [(1, 4), (2, 1), (3, 9)]

    r = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    res = r.results[0]
    assert "<table" in res.html and "a  b" in res.text and res.data == {"a": [1, 2], "b": ["x", "y"]}
    r = sbx.run_code("from IPython.display import Markdown, Latex, SVG, JSON\n"
                     "display(Markdown('# t'), Latex('$x$'))\n{'k': [1, 2]}")
    assert [x.markdown for x in r.results[:1]] == ["# t"] and r.results[1].latex == "$x$"
    assert r.results[2].json == {"k": [1, 2]} and r.results[2].is_main_result


def test_errors_and_timeout(sbx: Sandbox) -> None:
    r = sbx.run_code("def f():\n    return 1 / 0\nf()")
    assert r.error is not None and r.error.name == "ZeroDivisionError" and r.error.value == "division by zero"
    assert "return 1 / 0" in r.error.traceback and "\x1b[" not in r.error.traceback
    sbx.run_code("y = 'kept'")
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\nwhile True:\n    time.sleep(0.1)", timeout=3)
    assert time.monotonic() - t0 < 20
    t0 = time.monotonic()
    r = sbx.run_code("y")     # the kernel was interrupted, not restarted
    assert r.text == "kept" and time.monotonic() - t0 < 15, r


def test_contexts(sbx: Sandbox) -> None:
    sbx.run_code("shared = 'default'")
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp" and ctx.id
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
    r = sbx.run_code("shared", context=ctx)
    assert r.error is not None and r.error.name == "NameError"      # contexts are isolated
    sbx.run_code("mine = 5", context=ctx)
    assert sbx.run_code("mine", context=ctx).text == "5"
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}
    sbx.restart_code_context(ctx)
    assert sbx.run_code("mine", context=ctx).error.name == "NameError"   # restart clears state
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
    sbx.remove_code_context(ctx.id)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)
    assert sbx.run_code("shared").text == "default"

    b = sbx.create_code_context(language="bash", cwd="/home/user")
    assert b.language == "bash"
    r = sbx.run_code("cd /tmp; X=5; echo hi", context=b)
    assert r.logs.stdout == ["hi\n"] and r.error is None
    assert sbx.run_code("echo $X $PWD", context=b).logs.stdout == ["5 /tmp\n"]
    r = sbx.run_code("echo out; echo err >&2; false", context=b)
    assert r.logs.stdout == ["out\n"] and r.logs.stderr == ["err\n"] and r.error.value == "1"
    r = sbx.run_code("echo $X", language="bash")        # the default bash context is another one
    assert r.logs.stdout == ["\n"] and r.error is None


def test_envs(sbx: Sandbox) -> None:
    r = sbx.run_code("import os; (os.environ.get('FOO'), os.environ.get('SBX_LEVEL'))", envs={"FOO": "bar"})
    assert r.text == "('bar', 'from-create')", r
    assert sbx.run_code("import os; 'FOO' in os.environ").text == "False"   # per call only
    r = sbx.run_code("echo $FOO-$SBX_LEVEL", language="bash", envs={"FOO": "b a'r"})
    assert r.logs.stdout == ["b a'r-from-create\n"]
    assert sbx.run_code("echo [$FOO]", language="bash").logs.stdout == ["[]\n"]


def test_bad_input(ci: Server, sbx: Sandbox) -> None:
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=Context("no-such-context", "python", "/"))
    with pytest.raises(SandboxException, match="unknown language"):
        sbx.run_code("1", language="cobol")
    with pytest.raises(SandboxException, match="400"):
        sbx.create_code_context(cwd="/no/such/dir")
    with pytest.raises(NotFoundException):
        sbx.remove_code_context("no-such-context")
    with pytest.raises(NotFoundException):
        sbx.restart_code_context("no-such-context")

    hdrs = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999",
            "X-Access-Token": sbx._envd_access_token or ""}
    for raw, why in [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'{"code": 5}', "string"),
                     (b'{"code": "1", "env_vars": {"A": 1}}', "must be a string"),
                     (b'{"code": "1", "language": "python", "context_id": "x"}', "Only one of")]:
        status, _, body = ci.request("POST", "/execute", raw=raw, key=None,
                                     headers={**hdrs, "Content-Type": "application/json"})
        assert status == 400 and why in body["error"], (raw, status, body)
    status, _, body = ci.request("GET", "/nope", key=None, headers=hdrs)
    assert status == 404 and "no such endpoint" in body["error"]
    status, _, body = ci.request("PUT", "/contexts", key=None, headers=hdrs)
    assert status == 405

    # a cell that kills the kernel: reported, and the next cell runs on a new kernel
    sbx.run_code("before = 1")
    r = sbx.run_code("import os; os._exit(1)")
    assert r.error is not None and r.error.name == "KernelDied" and "variables are gone" in r.error.value
    r = sbx.run_code("1 + 1")
    assert r.text == "2", r
    assert sbx.run_code("before").error.name == "NameError"
    # a bash context that exits
    r = sbx.run_code("exit 3", language="bash")
    assert r.error is not None and r.error.name == "ContextExited"
    assert sbx.run_code("echo back", language="bash").logs.stdout == ["back\n"]
    # a cell that ignores the interrupt: the context gets a new kernel, the server goes on
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\nwhile True:\n    try:\n        time.sleep(60)\n    except KeyboardInterrupt:\n"
                     "        pass", timeout=2)
    t0 = time.monotonic()
    assert sbx.run_code("'alive'").text == "alive"
    assert time.monotonic() - t0 < 120


def test_execute_without_the_token_is_refused_and_envs_still_arrive(ci: Server) -> None:
    """Issue 28, acceptance 3: through the node's proxy, a raw /execute without the envd
    access token (the sandbox id is all it knows) is 401 and runs nothing; the owner's
    first cell afterwards, through the SDK, finds the sandbox's envs in the kernel."""
    import json
    import urllib.error
    import urllib.request

    s = Sandbox.create(envs={"OWNER_ONLY": "from-create"})
    try:
        for token in (None, "wrong-token"):
            headers = {"Content-Type": "application/json", "E2b-Sandbox-Id": s.sandbox_id,
                       "E2b-Sandbox-Port": "49999"}
            if token:
                headers["X-Access-Token"] = token
            req = urllib.request.Request(f"{ci.url}/execute", method="POST", headers=headers,
                                         data=json.dumps({"code": "open('/tmp/intruder', 'w').close()"}).encode())
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            assert e.value.code == 401
            assert json.loads(e.value.read())["code"] == 401
        r = s.run_code("import os; (os.environ.get('OWNER_ONLY'), os.path.exists('/tmp/intruder'))")
        assert r.error is None and r.text == "('from-create', False)", r
    finally:
        s.kill()
