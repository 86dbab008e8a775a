"""Admission of restores: at most ``slots`` run at once, the rest wait in arrival order.

Why: a restore (a create that found no pooled clone, a pool refill, a resume, an
adoption, each fork child) is CPU-bound from its QEMU's start until its envd answers
(under TCG every page of guest code is translated again). N restores started at once
share the CPUs, so each takes about N times as long and no sandbox is usable until
nearly all are. Run ``slots`` at a time instead: the first sandbox answers after one
restore's time, the rest follow in arrival order, and the whole burst takes no longer.

* Foreground restores (a client waits for them) are served before background ones
  (pool refills), which are never refused: they only wait.
* A foreground restore is refused at once, with ``AdmissionRefused`` (a
  ``CapacityError`` carrying ``retry_after``), when ``max_queue`` foreground restores
  already wait, or when its estimated wait exceeds ``max_wait``. The estimate is the
  number of waves ahead of it (restores waiting, and itself, over ``slots``) times the
  recent restore time, an exponentially weighted mean of the restores that ran (until
  one has, a guess).
  ``retry_after`` is when that estimate would fall back within the bound.
* A waiter that is cancelled (its client went away) leaves the queue; a slot granted
  to it in the same moment is handed on.
* A foreground restore is also refused (a plain ``CapacityError``: the node is full
  for now) when the host is short of what the node keeps free (``Headroom``: available
  memory, disk), checked on arrival and again when its slot comes: a burst queued
  while memory lasted does not start restores the host can no longer hold.

The gate holds no lock across awaits and keeps no per-restore state beyond the
queue's futures: everything is on the node's event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Protocol

from aenv_store.diskfloor import DiskFloor

from ..errors import AdmissionRefused, CapacityError

# Until restores have run, one is assumed to take this long (a TCG restore here: ~1-2 s).
INITIAL_RESTORE_SECONDS = 2.0
# Weight of the newest restore in the mean restore time.
EWMA_WEIGHT = 0.2


@dataclass(frozen=True)
class AdmissionLimits:
    slots: int                  # restores running at once
    max_queue: int = 256        # foreground restores waiting; the next one is refused
    max_wait: float = 30.0      # seconds a new foreground restore may expect to wait

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"admission slots must be at least 1, not {self.slots}")
        if self.max_queue < 0:
            raise ValueError(f"admission max_queue must be at least 0, not {self.max_queue}")
        if not self.max_wait > 0:
            raise ValueError(f"admission max_wait must be above 0, not {self.max_wait}")

    def restore_queue_text(self) -> str:
        return (f"{self.max_queue} waiting in arrival order, each expecting at most {self.max_wait:g} s; "
                f"beyond that 429 with Retry-After")


def auto_slots() -> int:
    """Restores at once by default: one per CPU this process may run on (a restore keeps
    about one CPU busy until its envd answers)."""
    return max(1, len(os.sched_getaffinity(0)))


def mem_available() -> int:
    """The host's MemAvailable, bytes (0 when /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass(frozen=True)
class Headroom:
    """What the node keeps free for itself and the sandboxes it runs: a foreground
    restore that would start below it is refused. 0 turns a bound off."""
    min_free_memory: int = 0            # bytes of the host's MemAvailable
    min_free_disk: int = 0              # bytes free on disk_path's filesystem
    disk_path: Path | None = None       # where sandboxes' upper layers and pauses grow
    min_free_inodes: int = 0            # inodes free on disk_path's filesystem

    def shortage(self) -> tuple[str, str] | None:
        """(reason, message) when the host is below a bound now, else None."""
        if self.min_free_memory:
            avail = mem_available()
            if avail < self.min_free_memory:
                return "memory", (f"the host has {avail >> 20} MiB of memory available, below the "
                                  f"{self.min_free_memory >> 20} MiB this node keeps free ([vm] min_free_memory_mib)")
        if (self.min_free_disk or self.min_free_inodes) and self.disk_path is not None:
            why = DiskFloor(self.min_free_disk, self.min_free_inodes).shortage(self.disk_path)
            if why is not None:
                return "disk", why
        return None


@dataclass(frozen=True)
class AdmissionStats:
    slots: int
    in_flight: int                  # restores holding a slot
    queued: int                     # foreground restores waiting
    queued_background: int          # pool refills waiting
    restore_seconds: float          # the mean restore time the estimate uses
    in_flight_foreground: int = 0   # of in_flight, restores someone waits for (not pool refills)


