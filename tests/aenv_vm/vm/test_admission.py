"""The restore gate (aenv_vm/machine/admission.py), on an event loop, no VMs: slots,
arrival order, foreground before pool refills, refusals with their retry delay,
cancellation, and (hypothesis) any sequence of arrivals, finishes and cancellations
keeps its invariants."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings, strategies as st

from aenv_vm.errors import AdmissionRefused, CapacityError
from aenv_vm.machine.admission import Admission, AdmissionLimits, auto_slots


@dataclass
class Heard:
    waits: list[tuple[float, bool]] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    def waited(self, seconds: float, background: bool) -> None:
        self.waits.append((seconds, background))

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)


async def _hold(gate: Admission, name: str, started: list[str], release: asyncio.Event,
                background: bool = False) -> None:
    async with gate.slot(background=background):
        started.append(name)
        await release.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        AdmissionLimits(0)
    with pytest.raises(ValueError):
        AdmissionLimits(1, max_queue=-1)
    with pytest.raises(ValueError):
        AdmissionLimits(1, max_wait=0)
    assert auto_slots() >= 1


def test_slots_bound_the_restores_and_the_rest_go_in_arrival_order() -> None:
    async def case() -> None:
        gate = Admission(AdmissionLimits(2))
        started: list[str] = []
        gates = {n: asyncio.Event() for n in "abcdef"}
        tasks = [asyncio.ensure_future(_hold(gate, n, started, gates[n])) for n in "abcdef"]
        await _settle()
        assert started == ["a", "b"]
        assert gate.stats().in_flight == 2 and gate.stats().queued == 4
        gates["b"].set()
        await _settle()
        assert started == ["a", "b", "c"]
        for n in "acd":
            gates[n].set()
        await _settle()
        assert started == list("abcdef")
        for e in gates.values():
            e.set()
        await asyncio.gather(*tasks)
        assert gate.stats().in_flight == 0 and gate.stats().queued == 0
    asyncio.run(case())


def test_foreground_goes_before_pool_refills_which_are_never_refused() -> None:
    async def case() -> None:
        heard = Heard()
        gate = Admission(AdmissionLimits(1, max_queue=1), heard)
        started: list[str] = []
        go = asyncio.Event()
        first = asyncio.ensure_future(_hold(gate, "fg0", started, go))
        await _settle()
        refills = [asyncio.ensure_future(_hold(gate, f"bg{i}", started, go, background=True)) for i in range(3)]
        await _settle()
        late = asyncio.ensure_future(_hold(gate, "fg1", started, go))   # arrives after the refills
        await _settle()
        assert gate.stats().queued_background == 3 and gate.stats().queued == 1
        go.set()
        await asyncio.gather(first, late, *refills)
        assert started == ["fg0", "fg1", "bg0", "bg1", "bg2"]
        assert heard.refusals == []
        assert [bg for _, bg in heard.waits].count(True) == 3
    asyncio.run(case())


def test_a_full_queue_is_refused_at_once_with_a_retry_delay() -> None:
    async def case() -> None:
        heard = Heard()
        gate = Admission(AdmissionLimits(2, max_queue=3, max_wait=1000), heard, initial_restore_seconds=4.0)
        started: list[str] = []
        go = asyncio.Event()
        tasks = [asyncio.ensure_future(_hold(gate, str(i), started, go)) for i in range(5)]   # 2 run, 3 wait
        await _settle()
        with pytest.raises(AdmissionRefused) as e:
            async with gate.slot():
                pass
        assert isinstance(e.value, CapacityError)
        assert e.value.reason == "queue" and heard.refusals == ["queue"]
        # one more fits when one of the 3 waiting has gone: 1 / 2 slots * 4 s
        assert e.value.retry_after == 2 and "retry after 2 s" in str(e.value)
        go.set()
        await asyncio.gather(*tasks)
        async with gate.slot():     # and after the burst, it is admitted again
            pass
    asyncio.run(case())


def test_a_long_estimated_wait_is_refused_with_when_it_would_fit() -> None:
    async def case() -> None:
        gate = Admission(AdmissionLimits(2, max_queue=100, max_wait=10), initial_restore_seconds=3.0)
        started: list[str] = []
        go = asyncio.Event()
        # 2 run; waiting n: a new one's wait is ceil((n + 1) / 2) * 3 s; <= 10 s up to n = 5
        tasks = [asyncio.ensure_future(_hold(gate, str(i), started, go)) for i in range(2 + 5)]
        await _settle()
        assert gate.stats().queued == 5 and gate.estimated_wait() == 9.0
        tasks.append(asyncio.ensure_future(_hold(gate, "6th", started, go)))
        await _settle()
        assert gate.estimated_wait() == 12.0
        with pytest.raises(AdmissionRefused) as e:
            async with gate.slot():
                pass
        assert e.value.reason == "wait" and e.value.retry_after == 2    # 12 s - 10 s
        go.set()
        await asyncio.gather(*tasks)
        assert gate.estimated_wait() == 0.0
    asyncio.run(case())


def test_the_estimate_follows_the_restores_that_ran() -> None:
    async def case() -> None:
        gate = Admission(AdmissionLimits(1), initial_restore_seconds=1000.0)
        async with gate.slot():
            await asyncio.sleep(0.01)
        assert gate.stats().restore_seconds < 1.0      # the first one replaces the guess
        for _ in range(30):
            async with gate.slot():
                await asyncio.sleep(0.01)
        assert 0.005 < gate.stats().restore_seconds < 0.1
    asyncio.run(case())


def test_a_cancelled_waiter_leaves_the_queue_and_a_granted_one_hands_its_slot_on() -> None:
    async def case() -> None:
        gate = Admission(AdmissionLimits(1))
        started: list[str] = []
        go = {n: asyncio.Event() for n in "abc"}
        a = asyncio.ensure_future(_hold(gate, "a", started, go["a"]))
        b = asyncio.ensure_future(_hold(gate, "b", started, go["b"]))
        c = asyncio.ensure_future(_hold(gate, "c", started, go["c"]))
        await _settle()
        b.cancel()                                  # waiting: it just leaves
        await _settle()
        assert gate.stats().queued == 1
        go["a"].set()
        await _settle()
        assert started == ["a", "c"]
        d = asyncio.ensure_future(_hold(gate, "d", started, asyncio.Event()))
        e = asyncio.ensure_future(_hold(gate, "e", started, go["c"]))
        await _settle()
        go["c"].set()       # c ends and grants d ...
        await asyncio.sleep(0)
        d.cancel()          # ... which is cancelled before it ran: e gets the slot
        await _settle()
        assert started[-1] == "e" and gate.stats().in_flight == 0
        await asyncio.gather(a, c, e)
        assert b.cancelled() and d.cancelled()
    asyncio.run(case())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.sampled_from(["fg", "bg", "finish", "cancel"]),
                                             st.integers(0, 50)), max_size=40))
def test_any_sequence_keeps_the_invariants(slots: int, steps: list[tuple[str, int]]) -> None:
    async def case() -> None:
        gate = Admission(AdmissionLimits(slots, max_queue=10_000, max_wait=10_000))
        running: list[tuple[int, asyncio.Event]] = []
        tasks: list[asyncio.Task[None]] = []
        order: list[int] = []
        arrivals: dict[int, bool] = {}      # task number -> background
        n = 0

        async def one(i: int, background: bool) -> None:
            ev = asyncio.Event()
            async with gate.slot(background=background):
                order.append(i)
                running.append((i, ev))
                try:
                    await ev.wait()
                finally:    # finished or cancelled while it held its slot
                    running.remove((i, ev))

        for kind, k in steps:
            if kind in ("fg", "bg"):
                arrivals[n] = kind == "bg"
                tasks.append(asyncio.ensure_future(one(n, kind == "bg")))
                n += 1
            elif kind == "finish" and running:
                running[k % len(running)][1].set()
            elif kind == "cancel" and tasks:
                tasks[k % len(tasks)].cancel()
            await _settle()
            st_ = gate.stats()
            assert st_.in_flight <= slots
            assert st_.in_flight == len(running)
            # a slot is never idle while somebody waits
            assert st_.queued + st_.queued_background == 0 or st_.in_flight == slots
        while running or any(not t.done() for t in tasks):
            for _, ev in list(running):
                ev.set()
            await _settle()
        assert gate.stats().in_flight == 0
        # within each class, slots were granted in arrival order
        for bg in (False, True):
            granted = [i for i in order if arrivals[i] is bg]
            assert granted == sorted(granted)
    asyncio.run(case())


def test_a_free_slot_admits_even_with_no_queue_allowed() -> None:
    async def case() -> None:
        gate = Admission(AdmissionLimits(1, max_queue=0, max_wait=0.001), initial_restore_seconds=50)
        async with gate.slot():         # free: runs at once, whatever the bounds
            with pytest.raises(AdmissionRefused) as e:     # busy, and nobody may wait
                gate.check()
            assert e.value.reason == "queue"
        gate.check()
    asyncio.run(case())


def test_a_host_short_of_headroom_refuses_foreground_restores_as_full() -> None:
    """Below the memory or disk the node keeps free, a create is answered "full" at once
    (a CapacityError, not a retryable queue refusal), counted by reason; pool refills
    still only wait. A restore that waited is checked again when its slot comes."""
    from pathlib import Path

    from aenv_vm.errors import AdmissionRefused, CapacityError
    from aenv_vm.machine.admission import Admission, AdmissionLimits, Headroom

    class Seen:
        def __init__(self) -> None:
            self.reasons: list[str] = []

        def waited(self, seconds: float, background: bool) -> None:
            pass

        def refused(self, reason: str) -> None:
            self.reasons.append(reason)

    short: list[tuple[str, str] | None] = [None]
    seen = Seen()
    gate = Admission(AdmissionLimits(slots=1), seen, headroom=lambda: short[0])

    async def main() -> None:
        async with gate.slot():
            pass
        short[0] = ("memory", "the host has 100 MiB of memory available, below the 512 MiB ...")
        with pytest.raises(CapacityError) as e:
            async with gate.slot():
                pass
        assert not isinstance(e.value, AdmissionRefused) and "512 MiB" in str(e.value)
        async with gate.slot(background=True):     # a pool refill is never refused
            pass
        # queued while there was room; the host fills up before its slot comes
        short[0] = None
        release = asyncio.Event()

        async def holder() -> None:
            async with gate.slot():
                await release.wait()
        h = asyncio.ensure_future(holder())
        await asyncio.sleep(0)

        async def waiter() -> None:
            async with gate.slot():
                pass
        w = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.1)
        short[0] = ("disk", "no disk")
        release.set()
        await h
        with pytest.raises(CapacityError):
            await w
        assert gate.stats().in_flight == 0          # its slot went back
        short[0] = None
        async with gate.slot():
            pass

    asyncio.run(main())
    assert seen.reasons == ["memory", "disk"]
    # the real bounds: a floor above any host's memory, a disk floor above any disk
    assert Headroom(min_free_memory=1 << 62).shortage()[0] == "memory"      # type: ignore[index]
    assert Headroom(min_free_disk=1 << 62, disk_path=Path("/")).shortage()[0] == "disk"   # type: ignore[index]
    assert Headroom(min_free_memory=1 << 20, min_free_disk=1 << 20, disk_path=Path("/")).shortage() is None


def test_stats_tell_foreground_restores_in_flight_from_pool_refills() -> None:
    """The fleet's placement weighs a node's foreground restores (aenv_cli/node.py
    restore_load): a pool refill holding a slot is not one of them."""
    async def case() -> None:
        gate = Admission(AdmissionLimits(2, max_queue=4))
        started: list[str] = []
        go = asyncio.Event()
        refill = asyncio.ensure_future(_hold(gate, "bg", started, go, background=True))
        create = asyncio.ensure_future(_hold(gate, "fg", started, go))
        await _settle()
        s = gate.stats()
        assert (s.in_flight, s.in_flight_foreground) == (2, 1)
        go.set()
        await asyncio.gather(refill, create)
        s = gate.stats()
        assert (s.in_flight, s.in_flight_foreground) == (0, 0)
    asyncio.run(case())
