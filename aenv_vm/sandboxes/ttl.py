"""Sandbox TTLs: a watcher that finds running sandboxes past their deadline.

Deadlines live in the sandbox records (create, resume and set_timeout move
them), so they survive restarts. The watcher only finds expiries and reports
each one through its ``expire`` callback, which does what the sandbox asked
for (pause it, or kill it when it was created with ``auto_pause=False``) and
answers which it did; the manager then tells its expiry listeners (the API's
logs and per-sandbox state).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from ..errors import VmError
from .records import RecordStore, SandboxRecord, SandboxState

log = logging.getLogger(__name__)


class TtlWatcher:
    def __init__(self, records: RecordStore, is_running: Callable[[str], bool],
                 expire: Callable[[SandboxRecord], Awaitable[str]], interval: float = 0.25) -> None:
        self.records = records
        self.is_running = is_running
        self.expire = expire
        self.interval = interval
        self.expired: list[tuple[str, str]] = []   # (sandbox id, "paused" | "killed"), for tests and logs
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """End ``run`` after the action in progress (never cancel a pause half-way)."""
        self._stop.set()

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                return
            except asyncio.TimeoutError:
                pass
            now = time.time()
            for rec in self.records.all():
                if self._stop.is_set():
                    return
                if rec.state != SandboxState.RUNNING or rec.end_at > now or not self.is_running(rec.id):
                    continue
                try:
                    action = await self.expire(rec)
                except (VmError, OSError) as e:
                    log.warning("TTL action on %s failed: %s", rec.id, e)
                    continue
                self.expired.append((rec.id, action))
                log.info("sandbox %s expired: %s", rec.id, action)
