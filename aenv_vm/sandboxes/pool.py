"""The warm pool: sandboxes restored and warmed before anyone asks for them.

Under TCG the first requests to a freshly restored VM are slow: the software
CPU translates the guest's code afresh in each QEMU process. So a pool per
template keeps ``size`` sandboxes restored and warmed -- each ran the SDK's own
command path (``bash -l -c`` as the default user and as root) and a file write
and read, at low CPU priority -- and a create takes one (then only ``/init``
remains) and refills in the background. Size 0 disables the pool.

Pooled clones are restored with the default egress policy (public internet
allowed, no rules): a create with other rules takes one only where the node can
change a running VM's policy (a filter of the sandbox's namespace); without a
namespace, user mode fixes egress when QEMU starts.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from ..errors import VmError
from ..machine.bringup import Priority, prioritise
from ..net.policy import NetworkPolicy
from ..templates.template import Template
from .restore import restore_from_template, teardown_sandbox
from .runtime import NodeRuntime
from .sandbox import Sandbox

log = logging.getLogger(__name__)

# After a create the refill waits this long before restoring the next clone, so
# that its QEMU start, state load and warm-up (and this process's share: fork,
# QMP, NBD) do not compete with the new sandbox's first requests. Measured here
# (load ~10): the first command after a pooled create took ~80 ms p50 without a
# concurrent refill, 130-650 ms with one.
REFILL_DELAY = 1.0


class WarmPool:
    """Pooled sandboxes of one node, per template. Use within one event loop."""

    def __init__(self, rt: NodeRuntime, size: int) -> None:
        self.rt = rt
        self.size = size
        self._pools: dict[str, list[Sandbox]] = {}
        self._refills: dict[str, asyncio.Task[None]] = {}

    def count(self) -> int:
        """Sandboxes waiting in all pools."""
        return sum(len(p) for p in self._pools.values())

    def pooled(self, tid: str) -> list[Sandbox]:
        return list(self._pools.get(tid, []))

    async def take(self, tpl: Template, policy: NetworkPolicy) -> Sandbox | None:
        """A warm sandbox of ``tpl`` (given back at normal CPU priority), or None. The caller
        schedules the refill once its create has its sandbox (``schedule_refill``)."""
        pool = self._pools.get(tpl.id, []) if self.rt.networks.can_apply(policy) else []
        sbx = None
        while pool and sbx is None:
            candidate = pool.pop(0)
            if candidate.vm.alive():
                sbx = candidate
            else:
                await teardown_sandbox(self.rt, candidate)
        if sbx is not None:
            prioritise(sbx.vm, Priority.RUNNING)
        return sbx

    def schedule_refill(self, tpl: Template, delay: float = 0.0) -> None:
        if self.size <= 0 or tpl.delta is not None:   # a pause's snapshot serves one batch: no pool
            return
        task = self._refills.get(tpl.id)
        if task is None or task.done():
            self._refills[tpl.id] = asyncio.get_running_loop().create_task(self._refill(tpl, delay))

    async def fill(self, tpl: Template) -> None:
        """Fill the pool of ``tpl`` now and wait for it (failures are logged, not raised)."""
        self.schedule_refill(tpl)
        task = self._refills.get(tpl.id)
        if task is not None:
            with contextlib.suppress(Exception):
                await task

    async def _refill(self, tpl: Template, delay: float = 0.0) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        pool = self._pools.setdefault(tpl.id, [])
        while len(pool) < self.size:
            try:
                sbx = await restore_from_template(self.rt, tpl, background=True)  # at low priority
            except (VmError, OSError) as e:
                log.warning("pool refill for %s failed: %s", tpl.id, e)
                return
            t0 = time.monotonic()
            try:
                await self._warm(sbx, sbx.guest_token, tpl.ready_cmd)
            except BaseException as e:
                await teardown_sandbox(self.rt, sbx)
                if not isinstance(e, (VmError, OSError)):
                    raise
                log.warning("pool refill for %s: warming failed: %s", tpl.id, e)
                return
            # Warm: wait at normal priority (idle costs little), ready to serve at once.
            prioritise(sbx.vm, Priority.RUNNING)
            assert sbx.timing is not None
            sbx.timing = dataclasses.replace(sbx.timing, warm=time.monotonic() - t0)
            pool.append(sbx)

    @staticmethod
    async def _warm(sbx: Sandbox, access_token: str | None, ready_cmd: str | None = None) -> None:
        """Run what a user's first calls run, so that this QEMU has translated it before
        hand-out: a file write and read and the SDK's command request (``bash -l -c`` as
        envd's default user, then as root, which also removes the file). Templates built
        under TCG have the guest's ASLR off, so the user's commands reuse these
        translations instead of paying them (docs/guest.md). A template built with a
        ready command has it run once more: it exercises the start command's own
        service (the code interpreter's /health does a kernel round trip), which the
        user's first call to that service would otherwise pay for; it is not required
        to pass (a create without the pool would not run it at all)."""
        envd, path = sbx.envd.with_token(access_token), f"/tmp/.aenv-warm-{sbx.id}"
        await envd.write_file(path, b"warm")
        if await envd.read_file(path) != b"warm":
            raise VmError(f"warming {sbx.id}: file read back differs")
        for user, cmd in ((None, "true"), ("root", f"rm -f {path}")):
            result = await envd.run(cmd, user=user, timeout=60.0)
            if result.exit_code != 0:
                raise VmError(f"warming {sbx.id}: {cmd!r} as {user or 'default user'} exited {result.exit_code}")
        if ready_cmd:
            result = await envd.run(ready_cmd, user=None, timeout=60.0)
            if result.exit_code != 0:
                log.info("warming %s: the template's ready command exited %d", sbx.id, result.exit_code)
        # The SDK's terminal: an interactive login shell on a PTY runs the user's .bashrc
        # (Debian's forks dircolors); warmed, a first pty.create answers its first input
        # in ~0.1 s instead of ~0.3 s. Best effort: an image's shell may not be bash.
        with contextlib.suppress(VmError, OSError, asyncio.TimeoutError):
            await envd.run("exit 0", user=None, timeout=30.0, pty=True)

    async def close(self) -> None:
        """Stop refilling and tear every pooled sandbox down."""
        for task in self._refills.values():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self._refills.clear()
        for pool in self._pools.values():
            for sbx in pool:
                await teardown_sandbox(self.rt, sbx)
        self._pools.clear()
