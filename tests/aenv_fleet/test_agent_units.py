"""The node agent without Redis or VMs (aenv_fleet/agent.py): ``ObservedService`` spells
out every ``SandboxService`` method, passes each call on and tells its listener of every
change; the agent releases a stale copy through the node's own service, and a release
Redis did not take is recorded at the next reconcile (not unbound)."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aenv_fleet.agent import NodeAgent, ObservedService
from aenv_fleet.config import ClusterConfig
from aenv_fleet.coord import Binding, CoordError
from aenv_vm.errors import NotFound
from aenv_vm.net.policy import NetworkPolicy
from aenv_vm.service import (ConsoleRead, CreateRequest, MetricSample, SandboxInfo, SandboxService, SandboxState,
                             SnapshotInfo, Usage)


def info(sid: str = "sbx-1", state: SandboxState = SandboxState.RUNNING) -> SandboxInfo:
    return SandboxInfo(sandbox_id=sid, template_id="tpl-1", state=state, started_at=1.7e9, end_at=1.7e9 + 300,
                       vcpus=1, memory_mib=256, disk_mib=1024, auto_pause=True, timeout=300.0, metadata={},
                       access_token=None, allow_internet_access=None, envd_version="0.5.7")


SNAP = SnapshotInfo("snap-1", ("n",), "sbx-1", 1.7e9)
SAMPLE = MetricSample(1.7e9, 1, 1.0, 1, 2, 0, 1, 2)
# what the node's service answers, by method
ANSWERS: dict[str, Any] = {
    "create": info(), "get": info(), "list_sandboxes": [info()], "kill": None, "pause": info(state=SandboxState.PAUSED),
    "resume": info(), "set_timeout": info(), "update_network": info(), "annotate": info(), "snapshot": SNAP, "list_snapshots": [SNAP],
    "delete_snapshot": None, "fork": [info("sbx-2"), NotFound("x")], "endpoint": ("10.0.0.1", 49983),
    "usage": Usage(1, 1.0, 1), "metrics": [SAMPLE], "latest_metrics": {"sbx-1": SAMPLE},
    "console": ConsoleRead("qemu-1", 0, b""), "adopt": info(state=SandboxState.PAUSED), "release": None,
    "reclaim": True}
# the arguments each method is called with here
CALLS: dict[str, tuple[Any, ...]] = {
    "create": (CreateRequest(template="base"),), "get": ("sbx-1",), "list_sandboxes": (), "kill": ("sbx-1",),
    "pause": ("sbx-1", False, True), "resume": ("sbx-1", 60.0, False), "set_timeout": ("sbx-1", 60.0),
    "update_network": ("sbx-1", NetworkPolicy()), "annotate": ("sbx-1", {"k": "v"}), "snapshot": ("sbx-1", "n", "team-a"), "list_snapshots": (),
    "delete_snapshot": ("snap-1",), "fork": ("sbx-1", 2, 60.0, None), "endpoint": ("sbx-1", 8080),
    "usage": ("sbx-1",), "metrics": ("sbx-1", 1.0, 2.0), "latest_metrics": (["sbx-1"],),
    "console": ("sbx-1", "qemu-1", 0, 100), "adopt": ("sbx-1", True), "release": ("sbx-1",),
    "reclaim": ("sbx-1",)}
# what the listener hears of each (reads: nothing)
TOLD: dict[str, list[tuple[Any, ...]]] = {
    "create": [("bound", "sbx-1", "base", False)], "kill": [("gone", "sbx-1")],
    "pause": [("bound", "sbx-1", None, True)], "resume": [("bound", "sbx-1", None, False)],
    "set_timeout": [("bound", "sbx-1", None, False)], "update_network": [("bound", "sbx-1", None, False)],
    "annotate": [("bound", "sbx-1", None, False)],
    "snapshot": [("bound", "sbx-1", None, False)],
    "fork": [("bound", "sbx-2", None, False), ("bound", "sbx-1", None, False)],
    "adopt": [("bound", "sbx-1", None, False)], "release": [("released", "sbx-1")]}


def protocol_methods() -> list[str]:
    return sorted(n for n, v in vars(SandboxService).items() if inspect.isfunction(v) and not n.startswith("_"))


class NodeService:
    """The node's own service as a test double: records calls, answers ANSWERS."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.expiry: list[Any] = []

    def on_expiry(self, listener: Any) -> None:
        self.expiry.append(listener)

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any) -> Any:
            self.calls.append((name, args))
            return ANSWERS[name]
        return call


class Listener:
    def __init__(self) -> None:
        self.heard: list[tuple[Any, ...]] = []

    async def bound(self, info: SandboxInfo, requested_template: str | None = None, paused_now: bool = False) -> None:
        self.heard.append(("bound", info.sandbox_id, requested_template, paused_now))

    async def released(self, sandbox_id: str) -> None:
        self.heard.append(("released", sandbox_id))

    async def gone(self, sandbox_id: str) -> None:
        self.heard.append(("gone", sandbox_id))

    def check_serving(self) -> None:
        """Serving: nothing to hear (a fenced node: test_fence_units.py)."""


