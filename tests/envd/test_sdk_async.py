"""The async e2b SDK (AsyncSandbox) against a host envd."""

from __future__ import annotations

import asyncio
import os

import pytest
from e2b import AsyncSandbox, CommandExitException, FileType, TimeoutException
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _sandbox(url: str) -> AsyncSandbox:
    return await AsyncSandbox.create(debug=True, sandbox_url=url, api_key="test")


def test_async_commands(envd, workdir, test_user) -> None:
    async def body() -> None:
        sbx = await _sandbox(envd.url)
        r = await sbx.commands.run("echo $X; pwd; id -un", envs={"X": "42"}, cwd=str(workdir))
        assert r.stdout.splitlines() == ["42", str(workdir), test_user.pw_name]
        with pytest.raises(CommandExitException) as ei:
            await sbx.commands.run("echo e >&2; exit 4")
        assert ei.value.exit_code == 4 and ei.value.stderr == "e\n"
        with pytest.raises(TimeoutException):
            await sbx.commands.run("sleep 20", timeout=1)

        chunks: list[str] = []
        h = await sbx.commands.run("cat", background=True, stdin=True, on_stdout=chunks.append)
        assert h.pid in [p.pid for p in await sbx.commands.list()]
        await sbx.commands.send_stdin(h.pid, "ping\n")
        await sbx.commands.close_stdin(h.pid)
        r = await h.wait()
        assert r.stdout == "ping\n" and "".join(chunks) == "ping\n"

        h = await sbx.commands.run("sleep 1; echo after", background=True)
        await h.disconnect()
        again = await sbx.commands.connect(h.pid)
        assert (await again.wait()).stdout == "after\n"

        h = await sbx.commands.run("sleep 20", background=True)
        assert await sbx.commands.kill(h.pid) is True
        with pytest.raises(CommandExitException):
            await h.wait()
        assert await sbx.is_running() is True

    run(body())


def test_async_pty(envd) -> None:
    async def body() -> None:
        sbx = await _sandbox(envd.url)
        out = bytearray()
        prompt = asyncio.Event()

        def on_data(d: bytes) -> None:
            out.extend(d)
            if b"$ " in out:
                prompt.set()

        h = await sbx.pty.create(PtySize(rows=20, cols=70), on_data=on_data)
        await asyncio.wait_for(prompt.wait(), 20)
        await sbx.pty.resize(h.pid, PtySize(rows=33, cols=99))
        await sbx.pty.send_stdin(h.pid, b"stty size; exit 0\n")
        r = await h.wait()
        assert r.exit_code == 0
        assert b"33 99\r\n" in out

    run(body())


def test_async_files_and_watch(envd, workdir) -> None:
    async def body() -> None:
        sbx = await _sandbox(envd.url)
        p = str(workdir / "x" / "y.txt")
        info = await sbx.files.write(p, "async data")
        assert info.path == p and info.type == FileType.FILE
        assert await sbx.files.read(p) == "async data"
        assert await sbx.files.read(p, format="bytes") == bytearray(b"async data")
        stream = await sbx.files.read(p, format="stream")
        assert b"".join([c async for c in stream]) == b"async data"
        assert [e.name for e in await sbx.files.list(str(workdir / "x"))] == ["y.txt"]
        assert await sbx.files.exists(p) is True
        assert (await sbx.files.get_info(p)).size == len("async data")
        assert await sbx.files.make_dir(str(workdir / "x")) is False
        moved = await sbx.files.rename(p, str(workdir / "z.txt"))
        assert moved.name == "z.txt"
        await sbx.files.remove(str(workdir / "z.txt"))
        assert await sbx.files.exists(str(workdir / "z.txt")) is False

        events = []
        got_remove = asyncio.Event()

        def on_event(ev) -> None:  # type: ignore[no-untyped-def]
            events.append((ev.name, ev.type))
            if ev.type == FilesystemEventType.REMOVE:
                got_remove.set()

        handle = await sbx.files.watch_dir(str(workdir), on_event=on_event, recursive=True)
        (workdir / "x" / "w.txt").write_text("hi")
        os.remove(workdir / "x" / "w.txt")
        await asyncio.wait_for(got_remove.wait(), 10)
        await handle.stop()
        assert ("x/w.txt", FilesystemEventType.CREATE) in events
        assert ("x/w.txt", FilesystemEventType.WRITE) in events
        assert ("x/w.txt", FilesystemEventType.REMOVE) in events

    run(body())


def test_many_concurrent_streams(envd) -> None:
    async def body() -> None:
        sbx = await _sandbox(envd.url)
        t0 = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(sbx.commands.run(f"sleep 1; echo job{i}") for i in range(24)))
        elapsed = asyncio.get_running_loop().time() - t0
        assert [r.stdout for r in results] == [f"job{i}\n" for i in range(24)]
        # concurrent, not serialised: 24 one-second jobs in far less than 24 s
        assert elapsed < 12, elapsed

    run(body())
