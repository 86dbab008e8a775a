"""Fencing: a fleet node that cannot renew its lease stops running its sandboxes before
another node may take them over (docs/cluster.md, "Fencing").

Two parts, for the two ways a node loses its lease while alive:

* **Cut off from Redis** (its event loop runs): ``Fence`` sees that its last renewal
  began ``fence_after`` seconds ago (the lease less one heartbeat) and pauses every
  running sandbox, committing each pause over the record as read; until a renewal it
  refuses to start any (``NodeFenced``, a 503).
* **Its event loop stalled** (a blocking call, SIGSTOP): the fence keeper, a process
  of its own (fence_keeper.py), freezes every QEMU of the node once the deadline the
  agent last gave it has passed: ``freeze_after`` after the start of the last renewal,
  pushed to halfway through the adopters' wait while the node pauses its sandboxes
  itself.

A renewal after a lapse (the lease may have run out meanwhile) first reclaims each
running sandbox in the repository (``SandboxService.reclaim``: a compare-and-swap of
its pause record; one another node took over is killed here), and only then moves the
keeper's deadline, which thaws the rest.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from aenv_vm.childenv import ChildKind, child_env
from aenv_vm.errors import NodeFenced, NotFound
from aenv_vm.service import SandboxService, SandboxState

from .config import ClusterConfig

log = logging.getLogger(__name__)

KEEPER_SCRIPT = Path(__file__).with_name("fence_keeper.py")
CHECK_EVERY = 0.25      # seconds between the fence's looks at the lease
STALL = 1.0             # a look this late (or a heartbeat period, if longer) means the node stalled


class Keeper:
    """The fence keeper process of this node (fence_keeper.py)."""

    def __init__(self, first_deadline: float) -> None:
        self.proc = subprocess.Popen([sys.executable, str(KEEPER_SCRIPT), str(os.getpid()), repr(first_deadline)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=child_env(ChildKind.TOOL), close_fds=True)
        self._reader = threading.Thread(target=self._read, name="fence-keeper", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            log.warning("fence keeper: %s", line.decode(errors="replace").strip())

    def hold_until(self, deadline: float) -> None:
        """QEMUs run on until ``deadline`` (CLOCK_MONOTONIC); frozen ones thaw if it is ahead."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"until {deadline!r}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            log.error("fence keeper: cannot reach it (%s): a stalled node's QEMUs would not be frozen", e)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Fence:
    """The lease as this node knows it, the self-fence and the keeper (module doc)."""

    def __init__(self, config: ClusterConfig, service: Callable[[], SandboxService | None],
                 keeper: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        """``service``: the node's own sandbox service (not the observed one: Redis is
        what the node lost). ``keeper``: run the keeper process (off in unit tests
        without QEMUs)."""
        self.config = config
        self._service = service
        self._clock = clock
        self._keeper = Keeper(clock() + config.freeze_after) if keeper else None
        self._renewed_at = clock()      # as if renewed at start: the first heartbeat follows at once
        self.fenced = False
        self._lapsed = False            # fenced, or the lease may have run out: reclaim at the next renewal
        self._task: asyncio.Task[None] | None = None
        self._fencing: asyncio.Task[None] | None = None
        self._recovering: asyncio.Task[None] | None = None
        self._reclaiming = asyncio.Lock()

    def start(self) -> None:
        """The node joins now (its API listens, the first heartbeat follows): the lease's
        clock and the keeper's deadline start from here, not from the node's assembly."""
        self._renewed_at = self._clock()
        if self._keeper is not None:
            self._keeper.hold_until(self._renewed_at + self.config.freeze_after)
        self._task = asyncio.ensure_future(self._watch())

    def check_serving(self) -> None:
        """NodeFenced while the node may not start sandboxes (it lost its lease)."""
        if self.fenced:
            raise NodeFenced("this node could not renew its fleet lease: it starts no sandbox until it does",
                             retry_after=max(1, math.ceil(self.config.heartbeat_seconds)))

    async def renewed(self, started: float) -> None:
        """A heartbeat that began at ``started`` (clock) renewed the lease. After a lapse,
        each running sandbox is reclaimed before the keeper thaws the node's QEMUs and the
        node serves again; that runs beside the heartbeats (pauses of the fence may still
        be running, and a reclaim waits for each), which go on renewing meanwhile."""
        lapsed = self._lapsed or started - self._renewed_at > self.config.lease_seconds
        self._renewed_at = started
        if lapsed:
            self._lapsed = True
            if self._recovering is None or self._recovering.done():
                self._recovering = asyncio.ensure_future(self._recover())
            return
        if self._recovering is not None and not self._recovering.done():
            return      # the keeper's deadline moves once the reclaim is done
        if self._keeper is not None:
            self._keeper.hold_until(started + self.config.freeze_after)

    async def recovered(self) -> None:
        """Until the recovery from a lapse that a renewal started (if any) is over."""
        if self._recovering is not None:
            await asyncio.shield(self._recovering)

    async def _recover(self) -> None:
        """After a lapse: reclaim, then thaw and serve (retried at each renewal if unsure)."""
        if self._fencing is not None:
            with contextlib.suppress(BaseException):
                await self._fencing
        if not await self._reclaim():
            return      # unsure (the repository did not answer): frozen ones stay frozen; next renewal
        self._lapsed = False
        if self._keeper is not None:
            self._keeper.hold_until(self._renewed_at + self.config.freeze_after)
        if self.fenced:
            log.warning("cluster: lease renewed: this node serves again")
            self.fenced = False

    async def _reclaim(self) -> bool:
        async with self._reclaiming:
            return await self._reclaim_running()

    async def _reclaim_running(self) -> bool:
        service = self._service()
        if service is None:
            return True
        sure = True
        for info in await service.list_sandboxes():
            if info.state != SandboxState.RUNNING:
                continue
            try:
                if not await service.reclaim(info.sandbox_id):
                    log.warning("cluster: %s was taken over by another node while this node's lease had lapsed: "
                                "its copy here is gone", info.sandbox_id)
            except NotFound:
                continue
            except Exception as e:      # noqa: BLE001 -- a VM or store error: retried at the next renewal
                log.warning("cluster: %s: not reclaimed (%s): it stays frozen until the next renewal",
                            info.sandbox_id, e)
                sure = False
        return sure

    async def _watch(self) -> None:
        last = self._clock()
        grace_until = 0.0
        while True:
            await asyncio.sleep(CHECK_EVERY)
            now = self._clock()
            if now - last > max(STALL, self.config.heartbeat_seconds):
                # the node itself stalled (this loop did not run): the heartbeat gets a
                # turn to renew before the node fences (a renewal begun more than a lease
                # after the last one reclaims first: renewed)
                log.warning("cluster: this node's event loop stalled for %.1f s", now - last)
                grace_until = now + self.config.heartbeat_seconds
            last = now
            since = now - self._renewed_at
            if not self.fenced and since > self.config.fence_after and now >= grace_until:
                self.fenced = self._lapsed = True
                log.warning("cluster: lease not renewed for %.1f s: fencing (pausing every running sandbox)", since)
                self._fencing = asyncio.ensure_future(self._fence(since))

    async def _fence(self, since: float) -> None:
        if self._keeper is not None:
            if since > self.config.freeze_after:
                # the keeper may have frozen them (the node stalled): each is paused only once
                # the repository says it is still this node's (a reclaim: then no forced
                # adopt can take it over), the rest are dropped; then they thaw to be paused
                await self._reclaim()
                self._keeper.hold_until(self._clock() + self.config.fence_wait / 2)
            else:       # the node pauses them itself: the keeper waits longer
                self._keeper.hold_until(self._renewed_at + self.config.lease_seconds + self.config.fence_wait / 2)
        await self._pause_all()

    async def _pause_all(self) -> None:
        service = self._service()
        if service is None:
            return
        running = [i.sandbox_id for i in await service.list_sandboxes() if i.state == SandboxState.RUNNING]

        async def pause(sid: str) -> None:
            t0 = time.monotonic()
            try:
                await service.pause(sid)
                log.warning("cluster: fenced: %s paused in %.1f s", sid, time.monotonic() - t0)
            except NotFound:
                pass
            except Exception as e:      # noqa: BLE001 -- the keeper freezes what could not be paused
                log.error("cluster: fenced: pause of %s failed: %s", sid, e)
        await asyncio.gather(*(pause(s) for s in running))

    async def close(self) -> None:
        for task in (self._task, self._fencing, self._recovering):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self._keeper is not None:
            await asyncio.to_thread(self._keeper.close)
