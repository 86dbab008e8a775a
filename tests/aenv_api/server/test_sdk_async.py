"""The real e2b SDK (async) against `aenv server`, configured only by E2B_* env vars."""
from __future__ import annotations

import asyncio
import time

import pytest

from .conftest import Server

pytestmark = pytest.mark.qemu


def test_async_flow(sdk_env: Server) -> None:
    from e2b import AsyncSandbox, SandboxQuery, SandboxState

    async def flow() -> None:
        a, b = await asyncio.gather(
            AsyncSandbox.create(metadata={"suite": "async", "n": "1"}, envs={"AENV_X": "one"}),
            AsyncSandbox.create(metadata={"suite": "async", "n": "2"}, envs={"AENV_X": "two"}))
        try:
            ra, rb = await asyncio.gather(a.commands.run("echo $AENV_X"), b.commands.run("echo $AENV_X"))
            assert (ra.stdout.strip(), rb.stdout.strip()) == ("one", "two")
            # concurrent streams through the proxy on one sandbox
            outs = await asyncio.gather(*(a.commands.run(f"sleep 0.3; echo {i}") for i in range(4)))
            assert [o.stdout.strip() for o in outs] == ["0", "1", "2", "3"]
            await a.files.write("/home/user/a.txt", "async bytes")
            assert await a.files.read("/home/user/a.txt") == "async bytes"
            seen: list[str] = []
            await a.commands.run("echo x; sleep 0.5; echo y", on_stdout=lambda s: seen.append(s.strip()))
            assert seen == ["x", "y"]

            paginator = AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "async"}), limit=1)
            ids = []
            while paginator.has_next:
                ids += [s.sandbox_id for s in await paginator.next_items()]
            assert sorted(ids) == sorted([a.sandbox_id, b.sandbox_id])
            only = await AsyncSandbox.list(query=SandboxQuery(metadata={"n": "2"})).next_items()
            assert [s.sandbox_id for s in only] == [b.sandbox_id]

            info = await a.get_info()
            assert info.state == SandboxState.RUNNING and info.metadata == {"suite": "async", "n": "1"}
            await a.set_timeout(77)
            end = (await a.get_info()).end_at
            assert abs(end.timestamp() - time.time() - 77) < 30

            await a.pause()
            assert (await AsyncSandbox.get_info(a.sandbox_id)).state == SandboxState.PAUSED
            resumed = await AsyncSandbox.connect(a.sandbox_id)
            assert await resumed.files.read("/home/user/a.txt") == "async bytes"
        finally:
            await a.kill()
            await b.kill()
        left = await AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "async"})).next_items()
        assert left == []
        assert not await a.is_running()

    asyncio.run(flow())
