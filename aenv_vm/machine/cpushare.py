"""How QEMUs that start together share the CPU with the sandboxes already running.

Under TCG a restored QEMU translates its guest's code again before its envd answers:
~0.3-0.5 s of one CPU per restore here. A fork's children restore two at a time (the
admission gate's slots, admission.py), so at the weight of a running sandbox each, two
starting children kept both CPUs of this 2-CPU host busy and a running neighbour's
commands took 2.1-3.3x their idle time while a fork of 16 started; sharing as below,
1.0-1.9x (benchmarks/hostile_bench.py, docs/benchmarks.md).

So a fork is a ``StartingGroup``: its parent and its children. The children still
starting weigh together ``STARTING_WEIGHT`` of one running sandbox; the parent and each
child that has answered weigh one, as they do after the fork. The group's weight
(running members + ``STARTING_WEIGHT``) is split evenly among its members
(``member_share``), so the fork is paid from its own family's share:

* a started child (or the parent) running a busy loop never starves a sibling still
  starting: held back alone (a starting child at 1/8 of a running one's weight, the
  started ones at full), a fork of 16 of a busy parent took 30-35 s instead of ~8;
* with the parent outside the group, a busy parent starved its own starting children
  (16 children at once, all answering after 50 s instead of 5.6).

Once the fork is over (``close``) every member has the full weight again. Weights only
matter under contention: a fork on an otherwise idle node takes as long as before.

A weight is a QEMU's cgroup CPU weight (``VmCgroup.set_cpu_share``): each confined QEMU
is alone in its cgroup, so between QEMUs the groups' weights decide. A node without
per-QEMU cgroups (unconfined, or a host that gives it none) holds nothing back here: a
nice value, the only other lever, could not be raised again without root.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..qemu.launcher import QemuProcess

# the weight of a fork's children still starting, together, in running sandboxes
STARTING_WEIGHT = 0.25


def member_share(running: int, starting: int, starting_weight: float = STARTING_WEIGHT) -> float:
    """Each member's share of a running sandbox's CPU weight while ``running`` members of a
    group run (the parent, the children that answered) and ``starting`` are still
    starting (1.0 once none is)."""
    if running < 0 or starting < 0:
        raise ValueError(f"member counts cannot be negative: {running}, {starting}")
    if starting == 0:
        return 1.0
    return (running + starting_weight) / (running + starting)


@dataclass
class _Member:
    vm: QemuProcess
    running: bool = False


class StartingGroup:
    """The QEMUs of one fork, its parent's and its children's, from the children's start
    until the fork is over. All on the node's event loop; each call rewrites the members'
    weights (a write to cgroupfs each, no lock held)."""

    def __init__(self, starting_weight: float = STARTING_WEIGHT) -> None:
        if not 0 < starting_weight <= 1:
            raise ValueError(f"starting weight must be in (0, 1], not {starting_weight}")
        self.starting_weight = starting_weight
        self._members: dict[int, _Member] = {}      # QEMU pid → member
        self._closed = False

    def running(self, vm: QemuProcess) -> None:
        """``vm`` (the parent's QEMU) runs: a member with a running sandbox's weight."""
        self._join(vm, running=True)

    def started(self, vm: QemuProcess) -> None:
        """``vm`` (a child's QEMU) started and is not yet answering."""
        self._join(vm, running=False)

    def _join(self, vm: QemuProcess, running: bool) -> None:
        if self._closed or vm.cgroup is None:
            return
        self._members[vm.pid] = _Member(vm, running)
        self._reweigh()

    def answered(self, vm: QemuProcess) -> None:
        """``vm``'s envd answered: it counts as a running sandbox from now on."""
        member = self._members.get(vm.pid)
        if member is not None and not member.running:
            member.running = True
            self._reweigh()

    def left(self, vm: QemuProcess) -> None:
        """``vm`` failed to start (it is being torn down)."""
        if self._members.pop(vm.pid, None) is not None:
            self._reweigh()

    def close(self) -> None:
        """The fork is over: every member left has the full weight; later calls do nothing."""
        self._closed = True
        for member in self._members.values():
            _set_share(member.vm, 1.0)
        self._members.clear()

    @property
    def counts(self) -> tuple[int, int]:
        """(running, starting) members now: the parent and the children that answered,
        the children still starting."""
        running = sum(m.running for m in self._members.values())
        return running, len(self._members) - running

    def _reweigh(self) -> None:
        share = member_share(*self.counts, self.starting_weight)
        for member in self._members.values():
            _set_share(member.vm, share)


def _set_share(vm: QemuProcess, share: float) -> None:
    if vm.cgroup is not None:
        vm.cgroup.set_cpu_share(share)