class AdmissionObserver(Protocol):
    """Told of each admission's wait and each refusal (the node's metrics)."""

    def waited(self, seconds: float, background: bool) -> None: ...

    def refused(self, reason: str) -> None: ...


class Admission:
    """The node-wide gate every restore passes (see the module doc)."""

    def __init__(self, limits: AdmissionLimits, observer: AdmissionObserver | None = None,
                 initial_restore_seconds: float = INITIAL_RESTORE_SECONDS,
                 headroom: Callable[[], tuple[str, str] | None] | None = None) -> None:
        """``headroom``: (reason, message) when the host is short of what the node keeps
        free (``Headroom.shortage``); None: no such bound."""
        self.limits = limits
        self.observer = observer
        self.headroom = headroom
        self._mean = initial_restore_seconds
        self._measured = False
        self._in_flight = 0
        self._in_flight_foreground = 0
        self._foreground: deque[asyncio.Future[None]] = deque()
        self._background: deque[asyncio.Future[None]] = deque()

    def stats(self) -> AdmissionStats:
        return AdmissionStats(self.limits.slots, self._in_flight, len(self._foreground),
                              len(self._background), self._mean, self._in_flight_foreground)

    def estimated_wait(self) -> float:
        """Seconds a foreground restore arriving now would wait for its slot."""
        if self._in_flight < self.limits.slots and not self._foreground:
            return 0.0
        return math.ceil((len(self._foreground) + 1) / self.limits.slots) * self._mean

    def check(self) -> None:
        """Refuse now (``AdmissionRefused``) what ``slot`` would refuse for a foreground
        restore arriving now: for callers with work to do before their restore."""
        self._check_headroom()
        lim = self.limits
        if self._in_flight < lim.slots and not self._foreground:
            return      # it runs at once
        waiting = len(self._foreground)
        if waiting >= lim.max_queue:
            # when enough of the queue has drained for one more to fit
            behind = waiting - lim.max_queue + 1
            self._refuse("queue", f"{waiting} restores are already waiting on this node",
                         behind / lim.slots * self._mean)
        wait = self.estimated_wait()
        if wait > lim.max_wait:
            self._refuse("wait", f"a restore would wait about {wait:.1f} s on this node "
                                 f"(more than {lim.max_wait:g} s)", wait - lim.max_wait)

    def _check_headroom(self) -> None:
        short = self.headroom() if self.headroom is not None else None
        if short is not None:
            reason, message = short
            if self.observer is not None:
                self.observer.refused(reason)
            raise CapacityError(message)

    def _refuse(self, reason: str, why: str, retry_after: float) -> None:
        if self.observer is not None:
            self.observer.refused(reason)
        seconds = max(1, math.ceil(retry_after))
        raise AdmissionRefused(f"{why}: retry after {seconds} s", reason=reason, retry_after=seconds)

    async def _acquire(self, background: bool) -> None:
        free = self._in_flight < self.limits.slots
        if free and not self._foreground and (not background or not self._background):
            self._in_flight += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._background if background else self._foreground
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(None)     # granted as it was cancelled: hand the slot on
            else:
                with contextlib.suppress(ValueError):
                    queue.remove(fut)
            raise

    def _release(self, seconds: float | None) -> None:
        self._in_flight -= 1
        if seconds is not None:     # the first restore replaces the guess; later ones move the mean
            self._mean = seconds if not self._measured else self._mean + EWMA_WEIGHT * (seconds - self._mean)
            self._measured = True
        while self._in_flight < self.limits.slots:
            queue = self._foreground or self._background
            if not queue:
                return
            fut = queue.popleft()
            if fut.done():      # cancelled while waiting
                continue
            self._in_flight += 1
            fut.set_result(None)

    @contextlib.asynccontextmanager
    async def slot(self, *, background: bool = False) -> AsyncIterator[None]:
        """Hold one of the node's restore slots for the body: wait for it in arrival
        order, or (foreground only) be refused at once with ``AdmissionRefused``."""
        if not background:
            self.check()
        t0 = time.monotonic()
        await self._acquire(background)
        t1 = time.monotonic()
        if self.observer is not None:
            self.observer.waited(t1 - t0, background)
        if not background and t1 - t0 > 0.05:
            try:        # it waited: the host may have filled up meanwhile
                self._check_headroom()
            except CapacityError:
                self._release(None)
                raise
        foreground = 0 if background else 1
        self._in_flight_foreground += foreground
        try:
            yield
        finally:
            self._in_flight_foreground -= foreground
            self._release(time.monotonic() - t1)
