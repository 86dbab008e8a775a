"""The async ``e2b-code-interpreter`` SDK: the same core flow (issue 15, acceptance 1)."""
from __future__ import annotations

import asyncio

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import AsyncSandbox

from tests.aenv_api.server.conftest import Server


def test_async_flow(ci: Server) -> None:
    async def go() -> None:
        sbx = await AsyncSandbox.create()
        try:
            await sbx.run_code("x = 1")
            r = await sbx.run_code("x + 1")
            assert r.text == "2" and r.results[0].text == "2"
            lines: list[str] = []

            async def on_stdout(m) -> None:  # type: ignore[no-untyped-def]
                lines.append(m.line)
            r = await sbx.run_code("for i in range(3): print(i, flush=True)", on_stdout=on_stdout)
            assert lines == r.logs.stdout and "".join(lines) == "0\n1\n2\n"
            r = await sbx.run_code("raise ValueError('bad')")
            assert r.error.name == "ValueError" and r.error.value == "bad"
            ctx = await sbx.create_code_context(language="bash")
            r = await sbx.run_code("echo $((6 * 7))", context=ctx)
            assert r.logs.stdout == ["42\n"]
            assert ctx.id in {c.id for c in await sbx.list_code_contexts()}
            await sbx.restart_code_context(ctx)
            await sbx.remove_code_context(ctx)
            assert ctx.id not in {c.id for c in await sbx.list_code_contexts()}
            r = await sbx.run_code("import os; os.environ['E']", envs={"E": "async"})
            assert r.text == "async"
            with pytest.raises(TimeoutException):
                await sbx.run_code("import time; time.sleep(100)", timeout=2)
            assert (await sbx.run_code("x")).text == "1"
        finally:
            await sbx.kill()
    asyncio.run(go())
