"""The code-interpreter SDK's core flows (``e2b-code-interpreter``), run by run.py --ci
in a venv holding one version: one line per flow, ``<version>\\t<flow>\\tPASS|FAIL|NONE``.
The sandbox is the SDK's default template, ``code-interpreter-v1``, as the node makes it."""
from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

from e2b_code_interpreter import Sandbox

from flowlib import need, runner  # beside this script (its directory is on sys.path)

VERSION = importlib.metadata.version("e2b-code-interpreter")
flow = runner(VERSION)


def main() -> int:
    made: list[Any] = []

    def create() -> None:
        made.append(Sandbox.create(timeout=300) if hasattr(Sandbox, "create") else Sandbox(timeout=300))
    if not flow("create", create):
        return 1
    sbx = made[0]

    def value() -> None:
        assert sbx.run_code("x = 41; x + 1").text == "42"

    def streams() -> None:
        out: list[str] = []
        ex = sbx.run_code("import sys; print('to-out'); print('to-err', file=sys.stderr)",
                          on_stdout=lambda m: out.append(m.line))
        assert ex.logs.stdout == ["to-out\n"] and ex.logs.stderr == ["to-err\n"], ex.logs
        assert out == ["to-out\n"], out

    def error() -> None:
        ex = sbx.run_code("1 / 0")
        assert ex.error is not None and ex.error.name == "ZeroDivisionError", ex.error

    def state() -> None:
        sbx.run_code("kept = [1, 2]")
        assert sbx.run_code("kept.append(3); sum(kept)").text == "6"

    def bash() -> None:
        ex = sbx.run_code("echo from-bash $((6*7))", language="bash")
        assert ex.logs.stdout == ["from-bash 42\n"], ex.logs

    def contexts() -> None:
        ctx = need(sbx, "create_code_context")(cwd="/tmp")
        sbx.run_code("import os; here = os.getcwd()", context=ctx)
        assert sbx.run_code("here", context=ctx).text == "/tmp"     # a string's text has no quotes, as in E2B
        assert sbx.run_code("'here' in dir()").text == "False"       # the default context does not see it

    def envs() -> None:
        ex = sbx.run_code("import os; os.environ['CI_FLOW']", envs={"CI_FLOW": "yes"})
        assert ex.text == "yes", ex.text

    def chart() -> None:
        ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('sq')\n"
                          "plt.show()")
        assert any(r.png for r in ex.results), ex.results

    def dataframe() -> None:
        ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
        assert ex.results and ex.results[0].data is not None, ex.results

    def files() -> None:
        sbx.files.write("/home/user/in.txt", "data-42")
        assert sbx.run_code("open('/home/user/in.txt').read()").text == "data-42"

    def pause_connect() -> None:
        sbx.run_code("survivor = 'still here'")
        pause = getattr(sbx, "pause", None) or need(sbx, "beta_pause")
        pause()
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.run_code("survivor").text == "still here"

    for name, fn in (("value", value), ("streams", streams), ("error", error), ("state", state),
                     ("bash", bash), ("contexts", contexts), ("envs", envs), ("chart", chart),
                     ("dataframe", dataframe), ("files", files), ("pause → connect", pause_connect)):
        flow(name, fn)
    flow("kill", sbx.kill)
    return 0


if __name__ == "__main__":
    sys.exit(main())
