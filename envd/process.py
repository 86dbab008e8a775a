"""Processes started by envd: spawn as a user, stream output, signals, PTYs.

Output fan-out is bounded: each attached stream (Start or Connect) has a small
queue; a slow client stalls the reader, which stalls the pipe, which stalls the
process -- memory never grows with output volume. With nobody attached the
output is read and dropped, as upstream does, so a background command never
blocks on a full pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import pty
import signal
import struct
import subprocess
import termios
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Union

from . import fdio
from .connect import Code, ConnectError
from .state import EnvdState
from .users import User

log = logging.getLogger("envd.process")

SUBSCRIBER_QUEUE = 32  # chunks of up to READ_CHUNK bytes per attached stream
READ_CHUNK = 64 * 1024
# After the main process exits, output that background children (``cmd &``)
# hold open is followed until it stays idle this long...
EXIT_DRAIN_GRACE_S = 0.5
# ...or, if they keep writing, at most this long. Output already in the pipe is
# never cut by a slow client: only idleness or this cap ends the stream.
EXIT_DRAIN_CAP_S = 10.0

_SIGNAL_NAMES = {
    signal.SIGKILL: "killed", signal.SIGTERM: "terminated", signal.SIGINT: "interrupt",
    signal.SIGHUP: "hangup", signal.SIGQUIT: "quit", signal.SIGABRT: "aborted",
    signal.SIGSEGV: "segmentation fault", signal.SIGPIPE: "broken pipe",
}


@dataclass(frozen=True)
class PtySize:
    cols: int
    rows: int


@dataclass(frozen=True)
class ProcessSpec:
    cmd: str
    args: tuple[str, ...]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None = None
    pty: PtySize | None = None
    stdin: bool = True


@dataclass(frozen=True)
class EndInfo:
    exit_code: int
    exited: bool
    status: str
    error: str | None = None

    @classmethod
    def from_returncode(cls, rc: int) -> "EndInfo":
        # Mirrors Go's os.ProcessState: a signalled process has exit code -1.
        if rc < 0:
            sig = -rc
            try:
                name = _SIGNAL_NAMES.get(signal.Signals(sig), None) or signal.strsignal(sig) or f"signal {sig}"
            except ValueError:
                name = f"signal {sig}"
            return cls(-1, False, f"signal: {name.lower()}")
        return cls(rc, True, f"exit status {rc}")


@dataclass(frozen=True)
class Output:
    stream: str  # "stdout" | "stderr" | "pty"
    data: bytes


Event = Union[Output, EndInfo]


class Subscriber:
    """One attached stream's bounded queue of events."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self.closed = False

    async def put(self, event: Event) -> None:
        if not self.closed:
            await self.queue.put(event)

    def close(self) -> None:
        # Emptying the queue wakes a reader blocked on put(); it then sees closed.
        self.closed = True
        while not self.queue.empty():
            self.queue.get_nowait()


def pty_winsize(size: PtySize) -> bytes:
    return struct.pack("HHHH", size.rows, size.cols, 0, 0)


