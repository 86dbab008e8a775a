"""Resource use of a node's sandboxes over time, sampled from their guests.

What E2B's ``GET /sandboxes/{id}/metrics`` answers: CPU %, memory used/total/cache
and disk used/total every few seconds over the sandbox's life. The host cannot
see most of it (a guest's free memory, its root filesystem's use; under TCG the
QEMU process's CPU time is mostly code translation, not the guest's load), so
``MetricsRecorder`` asks each running guest's envd (``GET /metrics``,
envd/metrics.py) every ``interval`` seconds, as E2B's orchestrator does, and
keeps the samples in memory per sandbox: across pauses (a paused sandbox is
simply not sampled) until the sandbox is killed.

Bounded: a series holds at most ``capacity`` samples of 64 bytes (4320 by
default: 6 h at 5 s, 276 KiB). When it is full, its older half is merged
pairwise (each field's maximum, the earlier timestamp), so a long life is
kept at a resolution that halves with age instead of being cut off. The
series live in this process: a server restart starts them again.

Cost per sample: one HTTP/1.1 exchange with envd on a fresh connection
(envd_client.py). A sandbox whose lock is held (pause, resume, snapshot, fork
in progress) is skipped for that round, so sampling never talks to a VM being
stopped or captured.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from typing import Callable, Iterator, Mapping

from ..errors import VmError
from ..service import MetricSample
from .sandbox import Sandbox

log = logging.getLogger(__name__)

INTERVAL = 5.0              # seconds between two samples of one sandbox (E2B's finest step)
CAPACITY = 4320             # samples kept per sandbox before the older half is merged
TICK = 1.0                  # how often the recorder looks for sandboxes that are due
CONCURRENCY = 16            # envd requests in flight at once
SAMPLE_TIMEOUT = 3.0        # seconds one envd /metrics may take
FIRST_DELAY = 2.0           # seconds after a VM starts running before its first sample: its first
                            # requests (a fork's 16 children at once) are the user's, not ours
UNANSWERED = 2              # samples in a row without an answer: envd counts as unresponsive

_RECORD = struct.Struct("<dIfQQQQQ")   # timestamp, cpus, cpu %, mem used/total/cache, disk used/total


def sample_from_envd(body: Mapping[str, object], now: float) -> MetricSample:
    """A sample from envd's ``/metrics`` answer (E2B's envd field names); ValueError
    when a field is missing or not a number."""
    def num(name: str) -> float:
        v = body.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"envd /metrics: {name} is {v!r}")
        return v
    return MetricSample(timestamp=now, cpu_count=max(1, int(num("cpu_count"))),
                        cpu_used_pct=round(float(num("cpu_used_pct")), 2),
                        mem_used=int(num("mem_used")), mem_total=int(num("mem_total")),
                        mem_cache=int(body.get("mem_cache", 0) or 0),   # older envds do not send it
                        disk_used=int(num("disk_used")), disk_total=int(num("disk_total")))


def merged(a: MetricSample, b: MetricSample) -> MetricSample:
    """Two neighbouring samples as one: the maximum of each field (what E2B reports for
    a bucket), at the earlier one's time."""
    return MetricSample(min(a.timestamp, b.timestamp), max(a.cpu_count, b.cpu_count),
                        max(a.cpu_used_pct, b.cpu_used_pct), max(a.mem_used, b.mem_used),
                        max(a.mem_total, b.mem_total), max(a.mem_cache, b.mem_cache),
                        max(a.disk_used, b.disk_used), max(a.disk_total, b.disk_total))


