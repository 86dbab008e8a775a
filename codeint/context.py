"""What every kind of code context offers the server: start, run one cell as a stream
of SDK events, restart, close. One cell at a time per context (``lock``); state persists
between cells of a context and is never shared between contexts."""
from __future__ import annotations

import abc
import asyncio
import os
from typing import Any, AsyncGenerator

from .platform import kernel_env_overrides

# How often a cell that prints nothing sends a keepalive line: the proxy (and the server)
# only notice a client that went away when they write to it, and the SDK's `timeout` is
# the client closing the connection, so this bounds how long an abandoned cell runs on.
KEEPALIVE_SECONDS = 1.0
# After an interrupt the kernel has this long to finish the cell before it is restarted.
INTERRUPT_GRACE_SECONDS = 10.0
# Events buffered between the kernel and the client: beyond this the kernel's reader
# waits (output then queues in the kernel's own buffers), so a cell printing 100 MiB
# never sits in this server's memory.
QUEUE_EVENTS = 32


class ContextError(Exception):
    """A context that could not be started (answered 500 with the reason)."""


def context_env(cwd: str) -> dict[str, str]:
    """The environment a context's kernel or shell starts with (this server's, plus what
    the CPU needs: platform.py); ContextError when ``cwd`` is not a directory."""
    if not os.path.isdir(cwd):
        raise ContextError(f"cwd {cwd} is not a directory in the sandbox")
    env = dict(os.environ)
    for k, v in kernel_env_overrides().items():
        env.setdefault(k, v)
    return env


class CodeContext(abc.ABC):
    language: str

    def __init__(self, context_id: str, cwd: str) -> None:
        self.id = context_id
        self.cwd = cwd
        self.lock = asyncio.Lock()
        self._global_envs_applied = False
        self.cells_started = 0      # /execute calls since the start or the last forget

    @property
    def needs_global_envs(self) -> bool:
        """True until the sandbox's envs were set in this kernel (the first cell after a
        start or restart)."""
        return not self._global_envs_applied

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the kernel or shell; ContextError when it cannot run."""

    @abc.abstractmethod
    def execute(self, code: str, env_vars: dict[str, str], global_envs: dict[str, str] | None) -> AsyncGenerator[
            dict[str, Any], None]:
        """The cell's events. ``global_envs``: the sandbox's envs (from envd) to set for good
        before the first cell; ``env_vars`` hold for this cell only. When the client goes
        away the server calls ``interrupt`` and reads the iterator to its end."""

    @abc.abstractmethod
    async def interrupt(self) -> None:
        """SIGINT to the running cell (its subprocesses too); the context lives on."""

    @abc.abstractmethod
    async def kill(self) -> None:
        """End the kernel or shell for good (a cell that ignored the interrupt): the running
        ``execute`` then reports the death and ends, and the next cell gets a new one."""

    @abc.abstractmethod
    async def restart(self) -> None:
        """A fresh kernel in the same cwd: every variable is gone."""

    @abc.abstractmethod
    async def close(self) -> None:
        ...

    async def warm(self) -> None:
        """Make the first real cell fast (run before the template is frozen)."""

    async def forget(self) -> None:
        """Make the context look unused again (fresh namespace, cell count 1, the sandbox's
        envs not yet applied) while keeping what was warmed."""
        self._global_envs_applied = False
        self.cells_started = 0

    async def touch(self) -> None:
        """A round trip through the kernel that changes nothing the user can see."""
