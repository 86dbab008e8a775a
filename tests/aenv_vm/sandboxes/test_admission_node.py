"""The restore gate on a real node (issue 27): QEMU restores of creates, a resume and
fork children pass one admission slot at a time, in arrival order; beyond the wait
bound a create is refused at once (``AdmissionRefused``) and the node keeps working."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aenv_vm.errors import AdmissionRefused
from aenv_vm.machine.admission import Admission, AdmissionLimits
from aenv_vm.sandboxes.manager import SandboxManager
from aenv_vm.sandboxes.sandbox import Sandbox

from .conftest import Env
from .test_pause_resume import ash

pytestmark = pytest.mark.qemu


@dataclass
class Watch:
    """Samples the gate while restores run: the most ever in flight."""
    gate: Admission
    most: int = 0
    waits: list[float] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    def waited(self, seconds: float, background: bool) -> None:
        self.waits.append(seconds)

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)

    async def run(self) -> None:
        while True:
            self.most = max(self.most, self.gate.stats().in_flight)
            await asyncio.sleep(0.01)


def test_restores_pass_one_slot_in_arrival_order(env: Env, tmp_path: Path) -> None:
    async def run() -> None:
        # one slot; a restore assumed to take 1000 s until one has run, so a create that
        # finds one running and one waiting would wait 2000 s > 1500: refused at once
        gate = Admission(AdmissionLimits(1, max_queue=100, max_wait=1500), initial_restore_seconds=1000)
        watch = Watch(gate)
        gate.observer = watch
        async with SandboxManager(env.store, env.guest, tmp_path / "node", admission=gate) as mgr:
            sampler = asyncio.ensure_future(watch.run())
            done: list[int] = []

            async def create(i: int) -> Sandbox:
                sbx = await mgr.create("base")
                done.append(i)
                return sbx
            first = asyncio.ensure_future(create(0))
            await asyncio.sleep(0)
            second = asyncio.ensure_future(create(1))
            await asyncio.sleep(0)
            t0 = time.monotonic()
            with pytest.raises(AdmissionRefused) as refused:
                await mgr.create("base")
            assert time.monotonic() - t0 < 5      # at once, not after the others (a bound, not a benchmark)
            assert refused.value.reason == "wait" and refused.value.retry_after >= 500
            a, b = await asyncio.gather(first, second)
            assert done == [0, 1]                  # served in arrival order
            assert watch.refusals == ["wait"] and len(watch.waits) == 2
            # the mean now is a real restore's time: the same create is admitted
            assert gate.stats().restore_seconds < 200
            assert await ash(a, "echo ok") == "ok"
            # a resume refused while the node is busy: refused before it touched the pause,
            # so the sandbox is paused as it was and resumes once there is room
            await mgr.pause(b.id)
            gate.limits = AdmissionLimits(1, max_queue=0, max_wait=1500)
            async with gate.slot():
                with pytest.raises(AdmissionRefused):
                    await mgr.resume(b.id)
            assert mgr.record(b.id).state.value == "paused"
            gate.limits = AdmissionLimits(1, max_queue=100, max_wait=1500)
            # a resume and fork children pass the same gate, one at a time
            back = await mgr.resume(b.id)
            assert await ash(back, "echo back") == "back"
            kids = await mgr.fork(a.id, 3)
            assert all(isinstance(k, Sandbox) for k in kids), kids
            assert len(watch.waits) == 2 + 1 + 1 + 3      # creates, the test's own slot, resume, children
            assert watch.most == 1 and gate.stats().in_flight == 0
            sampler.cancel()
            for k in kids:
                assert isinstance(k, Sandbox)
                assert await ash(k, "echo child") == "child"
    asyncio.run(run())
