"""Python contexts: a kernel process each (pykernel.py: IPython's InteractiveShell), over
kernel_wire's socketpair channel.

The kernel runs ``ipython_startup.py`` first (the SDK's extra MIME types: ``e2b/data`` for
DataFrames, ``e2b/chart`` for matplotlib figures; per-cell envs). One reader task takes
every frame the kernel sends into a bounded queue, so a slow client slows the kernel (its
writes block on the socket) instead of growing this server's memory; the end of the
channel is the kernel's death, noticed at once, reported, and the kernel replaced."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncGenerator, AsyncIterator

from . import kernel_wire as wire
from . import protocol
from .context import KEEPALIVE_SECONDS, CodeContext, ContextError, context_env

log = logging.getLogger(__name__)

STARTUP = Path(__file__).with_name("ipython_startup.py")
START_TIMEOUT = 300.0
# The kernel imports its own module from the directory above codeint/ and then takes
# that directory off sys.path again: the user's sys.path is a plain interpreter's
# ('' first), and codeint's modules (http.py, platform.py) never shadow the stdlib's.
BOOT = ("import sys; sys.path.insert(0, {parent!r}); from codeint.pykernel import main; "
        "del sys.path[0]; main(int(sys.argv[1]), sys.argv[2])")
# Imported (not bound to names) before the template is frozen: the user's own
# `import pandas` is then a dict lookup instead of seconds of unpickling bytecode.
WARM_CODE = """
def _codeint_warm():
    import importlib
    for name in ("numpy", "pandas", "matplotlib", "matplotlib.pyplot", "PIL.Image"):
        try:
            importlib.import_module(name)
        except Exception:
            pass
