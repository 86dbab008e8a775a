"""How a fork's starting children share the CPU (aenv_vm/machine/cpushare.py): the share
arithmetic (hypothesis) and a group's weights written to cgroup weight files (files in a
temporary dir standing in for cgroupfs; the real cgroups are checked with QEMU in
tests/aenv_vm/sandboxes/test_confinement.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given, strategies as st

from aenv_vm.confine.cgroups import VmCgroup, cpu_weight
from aenv_vm.machine.cpushare import STARTING_WEIGHT, StartingGroup, member_share


@given(st.integers(0, 200), st.integers(0, 200), st.floats(0.01, 1.0))
def test_a_groups_weight_is_its_running_members_and_the_starting_weight(running: int, starting: int,
                                                                       w: float) -> None:
    share = member_share(running, starting, w)
    assert 0 < share <= 1.0
    if starting == 0:
        assert share == 1.0
    else:
        # together: one running sandbox per running member (the parent, the children that
        # answered), ``w`` for all the starting ones
        assert share * (running + starting) == pytest.approx(running + w)
        # each running member more brings every member closer to the full weight
        assert member_share(running + 1, starting, w) >= share


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        member_share(-1, 2)
    with pytest.raises(ValueError):
        StartingGroup(0.0)
    with pytest.raises(ValueError):
        cpu_weight(1024, 0.0)


@given(st.sampled_from([1024, 100]), st.floats(1e-6, 4.0))
def test_a_weight_file_gets_a_valid_value(full: int, share: float) -> None:
    weight = cpu_weight(full, share)
    assert 2 <= weight <= full
    if share >= 1.0:
        assert weight == full


@dataclass
class FakeVm:
    """What StartingGroup reads of a QemuProcess: its pid and its cgroup (a real VmCgroup
    over a weight file in a temporary dir)."""
    pid: int
    cgroup: VmCgroup | None


def vm(tmp: Path, pid: int) -> Any:
    f = tmp / f"cpu.shares.{pid}"
    f.write_text("1024")
    return FakeVm(pid, VmCgroup(f"vm-{pid}", (), f, 1024))


def weight(v: Any) -> int:
    return int(cast(VmCgroup, v.cgroup).cpu_weight_file.read_text())  # type: ignore[union-attr]


def test_starting_children_weigh_a_quarter_together_and_answered_ones_their_full_weight(tmp_path: Path) -> None:
    group = StartingGroup()
    a, b, c = (vm(tmp_path, pid) for pid in (11, 12, 13))
    group.started(a)
    assert weight(a) == round(1024 * STARTING_WEIGHT)           # alone: the whole starting weight
    group.started(b)
    assert weight(a) == weight(b) == round(1024 * STARTING_WEIGHT / 2)
    group.answered(a)                   # a runs: the group weighs 1.25, split between a and b
    assert weight(a) == weight(b) == round(1024 * (1 + STARTING_WEIGHT) / 2)
    group.answered(a)                   # twice: no change
    assert group.counts == (1, 1)
    group.started(c)
    assert weight(c) == round(1024 * (1 + STARTING_WEIGHT) / 3)
    group.left(b)                       # failed: out of the group
    assert group.counts == (1, 1)
    assert weight(a) == weight(c) == round(1024 * (1 + STARTING_WEIGHT) / 2)
    group.answered(c)                   # none starting: each has its full weight
    assert weight(a) == weight(c) == 1024
    group.close()
    assert weight(a) == weight(c) == 1024
    late = vm(tmp_path, 14)
    group.started(late)                 # after the fork: nothing held back
    assert weight(late) == 1024 and group.counts == (0, 0)


def test_the_parent_shares_its_weight_with_its_starting_children(tmp_path: Path) -> None:
    group = StartingGroup()
    parent, a, b = (vm(tmp_path, pid) for pid in (40, 41, 42))
    group.running(parent)               # alone: a running sandbox's weight
    assert weight(parent) == 1024 and group.counts == (1, 0)
    group.started(a)
    group.started(b)                    # the family weighs 1.25: the parent no more than its children
    assert weight(parent) == weight(a) == weight(b) == round(1024 * (1 + STARTING_WEIGHT) / 3)
    group.answered(a)
    assert weight(parent) == weight(a) == weight(b) == round(1024 * (2 + STARTING_WEIGHT) / 3)
    group.left(b)
    assert weight(parent) == weight(a) == 1024
    group.started(b)
    group.close()                       # the fork is over: the parent has its full weight again
    assert weight(parent) == weight(a) == weight(b) == 1024


def test_close_gives_every_member_left_its_full_weight(tmp_path: Path) -> None:
    group = StartingGroup()
    members = [vm(tmp_path, pid) for pid in range(20, 36)]
    for v in members:
        group.started(v)
    assert {weight(v) for v in members} == {round(1024 * STARTING_WEIGHT / 16)}
    group.close()                       # e.g. the fork was cancelled: its children go anyway
    assert {weight(v) for v in members} == {1024}


def test_a_machine_without_a_cgroup_or_whose_group_is_gone_is_no_error(tmp_path: Path) -> None:
    group = StartingGroup()
    bare = FakeVm(1, None)
    group.started(bare)                 # an unconfined QEMU: nothing to weigh
    assert group.counts == (0, 0)
    gone = vm(tmp_path, 2)
    cast(VmCgroup, gone.cgroup).cpu_weight_file.unlink()        # type: ignore[union-attr]
    group.started(gone)
    group.answered(gone)
    group.close()
