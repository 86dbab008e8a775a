"""Fencing without VMs (issue 29): the fence keeper freezes and thaws a node's
``qemu-system*`` children for real (processes of that name made here), and the agent's
``Fence`` pauses the running sandboxes of a node that cannot renew its lease, refuses
to start any until it renews, and reclaims each after the lapse. The partition and
stall tests with QEMU and a fleet are in test_fencing.py."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aenv_fleet.config import ClusterConfig
from aenv_fleet.fence import KEEPER_SCRIPT, Fence
from aenv_vm.errors import NodeFenced
from aenv_vm.fake_service import FakeRepository, FakeSandboxService
from aenv_vm.service import CreateRequest, SandboxState


def state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def wait_for(what: str, pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_keeper_freezes_the_nodes_qemus_past_its_deadline_and_thaws_them_when_moved(tmp_path: Path) -> None:
    fake_qemu = tmp_path / "qemu-system-x86_64"
    fake_qemu.symlink_to(shutil.which("sleep") or "/bin/sleep")
    other = tmp_path / "not-qemu"
    other.symlink_to(shutil.which("sleep") or "/bin/sleep")
    qemus = [subprocess.Popen([str(fake_qemu), "300"]) for _ in range(2)]
    bystander = subprocess.Popen([str(other), "300"])
    keeper = subprocess.Popen([sys.executable, str(KEEPER_SCRIPT), str(os.getpid()), repr(time.monotonic() + 1.0)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert keeper.stdin is not None and keeper.stdout is not None
    try:
        assert all(state(q.pid) == "S" for q in qemus)
        assert keeper.stdout.readline().split() == ["frozen", *sorted(str(q.pid) for q in qemus)]
        wait_for("SIGSTOP", lambda: all(state(q.pid) == "T" for q in qemus))
        assert state(bystander.pid) == "S"          # only qemu-system* children of the node
        late = subprocess.Popen([str(fake_qemu), "300"])   # one started while frozen is frozen too
        try:
            assert keeper.stdout.readline().split() == ["frozen", str(late.pid)]
            keeper.stdin.write(f"until {time.monotonic() + 60!r}\n")
            keeper.stdin.flush()
            assert keeper.stdout.readline().split()[0] == "thawed"
            wait_for("SIGCONT", lambda: all(state(p.pid) == "S" for p in (*qemus, late)))
        finally:
            late.kill()
            late.wait()
        keeper.stdin.close()            # the node went: the keeper ends
        assert keeper.wait(timeout=5) == 0
    finally:
        for p in (*qemus, bystander, keeper):
            p.kill()
            p.wait()


def test_a_node_that_cannot_renew_pauses_its_sandboxes_refuses_starts_and_reclaims_after() -> None:
    cfg = ClusterConfig(lease_seconds=1.0, heartbeat_seconds=0.25)

    async def main() -> None:
        repo = FakeRepository()
        node = FakeSandboxService(node_id="a", repository=repo)
        fence = Fence(cfg, lambda: node, keeper=False)
        a = await node.create(CreateRequest(template="base"))
        b = await node.create(CreateRequest(template="base"))
        fence.start()
        try:
            await fence.renewed(time.monotonic())
            await asyncio.sleep(0.3)
            fence.check_serving()              # renewed 0.3 s ago: serving
            await asyncio.sleep(cfg.fence_after + 0.5)      # no renewal: fenced
            with pytest.raises(NodeFenced):
                fence.check_serving()
            states = {i.sandbox_id: i.state for i in await node.list_sandboxes()}
            assert states == {a.sandbox_id: SandboxState.PAUSED, b.sandbox_id: SandboxState.PAUSED}
            await fence.renewed(time.monotonic())      # renewed after the lapse: serving again
            await fence.recovered()
            fence.check_serving()
        finally:
            await fence.close()
    asyncio.run(main())


def test_after_a_stall_a_sandbox_another_node_took_over_is_dropped_and_the_rest_run_on() -> None:
    """A stall (the fence's loop did not run): the next renewal, begun more than a lease
    after the last, reclaims each running sandbox before anything runs on."""
    cfg = ClusterConfig(lease_seconds=1.0, heartbeat_seconds=0.25)
    now = [1000.0]

    async def main() -> None:
        repo = FakeRepository()
        node = FakeSandboxService(node_id="a", repository=repo)
        fence = Fence(cfg, lambda: node, keeper=False, clock=lambda: now[0])
        a = await node.create(CreateRequest(template="base"))
        b = await node.create(CreateRequest(template="base"))
        await fence.renewed(now[0])
        repo.paused[b.sandbox_id] = ("b", None)     # type: ignore[assignment]  # node b adopted a pause of it
        now[0] += 30            # the stall: no fence ran, and the lease has run out
        await fence.renewed(now[0])
        await fence.recovered()
        left = {i.sandbox_id: i.state for i in await node.list_sandboxes()}
        assert left == {a.sandbox_id: SandboxState.RUNNING}
        fence.check_serving()
        await fence.close()
    asyncio.run(main())