_codeint_warm(); del _codeint_warm
"""
DEAD = {"t": "dead"}     # the reader's last item: the channel ended
# Frames read ahead of the client (a stream frame is <= 1 MiB of text), and the socket
# reader's buffer limit (asyncio pauses reading beyond twice that): with these the
# server's share of a flood of output stays around ten MiB; the rest waits in the socket
# and blocks the kernel's writes.
FRAMES_AHEAD = 8
READ_LIMIT = 1 << 20


class PythonContext(CodeContext):
    language = "python"

    def __init__(self, context_id: str, cwd: str, log_dir: Path) -> None:
        super().__init__(context_id, cwd)
        self.log_dir = log_dir
        self.proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue(FRAMES_AHEAD)
        self._reader: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None

    async def start(self) -> None:
        env = context_env(self.cwd)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair()
        out = open(self.log_dir / f"kernel-{self.id}.log", "ab")
        try:
            boot = BOOT.format(parent=str(Path(__file__).resolve().parent.parent))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", boot, str(theirs.fileno()), str(STARTUP), cwd=self.cwd, env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=(theirs.fileno(),),
                start_new_session=True)
        except OSError as e:
            ours.close()
            raise ContextError(f"the Python kernel did not start: {e}") from e
        finally:
            theirs.close()
            out.close()
        reader, writer = await asyncio.open_connection(sock=ours, limit=READ_LIMIT)
        frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue(FRAMES_AHEAD)
        task = asyncio.create_task(self._read(reader, frames))
        try:
            async with asyncio.timeout(START_TIMEOUT):
                first = await frames.get()
        except TimeoutError:
            first = {"t": "timeout"}
        if first.get("t") != "ready":
            task.cancel()
            writer.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise ContextError(f"the Python kernel did not become ready ({first.get('t')}, exit status "
                               f"{proc.returncode}; its log: {self.log_dir / f'kernel-{self.id}.log'})")
        self.proc, self._writer, self._frames, self._reader = proc, writer, frames, task
        self._global_envs_applied = False

    @staticmethod
    async def _read(reader: asyncio.StreamReader, frames: asyncio.Queue[dict[str, Any]]) -> None:
        try:
            while True:
                n = wire.frame_length(await reader.readexactly(wire.HEADER.size))
                await frames.put(wire.decode(await reader.readexactly(n)))   # bounded: backpressure
        except (asyncio.IncompleteReadError, ConnectionError, wire.WireError) as e:
            log.info("kernel channel ended: %s", e)
        await frames.put(DEAD)

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self._reader is not None \
            and not self._reader.done()

    def _send(self, code: str, silent: bool, envs: dict[str, str] | None = None,
              cell_envs: dict[str, str] | None = None) -> None:
        assert self._writer is not None
        self._writer.write(wire.encode({"t": "exec", "code": code, "silent": silent, "envs": envs or {},
                                        "cell_envs": cell_envs or {}}))

    async def _run_silent(self, code: str, timeout: float = 60.0) -> dict[str, Any] | None:
        """Run ``code`` out of the cell count; its error event, if any (None also when the
        kernel died: the next cell reports and replaces it)."""
        self._send(code, silent=True)
        err = None
        async with asyncio.timeout(timeout):
            while True:
                msg = await self._frames.get()
                kind = msg["t"]
                if kind == "error" and err is None:
                    err = protocol.error_event(str(msg.get("ename", "")), str(msg.get("evalue", "")),
                                               "\n".join(msg.get("traceback") or []))
                elif kind in ("done", "dead"):
                    if kind == "dead":
                        await self._frames.put(DEAD)
                    return err

    async def _ensure_kernel(self) -> None:
        if self._restarting is not None:
            task, self._restarting = self._restarting, None
            with contextlib.suppress(ContextError):
                await task
        if not self._alive():
            log.warning("context %s: kernel not running, starting a new one", self.id)
            await self._replace()
        else:
            while not self._frames.empty():     # stray output of a background thread between cells
                if self._frames.get_nowait() is DEAD:
                    await self._replace()
                    break

    async def _replace(self) -> None:
        await self._stop_kernel()
        await self.start()

    async def execute(self, code: str, env_vars: dict[str, str],
                      global_envs: dict[str, str] | None) -> AsyncGenerator[dict[str, Any], None]:
        try:
            await self._ensure_kernel()
        except ContextError as e:
            yield protocol.error_event("ContextError", str(e), "")
            return
        # applied only once they were really fetched (an unauthenticated first call
        # fetches none, and must not keep the owner's from reaching this kernel)
        envs = global_envs if global_envs is not None and not self._global_envs_applied else None
        if envs is not None:
            self._global_envs_applied = True
        self._send(code, silent=False, envs=envs, cell_envs=env_vars)
        async for ev in self._events():
            yield ev

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            try:
                msg = await asyncio.wait_for(self._frames.get(), KEEPALIVE_SECONDS)
            except TimeoutError:
                yield protocol.KEEPALIVE
                continue
            kind = msg["t"]
            if kind == "stream":
                for ev in protocol.stream_events(str(msg.get("name", "stdout")), str(msg.get("text", "")),
                                                 msg.get("ts") if isinstance(msg.get("ts"), str) else None):
                    yield ev
            elif kind == "count":
                yield protocol.count_event(int(msg.get("n") or 0))
            elif kind == "result":
                data = msg.get("data")
                yield protocol.result_event(dict(data) if isinstance(data, dict) else {}, bool(msg.get("main")))
            elif kind == "error":
                yield protocol.error_event(str(msg.get("ename", "")), str(msg.get("evalue", "")),
                                           "\n".join(str(x) for x in msg.get("traceback") or []))
            elif kind == "done":
                return
            elif kind == "dead":
                yield await self._death()
                return

    async def _death(self) -> dict[str, Any]:
        code = None
        if self.proc is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                code = await asyncio.wait_for(self.proc.wait(), 2.0)
        self._restarting = asyncio.create_task(self._replace())
        return protocol.error_event(
            "KernelDied", f"the Python kernel died while running this cell (exit status {code}); a new kernel "
                          f"is starting for the next cell: the context's variables are gone", "")

    def _signal(self, sig: int) -> None:
        # the kernel's process group: a `!sleep` or subprocess of the cell too
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def interrupt(self) -> None:
        self._signal(signal.SIGINT)

    async def kill(self) -> None:
        self._signal(signal.SIGKILL)

    async def restart(self) -> None:
        await self._replace()

    async def touch(self) -> None:
        if self._alive():
            await self._run_silent("pass")

    async def forget(self) -> None:
        # IPython's %reset: the user namespace, Out/_ and In, the cell count back to 1;
        # modules stay imported and every code path stays initialised
        await self._run_silent("get_ipython().reset(new_session=True); "
                               "get_ipython().user_ns.update({'_': '', '__': '', '___': ''})")
        await super().forget()

    async def warm(self) -> None:
        await self._run_silent(WARM_CODE, timeout=START_TIMEOUT)
        await self._run_silent("1", timeout=START_TIMEOUT)

    async def _stop_kernel(self) -> None:
        if self._writer is not None:
            self._writer.close()     # the kernel exits at the end of its channel
            self._writer = None
        if self.proc is not None:
            proc, self.proc = self.proc, None
            try:
                await asyncio.wait_for(proc.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)   # and whatever the cells left running
            await proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
            self._reader = None

    async def close(self) -> None:
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(BaseException):
                await self._restarting
        await self._stop_kernel()