class MetricSeries:
    """One sandbox's samples, oldest first, packed 64 bytes each."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 4:
            raise ValueError("a metric series needs room for at least 4 samples")
        self.capacity = capacity
        self._data = bytearray()

    def __len__(self) -> int:
        return len(self._data) // _RECORD.size

    def __iter__(self) -> Iterator[MetricSample]:
        for rec in _RECORD.iter_unpack(self._data):
            yield MetricSample(*rec)

    def add(self, s: MetricSample) -> None:
        if len(self) >= self.capacity:
            self._compact()
        self._data += _RECORD.pack(s.timestamp, s.cpu_count, s.cpu_used_pct, s.mem_used, s.mem_total,
                                   s.mem_cache, s.disk_used, s.disk_total)

    def _compact(self) -> None:
        samples = list(self)
        old = (len(samples) // 2) & ~1
        out = bytearray()
        for i in range(0, old, 2):
            m = merged(samples[i], samples[i + 1])
            out += _RECORD.pack(m.timestamp, m.cpu_count, m.cpu_used_pct, m.mem_used, m.mem_total,
                                m.mem_cache, m.disk_used, m.disk_total)
        out += self._data[old * _RECORD.size:]
        self._data = out

    def between(self, start: float | None, end: float | None) -> list[MetricSample]:
        return [s for s in self if (start is None or s.timestamp >= start) and (end is None or s.timestamp <= end)]

    def latest(self) -> MetricSample | None:
        if not self._data:
            return None
        return MetricSample(*_RECORD.unpack_from(self._data, len(self._data) - _RECORD.size))


class MetricsRecorder:
    """Samples every running sandbox of the node every ``interval`` seconds (the first
    time ``first_delay`` after it runs: after create, resume or a cold boot) and keeps the series.
    ``running``: the manager's table (read only); ``busy(sid)``: an operation holds the
    sandbox. Use within the manager's event loop."""

    def __init__(self, running: Mapping[str, Sandbox], busy: Callable[[str], bool], *,
                 interval: float = INTERVAL, capacity: int = CAPACITY, tick: float = TICK,
                 concurrency: int = CONCURRENCY, first_delay: float = FIRST_DELAY) -> None:
        self.running = running
        self.busy = busy
        self.interval = interval
        self.capacity = capacity
        self.tick = min(tick, interval)
        self.first_delay = first_delay
        self._series: dict[str, MetricSeries] = {}
        self._due: dict[str, tuple[Sandbox, float]] = {}   # sid -> (the VM sampled, next due time)
        self._slots = asyncio.Semaphore(concurrency)
        self._inflight: dict[str, asyncio.Task[MetricSample | None]] = {}
        self._misses: dict[str, int] = {}     # sid -> samples in a row its envd did not answer
        self._stop = asyncio.Event()
        self.samples_taken = 0
        self.failures = 0

    # -- reading ------------------------------------------------------------------

    def series(self, sid: str, start: float | None = None, end: float | None = None) -> list[MetricSample]:
        s = self._series.get(sid)
        return [] if s is None else s.between(start, end)

    def latest(self, sid: str) -> MetricSample | None:
        s = self._series.get(sid)
        return None if s is None else s.latest()

    def unresponsive(self, sid: str) -> bool:
        """Its envd missed the last ``UNANSWERED`` samples in a row (≥ 10 s without an
        answer): what a pause records as "envd unresponsive at pause", at no extra cost."""
        return self._misses.get(sid, 0) >= UNANSWERED

    def forget(self, sid: str) -> None:
        """The sandbox is gone (killed): drop its series."""
        self._series.pop(sid, None)
        self._due.pop(sid, None)
        self._misses.pop(sid, None)

    async def quiesce(self, sid: str) -> None:
        """End a request to ``sid``'s envd in flight (an operation is about to stop its VM:
        the connection is closed before the guest is frozen, not saved half-open)."""
        task = self._inflight.pop(sid, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- sampling -----------------------------------------------------------------

    async def sample(self, sbx: Sandbox) -> MetricSample | None:
        """Take one sample of ``sbx`` now and keep it; None when its envd did not answer
        in time (a stopped or busy guest)."""
        async with self._slots:
            try:
                body = await sbx.envd.with_token(sbx.guest_token).metrics(timeout=SAMPLE_TIMEOUT)
                s = sample_from_envd(body, time.time())
            except (VmError, ValueError) as e:
                self.failures += 1
                if self.running.get(sbx.id) is sbx:
                    self._misses[sbx.id] = self._misses.get(sbx.id, 0) + 1
                log.debug("metrics of %s not sampled: %s", sbx.id, e)
                return None
        if self.running.get(sbx.id) is not sbx:    # paused or killed while we asked
            return None
        self._misses.pop(sbx.id, None)
        self._series.setdefault(sbx.id, MetricSeries(self.capacity)).add(s)
        self.samples_taken += 1
        return s

    def due(self, now: float) -> list[Sandbox]:
        """The running sandboxes to sample now: ``first_delay`` after their VM was first
        seen running, then every ``interval``; never while an operation holds them."""
        out = []
        for sid, sbx in list(self.running.items()):
            known = self._due.get(sid)
            if known is None or known[0] is not sbx:     # a VM not seen yet: sampled shortly
                self._misses.pop(sid, None)
                self._due[sid] = (sbx, now + self.first_delay)
                continue
            if known[1] > now:
                continue
            if self.busy(sid):
                continue
            self._due[sid] = (sbx, now + self.interval)
            out.append(sbx)
        for sid in [sid for sid in self._due if sid not in self.running]:
            del self._due[sid]      # paused: its next VM is a new one
        return out

    def start_due(self) -> list[asyncio.Task[MetricSample | None]]:
        """Start sampling every sandbox that is due (a slow guest delays only itself)."""
        tasks = []
        for sbx in self.due(time.time()):
            if sbx.id in self._inflight:
                continue
            task = asyncio.get_running_loop().create_task(self.sample(sbx))
            self._inflight[sbx.id] = task
            task.add_done_callback(lambda t, sid=sbx.id: self._done(sid, t))
            tasks.append(task)
        return tasks

    def _done(self, sid: str, task: asyncio.Task[MetricSample | None]) -> None:
        if self._inflight.get(sid) is task:
            del self._inflight[sid]

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.start_due()
                except Exception as e:  # noqa: BLE001 - a failing round must not end sampling
                    log.warning("metrics sampling failed: %s", e)
                try:
                    await asyncio.wait_for(self._stop.wait(), self.tick)
                except asyncio.TimeoutError:
                    pass
        finally:
            for task in list(self._inflight.values()):
                task.cancel()
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)
