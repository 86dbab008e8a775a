"""Sandbox TTLs: on expiry a running sandbox is paused, or killed when it was
created with ``auto_pause=False``. Deadlines live in the sandbox records
(create, resume and set_timeout move them), so they survive restarts. Layers
above (the API's logs and per-sandbox state) hear of each expiry through
``Snapshotter.expiry_listeners``: ``listener(sandbox_id, "paused" | "killed")``."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from .qemu.errors import VmError
from .records import SandboxState

if TYPE_CHECKING:
    from .snapshot.snapshotter import Snapshotter

log = logging.getLogger(__name__)


class TtlWatcher:
    def __init__(self, snap: "Snapshotter", interval: float = 0.25) -> None:
        self.snap = snap
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
            for rec in self.snap.records.all():
                if self._stop.is_set():
                    return
                if rec.state != SandboxState.RUNNING or rec.end_at > now or rec.id not in self.snap.mgr.sandboxes:
                    continue
                try:
                    if rec.auto_pause:
                        await self.snap.pause(rec.id)
                        self.expired.append((rec.id, "paused"))
                    else:
                        await self.snap.mgr.kill(rec.id)
                        self.expired.append((rec.id, "killed"))
                    log.info("sandbox %s expired: %s", rec.id, self.expired[-1][1])
                    for listener in list(self.snap.expiry_listeners):
                        try:
                            listener(rec.id, self.expired[-1][1])
                        except Exception as e:  # a listener must not stop the watcher
                            log.warning("TTL listener failed for %s: %s", rec.id, e)
                except (VmError, OSError) as e:
                    log.warning("TTL action on %s failed: %s", rec.id, e)
