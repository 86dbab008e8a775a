"""A fork's background commit waits for idle CPU (fork.py): the wait ends at once when
something needs the commit, and never outlasts its deadline, whatever the host's load."""
from __future__ import annotations

import asyncio
import time

from aenv_vm.sandboxes.fork import COMMIT_IDLE_OVER, cpu_times, wait_for_idle_cpu


def test_cpu_times_count_up() -> None:
    idle0, total0 = cpu_times()
    sum(range(2_000_000))
    idle1, total1 = cpu_times()
    assert 0 <= idle0 <= total0 and idle1 >= idle0 and total1 > total0


def test_a_need_ends_the_wait_at_once() -> None:
    async def run() -> float:
        needed = asyncio.Event()
        waiter = asyncio.ensure_future(wait_for_idle_cpu(needed, time.monotonic() + 60))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        needed.set()
        await waiter
        return time.monotonic() - t0
    assert asyncio.run(run()) < COMMIT_IDLE_OVER


def test_the_deadline_bounds_the_wait_on_a_busy_host() -> None:
    """Both CPUs' worth of busy threads cannot hold the commit past its deadline."""
    stop = False

    def spin() -> None:
        while not stop:
            pass

    async def run() -> tuple[float, list[asyncio.Future[None]]]:
        loop = asyncio.get_running_loop()
        spinners = [loop.run_in_executor(None, spin) for _ in range(4)]
        t0 = time.monotonic()
        await wait_for_idle_cpu(asyncio.Event(), t0 + 1.5)
        return time.monotonic() - t0, spinners

    async def main() -> float:
        nonlocal stop
        took, spinners = await run()
        stop = True
        await asyncio.gather(*spinners)
        return took
    assert asyncio.run(main()) < 1.5 + 2 * COMMIT_IDLE_OVER
