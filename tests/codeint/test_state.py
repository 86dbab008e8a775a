"""Kernel state through pause/resume and fork (issue 15, acceptance 3): the memory
snapshot carries the running kernel, so variables survive, and each fork child goes on
from the parent's state and diverges on its own."""
from __future__ import annotations

from e2b_code_interpreter import Sandbox

from tests.aenv_api.server.conftest import Server


def test_pause_resume_keeps_variables(ci: Server) -> None:
    sbx = Sandbox.create()
    try:
        sbx.run_code("x = 41\nimport pandas as pd\ndf = pd.DataFrame({'v': [1, 2, 3]})")
        sbx.pause()
        again = Sandbox.connect(sbx.sandbox_id)
        r = again.run_code("x + 1, int(df.v.sum())")
        assert r.text == "(42, 6)", r
        bash = again.run_code("echo resumed", language="bash")
        assert bash.logs.stdout == ["resumed\n"]
    finally:
        sbx.kill()


def test_fork_children_diverge(ci: Server) -> None:
    parent = Sandbox.create()
    children: list = []
    try:
        parent.run_code("x = 'parent'\nseen = []")
        children = parent.fork(count=4)
        assert len(children) == 4 and all(isinstance(c, Sandbox) for c in children), children
        for i, c in enumerate(children):
            assert c.run_code("x").text == "parent"
            c.run_code(f"x = 'child-{i}'\nseen.append({i})")
        for i, c in enumerate(children):
            assert c.run_code("x, seen").text == f"('child-{i}', [{i}])"
        assert parent.run_code("x, seen").text == "('parent', [])"
    finally:
        for c in children:
            if isinstance(c, Sandbox):
                c.kill()
        parent.kill()