def test_every_protocol_method_is_spelled_out() -> None:
    methods = protocol_methods()
    assert len(methods) == 23 and set(CALLS) | {"on_expiry", "pause_snapshot"} == set(methods)
    assert "__getattr__" not in vars(ObservedService)
    for name in methods:
        mine, theirs = vars(ObservedService).get(name), vars(SandboxService)[name]
        assert mine is not None, f"ObservedService does not define {name}"
        assert inspect.signature(mine) == inspect.signature(theirs), name
        assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(theirs), name


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_call_is_passed_on_and_every_change_told(name: str) -> None:
    async def main() -> None:
        node, listener = NodeService(), Listener()
        observed = ObservedService(node, listener)     # type: ignore[arg-type]
        got = await getattr(observed, name)(*CALLS[name])
        assert got == ANSWERS[name]
        assert node.calls[0] == (name, CALLS[name])
        assert listener.heard == TOLD.get(name, [])
    asyncio.run(main())


def test_a_pause_snapshot_is_passed_on_and_tells_nothing() -> None:
    """``pause_snapshot`` changes no sandbox (the batch's sandboxes are creates, told as such)."""
    held: list[str] = []

    class Node:
        def on_expiry(self, listener: Any) -> None:
            pass

        @contextlib.asynccontextmanager
        async def pause_snapshot(self, sandbox_id: str) -> AsyncIterator[SnapshotInfo]:
            held.append(sandbox_id)
            yield SNAP
            held.append("released")

    async def main() -> None:
        listener = Listener()
        observed = ObservedService(Node(), listener)     # type: ignore[arg-type]  # only the method used
        async with observed.pause_snapshot("sbx-1") as snap:
            assert snap == SNAP and held == ["sbx-1"]
        assert held == ["sbx-1", "released"] and listener.heard == []
    asyncio.run(main())


def test_expiry_is_passed_on_and_told() -> None:
    async def main() -> None:
        node, listener = NodeService(), Listener()
        observed = ObservedService(node, listener)     # type: ignore[arg-type]
        api_heard: list[tuple[str, str]] = []
        observed.on_expiry(lambda sid, action: api_heard.append((sid, action)))
        node.expiry[0]("sbx-1", "paused")
        node.expiry[0]("sbx-3", "killed")
        await asyncio.sleep(0.05)
        assert api_heard == [("sbx-1", "paused"), ("sbx-3", "killed")]
        assert sorted(listener.heard) == [("bound", "sbx-1", None, True), ("gone", "sbx-3")]
    asyncio.run(main())


class Redis:
    """The Coordinator calls the agent makes, in memory; ``down`` makes them fail."""

    def __init__(self) -> None:
        self.bound: dict[str, Binding] = {}
        self.released_set: set[str] = set()
        self.down = False
        self.writes: list[tuple[str, str]] = []

    def _check(self) -> None:
        if self.down:
            raise CoordError("redis is down")

    async def bind(self, sid: str, node: str, state: str, info: dict[str, Any], paused_at: float | None = None,
                   note: str = "") -> None:
        self._check()
        self.writes.append(("bind", sid))
        self.bound[sid] = Binding(sid, node, state, info, note, paused_at)
        self.released_set.discard(sid)

    async def unbind(self, sid: str, node: str = "") -> bool:
        self._check()
        b = self.bound.get(sid)
        if b is None or (node and b.node_id != node):
            return False
        self.writes.append(("unbind", sid))
        del self.bound[sid]
        return True

    async def release(self, sid: str, node: str) -> bool:
        self._check()
        b = self.bound.get(sid)
        if b is None or b.node_id != node:
            return False
        self.writes.append(("release", sid))
        self.bound[sid] = Binding(sid, "", "paused", b.info)
        self.released_set.add(sid)
        return True

    async def add_templates(self, node: str, templates: list[str]) -> None:
        self._check()

    async def bindings(self, sids: list[str]) -> list[Binding]:
        self._check()
        return [self.bound[s] for s in sids if s in self.bound]

    async def node_sandbox_ids(self, node: str) -> list[str]:
        self._check()
        return sorted(s for s, b in self.bound.items() if b.node_id == node)

    async def released_ids(self) -> list[str]:
        self._check()
        return sorted(self.released_set)


class Held:
    """A node's own service holding ``sandboxes``; release forgets one."""

    def __init__(self, *sandboxes: SandboxInfo) -> None:
        self.sandboxes = {i.sandbox_id: i for i in sandboxes}
        self.releases: list[str] = []

    def on_expiry(self, listener: Any) -> None:
        pass

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return list(self.sandboxes.values())

    async def release(self, sid: str) -> None:
        if sid not in self.sandboxes:
            raise NotFound(sid)
        self.releases.append(sid)
        del self.sandboxes[sid]


