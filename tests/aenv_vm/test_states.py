"""The sandbox state table (aenv_vm/states.py): every (phase, operation) pair has one
outcome, sequences of operations never reach an undefined pair, and the decisions taken
where the API and the node used to disagree are E2B's."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, strategies as st

from aenv_vm.errors import AlreadyHeld, Conflict, NotFound, NotPaused, UnresponsiveSnapshot, VmError
from aenv_vm.states import (PAUSED_PHASES, TABLE, Op, Outcome, Phase, Verdict, check, coarse, phase_of,
                            transition)


def test_every_pair_has_exactly_one_outcome() -> None:
    assert set(TABLE) == set(itertools.product(Phase, Op))
    for (phase, op), outcome in TABLE.items():
        assert isinstance(outcome, Outcome), (phase, op)
        if outcome.verdict is Verdict.REFUSED:
            assert outcome.next is None and outcome.error is not None and issubclass(outcome.error, VmError)
            err = outcome.refusal("sbx-1", phase, note="why")
            assert isinstance(err, outcome.error) and str(err) and "{" not in str(err), (phase, op, err)
        else:
            assert outcome.next is not None and outcome.error is None and not outcome.message, (phase, op)
        if outcome.verdict is Verdict.NOOP:
            assert outcome.next is phase, (phase, op)      # a no-op leaves the sandbox where it is
        assert not outcome.boot or (outcome.next is Phase.RUNNING and phase in PAUSED_PHASES), (phase, op)


def test_an_unknown_sandbox_is_not_found_except_to_create_adopt_and_fork_its_pause() -> None:
    for op in Op:
        outcome = transition(Phase.GONE, op)
        if op in (Op.CREATE, Op.ADOPT, Op.FORK_PAUSE):    # the last two ask the shared repository
            assert outcome.verdict is Verdict.ALLOWED
        else:
            assert outcome.refused and outcome.error is NotFound, op
            assert str(outcome.refusal("sbx-x", Phase.GONE)) == "unknown sandbox 'sbx-x'"


def test_phase_of_records() -> None:
    assert phase_of(None) is Phase.GONE
    assert phase_of("running") is Phase.RUNNING
    assert phase_of("paused") is Phase.PAUSED
    assert phase_of("paused", cold_boot=True) is Phase.PAUSED_FILESYSTEM
    assert phase_of("paused", cold_boot=True, envd_unresponsive=True) is Phase.PAUSED_FILESYSTEM
    assert phase_of("paused", envd_unresponsive=True) is Phase.PAUSED_UNRESPONSIVE
    assert phase_of("lost") is Phase.LOST
    with pytest.raises(ValueError):
        phase_of("sleeping")
    assert {coarse(p) for p in Phase} == {"running", "paused", "lost", "gone"}
    for p in Phase:     # every phase a record can be in reads back as itself
        if p is not Phase.GONE:
            assert phase_of(coarse(p), p is Phase.PAUSED_FILESYSTEM, p is Phase.PAUSED_UNRESPONSIVE) is p


@given(st.lists(st.sampled_from(list(Op)), max_size=40), st.sampled_from(list(Phase)))
def test_sequences_never_reach_an_undefined_pair(ops: list[Op], start: Phase) -> None:
    phase = start
    for op in ops:
        outcome = transition(phase, op)          # a KeyError here is an undefined pair
        if outcome.refused:
            with pytest.raises(outcome.error or VmError):
                check(phase, op, "sbx-1")
            continue
        assert check(phase, op, "sbx-1") is outcome
        assert outcome.next is not None
        phase = outcome.next


@given(st.lists(st.sampled_from(list(Op)), max_size=40))
def test_a_created_sandbox_is_always_killable_and_then_gone(ops: list[Op]) -> None:
    phase = transition(Phase.GONE, Op.CREATE).next
    assert phase is Phase.RUNNING
    for op in ops:
        outcome = transition(phase, op)
        if not outcome.refused and outcome.next is not None:
            phase = outcome.next
        if phase is Phase.GONE:
            return
        assert transition(phase, Op.KILL).next is Phase.GONE
        assert transition(phase, Op.GET).verdict is Verdict.NOOP


# -- the decisions (E2B's API where the node and the API disagreed) ------------------------

def test_pause_of_a_paused_sandbox_is_e2bs_409() -> None:
    for phase in PAUSED_PHASES:
        for op in (Op.PAUSE, Op.PAUSE_FILESYSTEM, Op.PAUSE_UNRESPONSIVE):
            with pytest.raises(Conflict) as e:
                check(phase, op, "sbx-1")
            assert str(e.value) == "Error pausing sandbox - sandbox 'sbx-1' is already paused"


def test_resume_of_a_running_sandbox_is_409_and_connect_a_noop() -> None:
    for op in (Op.RESUME, Op.RESUME_BOOT):
        with pytest.raises(Conflict, match="already running"):
            check(Phase.RUNNING, op, "sbx-1")
    for op in (Op.CONNECT, Op.CONNECT_BOOT, Op.AUTO_RESUME):
        assert transition(Phase.RUNNING, op).verdict is Verdict.NOOP


def test_how_each_pause_resumes() -> None:
    assert not transition(Phase.PAUSED, Op.RESUME).boot
    assert transition(Phase.PAUSED, Op.RESUME_BOOT).boot
    assert transition(Phase.PAUSED_FILESYSTEM, Op.RESUME).boot      # no memory was kept
    assert transition(Phase.PAUSED_FILESYSTEM, Op.CONNECT).boot
    with pytest.raises(UnresponsiveSnapshot, match="only by cold boot"):
        check(Phase.PAUSED_UNRESPONSIVE, Op.RESUME, "sbx-1")
    with pytest.raises(UnresponsiveSnapshot):
        check(Phase.PAUSED_UNRESPONSIVE, Op.CONNECT, "sbx-1")
    assert transition(Phase.PAUSED_UNRESPONSIVE, Op.CONNECT_BOOT).boot
    # traffic never boots a sandbox
    assert transition(Phase.PAUSED, Op.AUTO_RESUME).next is Phase.RUNNING
    for phase in (Phase.PAUSED_FILESYSTEM, Phase.PAUSED_UNRESPONSIVE):
        with pytest.raises(Conflict, match="must be resumed explicitly"):
            check(phase, Op.AUTO_RESUME, "sbx-1")
    with pytest.raises(Conflict, match=r"cannot be resumed \(state lost: found dead\)"):
        check(Phase.LOST, Op.RESUME, "sbx-1", note="found dead")


def test_what_a_paused_sandbox_refuses_and_allows() -> None:
    for phase in PAUSED_PHASES:
        for op, match in ((Op.UPDATE_NETWORK, "is paused: resume it"), (Op.FORK, "only a running sandbox"),
                          (Op.SNAPSHOT, r"not running \(state: paused\)")):
            with pytest.raises(Conflict, match=match):
                check(phase, op, "sbx-1")
        for op in (Op.ENDPOINT, Op.USAGE, Op.CONSOLE):       # the proxy's "not found"
            with pytest.raises(NotFound, match="is not running"):
                check(phase, op, "sbx-1")
        for op in (Op.KILL, Op.SET_TIMEOUT, Op.METRICS, Op.RELEASE, Op.GET):
            assert not transition(phase, op).refused, (phase, op)
        assert transition(phase, Op.KILL).next is Phase.GONE
        assert transition(phase, Op.RELEASE).next is Phase.GONE


def test_only_a_pause_with_memory_starts_a_batch() -> None:
    """``POST /snapshots/{id}/fork`` with a sandbox's id: its last pause, if it kept the
    processes (and their envd answered); the sandbox stays where it is."""
    assert transition(Phase.PAUSED, Op.FORK_PAUSE).next is Phase.PAUSED
    assert transition(Phase.GONE, Op.FORK_PAUSE).next is Phase.GONE
    for phase, cls, match in ((Phase.RUNNING, Conflict, "is running: only a paused sandbox"),
                              (Phase.PAUSED_FILESYSTEM, Conflict, "paused without its memory"),
                              (Phase.PAUSED_UNRESPONSIVE, UnresponsiveSnapshot, "was not responding"),
                              (Phase.LOST, Conflict, r"has no pause .* \(state lost: found dead\)")):
        with pytest.raises(cls, match=match):
            check(phase, Op.FORK_PAUSE, "sbx-1", note="found dead")
    assert issubclass(UnresponsiveSnapshot, Conflict)


def test_adopt_and_release_refusals_are_the_classes_the_fleet_acts_on() -> None:
    """The gateway decides by the code the node's API derives from the error class
    (aenv_wire/cluster.py): an adopt of a sandbox held here is AlreadyHeld, a release of
    one not paused here NotPaused (a plain Conflict would carry no code)."""
    for phase in (Phase.RUNNING, Phase.PAUSED, Phase.LOST):
        with pytest.raises(AlreadyHeld, match=f"already holds sandbox sbx-1 \\({coarse(phase)}\\)"):
            check(phase, Op.ADOPT, "sbx-1")
    with pytest.raises(NotPaused, match="is running: pause it"):
        check(Phase.RUNNING, Op.RELEASE, "sbx-1")
    with pytest.raises(NotPaused, match="is lost: only a paused sandbox"):
        check(Phase.LOST, Op.RELEASE, "sbx-1")