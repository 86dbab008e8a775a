"""Bash contexts: one long-lived ``bash`` per context, fed cells on its stdin.

Not a Jupyter kernel (Debian has no bash kernel, and a shell needs none): each cell is
written to a file and ``source``d, so variables, functions, ``cd`` and exports persist
between cells. A random marker printed on stdout and stderr after the cell (with its
exit status) says where the cell's output ends. The shell leads its own process group:
an interrupt is SIGINT to the group (the cell's programs die, the shell's INT trap
returns from the cell) and the shell lives on. A shell that exits (``exit`` in a cell)
is reported and a new one starts for the next cell. A non-zero status of the cell's
last command is an error event, as Jupyter's bash kernel reports it."""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import secrets
import signal
import tempfile
from pathlib import Path
from typing import Any, AsyncGenerator, AsyncIterator

from . import protocol
from .context import KEEPALIVE_SECONDS, QUEUE_EVENTS, CodeContext, ContextError, context_env

READ = 64 * 1024
_PRELUDE = "trap 'return 130 2>/dev/null' INT\n"


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


class BashContext(CodeContext):
    language = "bash"

    def __init__(self, context_id: str, cwd: str) -> None:
        super().__init__(context_id, cwd)
        self.proc: asyncio.subprocess.Process | None = None
        self.count = 0
        self._dir = Path(tempfile.mkdtemp(prefix=f"codeint-bash-{context_id[:8]}-"))

    async def start(self) -> None:
        env = context_env(self.cwd)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                "bash", "--noprofile", "--norc", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=self.cwd, start_new_session=True, limit=READ * 4, env=env)
        except OSError as e:
            raise ContextError(f"bash did not start: {e}") from e
        self._write(_PRELUDE)
        self._global_envs_applied = False

    def _stdin(self) -> asyncio.StreamWriter:
        assert self.proc is not None and self.proc.stdin is not None
        return self.proc.stdin

    def _write(self, text: str) -> None:
        self._stdin().write(text.encode())

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def execute(self, code: str, env_vars: dict[str, str],
                      global_envs: dict[str, str] | None) -> AsyncGenerator[dict[str, Any], None]:
        if not self._alive():
            await self._replace()
        self.count += 1
        yield protocol.count_event(self.count)
        marker = secrets.token_hex(16)
        cell = self._dir / "cell.sh"
        cell.write_text(code + "\n")
        lines = []
        if global_envs is not None and not self._global_envs_applied:
            # applied once really fetched (see PythonContext.execute)
            lines += [f"export {k}={_quote(v)}" for k, v in global_envs.items()]
            self._global_envs_applied = True
        # per-cell envs: a subshell would lose the cell's own state, so save and restore
        saved = f"__codeint_saved_{marker[:8]}"
        if env_vars:
            lines.append(f"{saved}=$(export -p)")
            lines += [f"export {k}={_quote(v)}" for k, v in env_vars.items()]
        lines.append(f"source {_quote(str(cell))}")
        lines.append(f"__codeint_rc=$?")
        if env_vars:
            lines += [f"unset {k}" for k in env_vars]
            lines.append(f"eval \"${saved}\"; unset {saved}")
        lines.append(f"printf '\\n%s %s\\n' {marker} \"$__codeint_rc\"; printf '\\n%s\\n' {marker} >&2")
        try:
            self._write("\n".join(lines) + "\n")
            await self._stdin().drain()
        except (ConnectionError, OSError):
            yield self._death()
            return
        async for ev in self._events(marker):
            yield ev

    async def _events(self, marker: str) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[tuple[str, str | int | None]] = asyncio.Queue(QUEUE_EVENTS)
        readers = [asyncio.create_task(self._pump(name, marker, queue)) for name in ("stdout", "stderr")]
        done = 0
        status: int | None = None
        try:
            while done < 2:
                try:
                    name, value = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    yield protocol.KEEPALIVE
                    continue
                if isinstance(value, str):
                    for ev in protocol.stream_events(name, value):
                        yield ev
                else:
                    done += 1
                    if name == "stdout":
                        status = value
            if not self._alive() or status is None:
                yield self._death()
            elif status != 0:
                yield protocol.error_event("ExitCode", str(status),
                                           f"the cell's last command exited with status {status}")
        finally:
            for r in readers:
                r.cancel()
            for r in readers:
                with contextlib.suppress(BaseException):
                    await r

    async def _pump(self, name: str, marker: str, queue: asyncio.Queue[tuple[str, str | int | None]]) -> None:
        """Relay one pipe until the marker line; then (name, status) — None at EOF."""
        assert self.proc is not None
        stream = self.proc.stdout if name == "stdout" else self.proc.stderr
        assert stream is not None
        token = ("\n" + marker).encode()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        buf = b""
        while True:
            data = await stream.read(READ)
            if not data:
                if buf:
                    await queue.put((name, decoder.decode(buf, final=True)))
                await queue.put((name, None))
                return
            buf += data
            at = buf.find(token)
            if at >= 0:
                rest = buf[at + len(token):]
                while b"\n" not in rest:
                    more = await stream.read(READ)
                    if not more:
                        break
                    rest += more
                if buf[:at]:
                    await queue.put((name, decoder.decode(buf[:at], final=True)))
                word = rest.split(b"\n", 1)[0].strip()
                await queue.put((name, int(word) if word.isdigit() else 0))
                return
            keep = len(token) - 1      # the marker may straddle two reads
            if len(buf) > keep:
                text = decoder.decode(buf[:-keep])
                buf = buf[-keep:]
                if text:
                    await queue.put((name, text))

    def _death(self) -> dict[str, Any]:
        code = self.proc.returncode if self.proc is not None else None
        return protocol.error_event("ContextExited", f"the bash context exited (status {code}); a new shell "
                                                     f"starts for the next cell: its variables are gone", "")

    async def interrupt(self) -> None:
        if self._alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)

    async def kill(self) -> None:
        if self._alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def _replace(self) -> None:
        await self._kill()
        await self.start()

    async def restart(self) -> None:
        self.count = 0
        await self._replace()

    async def _kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        self.proc = None

    async def close(self) -> None:
        await self._kill()
        with contextlib.suppress(OSError):
            for p in self._dir.iterdir():
                p.unlink()
            self._dir.rmdir()