@dataclass
class Process:
    pid: int
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    master_fd: int | None
    stdin_fd: int | None
    out_fds: dict[str, int]
    subscribers: set[Subscriber] = field(default_factory=set)
    end: EndInfo | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    deadline: asyncio.TimerHandle | None = None
    drain_until: float | None = None  # loop time; set when the main process exits
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    stdin_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        sub.close()

    def signal(self, sig: int) -> None:
        """Signal the process group (the command and what it spawned)."""
        if self.end is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    async def write_input(self, data: bytes, *, pty_input: bool) -> None:
        if pty_input:
            if self.master_fd is None:
                raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid} has no pty")
            fd = self.master_fd
        else:
            # upstream writes stdin of a PTY process to the terminal
            stdin = self.master_fd if self.master_fd is not None else self.stdin_fd
            if stdin is None:
                raise ConnectError(
                    Code.FAILED_PRECONDITION, f"stdin of process {self.pid} is not enabled or closed"
                )
            fd = stdin
        async with self.stdin_lock:
            try:
                await fdio.write_all(fd, data)
            except OSError as e:
                raise ConnectError(Code.FAILED_PRECONDITION, f"writing input: {e.strerror}") from None

    def close_stdin(self) -> None:
        if self.master_fd is not None:
            raise ConnectError(
                Code.FAILED_PRECONDITION, "cannot close stdin of a PTY process; send Ctrl+D (0x04) instead"
            )
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None

    def resize(self, size: PtySize) -> None:
        if self.master_fd is None:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid} has no pty")
        fcntl.ioctl(self.master_fd, termios.TIOCSWINSZ, pty_winsize(size))

    def info(self) -> dict[str, object]:
        config: dict[str, object] = {"cmd": self.spec.cmd}
        if self.spec.args:
            config["args"] = list(self.spec.args)
        if self.spec.envs:
            config["envs"] = dict(self.spec.envs)
        if self.spec.cwd is not None:
            config["cwd"] = self.spec.cwd
        out: dict[str, object] = {"config": config, "pid": self.pid}
        if self.spec.tag is not None:
            out["tag"] = self.spec.tag
        return out