def agent(redis: Redis, node: Held) -> tuple[NodeAgent, ObservedService]:
    cfg = ClusterConfig(redis_url="redis://unused", node_id="n1", advertise_url="http://n1:8000")
    a = NodeAgent(cfg, "key", 4, 256, Path("/"), coord=redis)     # type: ignore[arg-type]
    return a, a.observe(node)     # type: ignore[arg-type]


def test_a_release_redis_missed_is_recorded_at_the_reconcile_not_unbound() -> None:
    async def main() -> None:
        redis, node = Redis(), Held(info(state=SandboxState.PAUSED))
        a, observed = agent(redis, node)
        await a.reconcile()
        assert redis.bound["sbx-1"].node_id == "n1"
        redis.down = True
        await observed.release("sbx-1")            # the node released it; Redis did not hear
        redis.down = False
        await a.reconcile()
        assert redis.bound["sbx-1"].node_id == "" and "sbx-1" in redis.released_set   # released, kept
        assert ("unbind", "sbx-1") not in redis.writes
    asyncio.run(main())


def test_a_stale_copy_is_released_through_the_service_and_redis_left_to_its_holder() -> None:
    async def main() -> None:
        redis, node = Redis(), Held(info("sbx-moved", SandboxState.PAUSED), info("sbx-mine"))
        redis.bound["sbx-moved"] = Binding("sbx-moved", "n2", "paused", {})     # the fleet moved it to n2
        a, _ = agent(redis, node)
        await a.reconcile()
        assert node.releases == ["sbx-moved"]
        assert redis.bound["sbx-moved"].node_id == "n2"          # n2's agent's binding, untouched
        assert redis.bound["sbx-mine"].node_id == "n1"
        assert redis.writes == [("bind", "sbx-mine")]
    asyncio.run(main())


def test_a_changed_restore_load_brings_the_next_heartbeat_forward() -> None:
    """Placement weighs the restore load a heartbeat reports: when it changes (a restore
    started or ended) the agent beats within ``LOAD_POLL``, not at the next interval."""
    from aenv_fleet.agent import LOAD_POLL

    load = [2, 0]
    cfg = ClusterConfig(redis_url="redis://127.0.0.1:1/0", node_id="n1", advertise_url="http://127.0.0.1:1",
                        heartbeat_seconds=5.0, lease_seconds=15.0)
    agent = NodeAgent(cfg, "key", 4, 256, Path("/"), coord=Redis(),    # type: ignore[arg-type]  # the fake
                      restore_load=lambda: (load[0], load[1]))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        waiting = asyncio.ensure_future(agent._next_beat())
        await asyncio.sleep(4 * LOAD_POLL)
        assert not waiting.done()          # the load is what the last beat told: wait on
        load[1] = 1                        # a restore began
        await asyncio.wait_for(waiting, 2 * LOAD_POLL + 0.5)
        assert loop.time() - t0 < 5.0 - 1.0
    asyncio.run(main())


class Beats(Redis):
    """Redis that also takes heartbeats, and a reconcile that says when it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.beats: list[str] = []

    async def heartbeat(self, node: str, cap: Any, lease_seconds: float) -> int:
        self._check()
        self.beats.append(node)
        self.writes.append(("heartbeat", node))
        return 1


def test_a_heartbeat_is_not_queued_behind_the_busy_default_executor_nor_a_reconcile() -> None:
    """A node whose default executor is taken by long work (commits hashing and fsyncing)
    still renews its lease: the host's facts are read on the agent's own thread. And the
    lease is renewed before a reconcile's writes, not after them."""
    redis, node = Beats(), Held(info())
    a, _ = agent(redis, node)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        release = __import__("threading").Event()
        busy = [loop.run_in_executor(None, release.wait) for _ in range(64)]   # every default worker
        try:
            await asyncio.wait_for(a.tick(), 10)        # before the fix: waited for a default worker
            assert redis.beats == ["n1"]
            assert redis.writes.index(("heartbeat", "n1")) < redis.writes.index(("bind", "sbx-1"))
            a.config = ClusterConfig(redis_url="redis://unused", node_id="n1", advertise_url="http://n1:8000",
                                     heartbeat_seconds=0.2, lease_seconds=1.0)
            slow = __import__("threading").Event()
            a._facts_thread.submit(slow.wait)           # the facts' own thread stuck (a disk answering late)
            await asyncio.wait_for(a.tick(), 10)       # the last facts are reported; the beat goes out
            assert redis.beats == ["n1", "n1"]
            slow.set()
        finally:
            release.set()
            await asyncio.gather(*busy)
    asyncio.run(main())
