"""The node's shutdown parts (aenv_cli/node.py ``shutdown_part``): a slow part is named in
the log while it runs, a bounded one is cancelled at its bound, and a part's own failure
still reaches the caller."""
from __future__ import annotations

import asyncio

import pytest

from aenv_cli import node


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "SHUTDOWN_SLOW_AFTER", 0.05)


def test_a_quick_part_says_nothing() -> None:
    said: list[str] = []
    asyncio.run(node.shutdown_part("quick", asyncio.sleep(0), said.append))
    assert said == []


def test_a_slow_part_is_named_and_its_end_reported() -> None:
    said: list[str] = []
    asyncio.run(node.shutdown_part("the slow part", asyncio.sleep(0.2), said.append))
    assert said[0] == "shutting down: the slow part still running after 0 s"
    assert said[1].startswith("shutting down: the slow part done after 0.") and len(said) == 2


def test_a_bounded_part_is_cancelled_at_its_bound() -> None:
    said: list[str] = []
    cancelled: list[bool] = []

    async def hangs() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await node.shutdown_part("leaving the fleet", hangs(), said.append, give_up_after=0.2)
        return loop.time() - t0

    took = asyncio.run(main())
    assert cancelled == [True] and took < 5
    assert said[-1] == "shutting down: leaving the fleet given up after 0 s"


def test_a_failing_part_raises_to_the_caller() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(node.shutdown_part("failing", fails(), print))