def _set_controlling_tty() -> None:  # runs in the child between fork and exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class ProcessManager:
    def __init__(self, state: EnvdState) -> None:
        self._state = state
        self._procs: dict[int, Process] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def list(self) -> list[Process]:
        return list(self._procs.values())

    def find(self, pid: int | None, tag: str | None) -> Process:
        if pid is not None:
            proc = self._procs.get(pid)
            if proc is None:
                raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
            return proc
        if tag is not None:
            for proc in self._procs.values():
                if proc.spec.tag == tag:
                    return proc
            raise ConnectError(Code.NOT_FOUND, f"process with tag {tag!r} not found")
        raise ConnectError(Code.INVALID_ARGUMENT, "process selector needs a pid or a tag")

    def start(self, spec: ProcessSpec, user: User, timeout_s: float | None) -> tuple[Process, Subscriber]:
        """Spawn ``spec`` as ``user``; the returned subscriber sees all output."""
        env = self._state.base_env(user)
        env.update(spec.envs)
        cwd = spec.cwd or self._state.default_workdir or user.home
        if not os.path.isabs(cwd):
            cwd = os.path.join(user.home, cwd)
        if not os.path.isdir(cwd):
            if spec.cwd:
                raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist or is not a directory")
            cwd = "/"  # a user without a home directory (e.g. nobody) still runs commands
        if not os.path.isdir(user.home):
            # A missing home (bare hosts) must not break every command.
            env["HOME"] = cwd
        # Popen's defaults (None) keep envd's own identity
        run_uid: int | None = None
        run_gid: int | None = None
        run_groups: list[int] | None = None
        if os.geteuid() == 0 and user.uid != 0:
            run_uid, run_gid, run_groups = user.uid, user.gid, user.groups
        elif user.uid != os.geteuid():
            raise ConnectError(Code.PERMISSION_DENIED, f"envd is not root: cannot run as {user.name!r}")

        close_on_fail: list[int] = []
        master_fd: int | None = None
        stdin_fd: int | None = None
        out_fds: dict[str, int] = {}
        try:
            if spec.pty is not None:
                master_fd, slave_fd = pty.openpty()
                close_on_fail += [master_fd, slave_fd]
                fcntl.ioctl(slave_fd, termios.TIOCSWINSZ, pty_winsize(spec.pty))
                popen = subprocess.Popen(
                    [spec.cmd, *spec.args], stdin=slave_fd, stdout=slave_fd, stderr=slave_fd,
                    cwd=cwd, env=env, start_new_session=True, preexec_fn=_set_controlling_tty,
                    user=run_uid, group=run_gid, extra_groups=run_groups,
                )
                os.close(slave_fd)
                close_on_fail.remove(slave_fd)
                out_fds["pty"] = master_fd
            else:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                close_on_fail += [out_r, out_w, err_r, err_w]
                in_r: int | None = None
                if spec.stdin:
                    in_r, stdin_fd = os.pipe()
                    close_on_fail += [in_r, stdin_fd]
                popen = subprocess.Popen(
                    [spec.cmd, *spec.args], stdin=in_r if in_r is not None else subprocess.DEVNULL,
                    stdout=out_w, stderr=err_w, cwd=cwd, env=env, start_new_session=True,
                    user=run_uid, group=run_gid, extra_groups=run_groups,
                )
                for fd in (out_w, err_w, in_r):
                    if fd is not None:
                        os.close(fd)
                        close_on_fail.remove(fd)
                out_fds = {"stdout": out_r, "stderr": err_r}
        except OSError as e:
            for fd in close_on_fail:
                os.close(fd)
            raise ConnectError(Code.INVALID_ARGUMENT, f"error starting process '{spec.cmd}': {e.strerror or e}") from None
        for fd in out_fds.values():
            os.set_blocking(fd, False)
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)
        proc = Process(popen.pid, spec, popen, master_fd, stdin_fd, out_fds)
        sub = proc.subscribe()
        self._procs[proc.pid] = proc
        if timeout_s is not None:
            # Upstream semantics: the request deadline bounds the process itself.
            proc.deadline = asyncio.get_running_loop().call_later(timeout_s, proc.signal, signal.SIGKILL)
        task = asyncio.create_task(self._supervise(proc))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return proc, sub

    async def _pump(self, proc: Process, stream: str, fd: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                if proc.drain_until is None:
                    await _first(fdio.wait_readable(fd), proc.exited.wait())
                    continue
                remaining = proc.drain_until - loop.time()
                if remaining <= 0:
                    return
                try:
                    async with asyncio.timeout(remaining):
                        await fdio.wait_readable(fd)
                except TimeoutError:
                    return
                continue
            except OSError:  # EIO: the PTY's slave side is closed
                return
            if not data:
                return
            if proc.drain_until is not None:  # idle time counts from the last output
                proc.drain_until = loop.time() + EXIT_DRAIN_GRACE_S
            for sub in list(proc.subscribers):
                await sub.put(Output(stream, data))

    async def _supervise(self, proc: Process) -> None:
        pumps = [asyncio.create_task(self._pump(proc, s, fd)) for s, fd in proc.out_fds.items()]
        try:
            rc = await _wait_exit(proc.popen)
            if proc.deadline is not None:
                proc.deadline.cancel()
            proc.drain_until = asyncio.get_running_loop().time() + EXIT_DRAIN_GRACE_S
            proc.exited.set()
            _, pending = await asyncio.wait(pumps, timeout=EXIT_DRAIN_CAP_S)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            proc.end = EndInfo.from_returncode(rc)
        finally:
            for t in pumps:
                t.cancel()
            self._procs.pop(proc.pid, None)
            for fd in {*proc.out_fds.values(), proc.stdin_fd}:
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            proc.stdin_fd = None
            if proc.end is None:
                proc.end = EndInfo(-1, False, "unknown", "envd lost track of the process")
            for sub in list(proc.subscribers):
                await sub.put(proc.end)
            proc.ended.set()

    async def shutdown(self) -> None:
        for proc in list(self._procs.values()):
            proc.signal(signal.SIGKILL)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)


async def _first(*aws: Awaitable[object]) -> None:
    """Wait until the first of ``aws`` finishes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_exit(popen: subprocess.Popen[bytes]) -> int:
    """Wait for exit without a thread per child: a pidfd is readable on exit."""
    try:
        pidfd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        while popen.poll() is None:
            await asyncio.sleep(0.05)
        return popen.returncode
    try:
        while popen.poll() is None:
            await fdio.wait_readable(pidfd)
        return popen.returncode
    finally:
        os.close(pidfd)
