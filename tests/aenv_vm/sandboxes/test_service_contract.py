"""The ``SandboxService`` contract (aenv_vm/service.py), the same cases run against its
three implementations: a node's ``NodeSandboxService`` (real QEMU, one node for the
module), ``aenv_fleet.agent.ObservedService`` wrapping a fake (its listener must hear
of every change), and the in-memory ``FakeSandboxService`` that the API's semantics
are tested on (tests/aenv_api/server/test_lifecycle_inprocess.py). What they must
agree on: ids, the records they answer, the state table's moves and refusals (error
class and message, aenv_vm/states.py), TTL expiry, snapshots, forks, capacity.

It lives beside the other sandbox tests to share the session's base template (the
``env`` fixture); the node is built once for the module."""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine, Iterator, TypeVar

import pytest

from aenv_vm.errors import (BadRequest, CapacityError, Conflict, GuestUnresponsive, NotFound, UnresponsiveSnapshot,
                            VmError)
from aenv_vm.fake_service import FakeClock, FakeSandboxService
from aenv_vm.net.policy import NetworkPolicy, parse_policy
from aenv_vm.service import (ConsoleRead, CreateRequest, MetricSample, SandboxInfo, SandboxService, SandboxState,
                             SnapshotInfo, Usage)

from .conftest import Env

T = TypeVar("T")
MAX_SANDBOXES = 3
ID = re.compile(r"^sbx-[0-9a-f]{16}$")


def mint(sid: str) -> str:
    return f"token-of-{sid}"


class Heard:
    """A ``SandboxListener`` (aenv_fleet/agent.py) that records what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []     # (kind, sandbox id, state or None)

    async def bound(self, info: SandboxInfo, requested_template: str | None = None,
                    paused_now: bool = False) -> None:
        self.events.append(("bound", info.sandbox_id, (info.state, paused_now, info)))

    async def released(self, sandbox_id: str) -> None:
        self.events.append(("released", sandbox_id, None))

    async def gone(self, sandbox_id: str) -> None:
        self.events.append(("gone", sandbox_id, None))

    def check_serving(self) -> None:
        """Serving (a fenced node refuses starts: tests/aenv_fleet/test_fence_units.py)."""

    def of(self, sid: str) -> list[tuple[str, Any]]:
        return [(kind, what) for kind, s, what in self.events if s == sid]


@dataclass
class Impl:
    name: str
    service: SandboxService
    run: Callable[[Coroutine[Any, Any, T]], T]
    expire: Callable[[str], Awaitable[None]]          # the TTL of a sandbox whose deadline passed acts
    stop_guest_agent: Callable[[str], Awaitable[None]]
    expired: list[tuple[str, str]] = field(default_factory=list)   # what the expiry listener heard
    heard: Heard | None = None

    async def kill_all(self) -> None:
        for info in await self.service.list_sandboxes():
            try:
                await self.service.kill(info.sandbox_id)
            except NotFound:
                pass


# -- the three implementations ---------------------------------------------------------------

def _fake_impl(name: str) -> Iterator[Impl]:
    loop = asyncio.new_event_loop()
    clock = FakeClock()
    fake = FakeSandboxService(max_sandboxes=MAX_SANDBOXES, clock=clock)
    service: SandboxService = fake
    heard = None
    if name == "observed":
        from aenv_fleet.agent import ObservedService

        heard = Heard()
        service = ObservedService(fake, heard)

    async def expire(sid: str) -> None:
        clock.advance(1.0)
        await fake.expire_due()
        await asyncio.sleep(0)      # the observed wrapper tells its listener in a task
        await asyncio.sleep(0)

    async def stop_guest_agent(sid: str) -> None:
        fake.set_guest_responsive(sid, False)

    impl = Impl(name, service, loop.run_until_complete, expire, stop_guest_agent, heard=heard)
    service.on_expiry(lambda sid, action: impl.expired.append((sid, action)))
    try:
        yield impl
    finally:
        loop.run_until_complete(impl.kill_all())
        loop.close()


def _node_impl(env: Env, tmp: Path) -> Iterator[Impl]:
    """A node on the session's store and base template (conftest.py's ``env``)."""
    from aenv_vm.sandboxes.manager import SandboxManager
    from aenv_vm.sandboxes.node_service import NodeSandboxService

    loop = asyncio.new_event_loop()
    manager = SandboxManager(env.store, env.guest, tmp / "node", max_sandboxes=MAX_SANDBOXES)
    try:
        loop.run_until_complete(manager.start())
        service = NodeSandboxService(manager)

        async def expire(sid: str) -> None:
            """The node's TTL watcher acts on its own: wait until it told the listeners."""
            deadline = time.monotonic() + 60
            while sid not in {s for s, _ in impl.expired}:
                assert time.monotonic() < deadline, "the TTL did not act"
                await asyncio.sleep(0.1)

        async def stop_guest_agent(sid: str) -> None:
            """SIGSTOP the guest's envd, then let the metrics sampler miss it twice (what a
            node records as "unresponsive at pause")."""
            sbx = manager.sandboxes[sid]
            envd = sbx.envd.with_token(sbx.guest_token)
            await envd.run("nohup sh -c 'sleep 1; kill -STOP $(pgrep -o -f -- \"-m envd --port\")' "
                           ">/dev/null 2>&1 &", user="root")
            await asyncio.sleep(2)
            while not manager.metrics.unresponsive(sid):
                await manager.metrics.sample(sbx)

        impl = Impl("node", service, loop.run_until_complete, expire, stop_guest_agent)
        service.on_expiry(lambda sid, action: impl.expired.append((sid, action)))
        yield impl
        loop.run_until_complete(impl.kill_all())
    finally:
        loop.run_until_complete(manager.close())
        loop.close()


@pytest.fixture(scope="module", params=["fake", "observed", pytest.param("node", marks=pytest.mark.qemu)])
def impl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Impl]:
    if request.param == "node":
        yield from _node_impl(request.getfixturevalue("env"), tmp_path_factory.mktemp("contract-node"))
    else:
        yield from _fake_impl(request.param)


@pytest.fixture
def svc(impl: Impl) -> Iterator[Impl]:
    """``impl`` for one test: it starts and ends with no sandboxes."""
    impl.expired.clear()
    yield impl
    impl.run(impl.kill_all())


async def _create(s: Impl, **kw: Any) -> SandboxInfo:
    return await s.service.create(CreateRequest(template=kw.pop("template", "base"), **kw))


async def _refused(aw: Awaitable[object], cls: type[VmError], match: str) -> VmError:
    with pytest.raises(cls, match=match) as e:
        await aw
    return e.value


# -- create / get / list / kill ------------------------------------------------------------------

def test_create_get_list_kill(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        t0 = time.time()
        a = await _create(svc, timeout=120, metadata={"k": "v"}, annotations={"mine": "1"}, access_token=mint,
                          env_vars={"A": "1"}, pause_memory=False)
        assert ID.match(a.sandbox_id) and a.template_id.startswith("tpl-")
        assert a.state == SandboxState.RUNNING and a.timeout == 120 and a.metadata == {"k": "v"}
        assert a.annotations == {"mine": "1"} and a.access_token == mint(a.sandbox_id)
        assert a.from_pool is False and a.pause_memory is False and not a.cold_boot and not a.envd_unresponsive
        assert a.vcpus >= 1 and a.memory_mib >= 64 and a.disk_mib > 0 and a.auto_pause
        if svc.name == "node":
            assert abs(a.started_at - t0) < 120
        assert abs(a.end_at - a.started_at - 120) < 5
        b = await _create(svc)
        assert b.access_token is None and b.timeout > 0 and b.sandbox_id != a.sandbox_id
        got = await s.get(a.sandbox_id)
        assert dataclasses.replace(got, from_pool=False) == a
        assert {i.sandbox_id for i in await s.list_sandboxes()} == {a.sandbox_id, b.sandbox_id}
        await s.kill(a.sandbox_id)
        await _refused(s.get(a.sandbox_id), NotFound, f"unknown sandbox '{a.sandbox_id}'")
        await _refused(s.kill(a.sandbox_id), NotFound, "unknown sandbox")
        assert [i.sandbox_id for i in await s.list_sandboxes()] == [b.sandbox_id]
        await _refused(_create(svc, template="no-such-template"), NotFound, "unknown template 'no-such-template'")
        await _refused(_create(svc, timeout=-1), BadRequest, "timeout must be >= 0")
        for call in (s.pause("sbx-nope"), s.resume("sbx-nope"), s.set_timeout("sbx-nope", 1),
                     s.update_network("sbx-nope", NetworkPolicy()), s.snapshot("sbx-nope"),
                     s.fork("sbx-nope", 1), s.endpoint("sbx-nope", 49983), s.metrics("sbx-nope"),
                     s.console("sbx-nope", None, 0, 10), s.usage("sbx-nope"), s.release("sbx-nope")):
            await _refused(call, NotFound, "unknown sandbox 'sbx-nope'")
    svc.run(case())


def test_what_a_running_sandbox_answers(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc)
        host, port = await s.endpoint(a.sandbox_id, 49983)
        assert isinstance(host, str) and isinstance(port, int) and 0 < port < 65536
        read = await s.console(a.sandbox_id, None, 0, 1 << 16)
        assert isinstance(read, ConsoleRead) and isinstance(read.source, str) and read.start >= 0
        again = await s.console(a.sandbox_id, read.source, read.start + len(read.data), 1 << 16)
        assert again.source == read.source and again.start == read.start + len(read.data)
        usage = await s.usage(a.sandbox_id)
        assert isinstance(usage, Usage) and usage.rss_bytes >= 0 and usage.cpu_seconds >= 0
        samples = await s.metrics(a.sandbox_id)      # at least the one taken at its start
        assert samples and all(isinstance(m, MetricSample) for m in samples)
        assert samples[0].cpu_count == a.vcpus and 0 < samples[0].mem_total
        assert await s.metrics(a.sandbox_id, start=samples[-1].timestamp + 3600) == []
        latest = await s.latest_metrics([a.sandbox_id, "sbx-nope"])
        assert set(latest) == {a.sandbox_id} and isinstance(latest[a.sandbox_id], MetricSample)
    svc.run(case())


# -- pause / resume, both modes, and the state table's refusals ----------------------------------

def test_pause_and_resume_with_memory(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600, metadata={"k": "v"})
        paused = await s.pause(a.sandbox_id)
        assert paused.state == SandboxState.PAUSED and not paused.cold_boot and not paused.envd_unresponsive
        assert paused.metadata == {"k": "v"} and (await s.get(a.sandbox_id)).state == SandboxState.PAUSED
        # E2B: a pause of a paused sandbox is a 409, a resume of a running one too
        await _refused(s.pause(a.sandbox_id), Conflict,
                       f"^Error pausing sandbox - sandbox '{a.sandbox_id}' is already paused$")
        await _refused(s.pause(a.sandbox_id, memory=False), Conflict, "already paused")
        for call in (s.endpoint(a.sandbox_id, 49983), s.console(a.sandbox_id, None, 0, 10), s.usage(a.sandbox_id)):
            await _refused(call, NotFound, f"^sandbox {a.sandbox_id} is not running$")
        await _refused(s.update_network(a.sandbox_id, NetworkPolicy()), Conflict, "is paused: resume it")
        await _refused(s.fork(a.sandbox_id, 1), Conflict, "only a running sandbox can be forked")
        await _refused(s.snapshot(a.sandbox_id), Conflict, r"is not running \(state: paused\)")
        assert isinstance(await s.metrics(a.sandbox_id), list)          # kept across the pause
        await _refused(s.resume(a.sandbox_id, timeout=-1), BadRequest, "timeout must be >= 0")
        back = await s.resume(a.sandbox_id, timeout=77)
        assert back.state == SandboxState.RUNNING and back.timeout == 77 and back.sandbox_id == a.sandbox_id
        assert abs(back.end_at - time.time() - 77) < 30 if svc.name == "node" else back.end_at > back.started_at
        await _refused(s.resume(a.sandbox_id), Conflict, f"^sandbox {a.sandbox_id} is already running$")
        await _refused(s.resume(a.sandbox_id, memory=False), Conflict, "already running")
    svc.run(case())


def test_filesystem_pause_resumes_by_boot(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600)
        paused = await s.pause(a.sandbox_id, memory=False)
        assert paused.state == SandboxState.PAUSED and paused.cold_boot and not paused.envd_unresponsive
        back = await s.resume(a.sandbox_id)          # a memory resume of it boots too
        assert back.state == SandboxState.RUNNING and not back.cold_boot
        assert not (await s.pause(a.sandbox_id)).cold_boot     # and it pauses with memory again
        # (a pause resumed by boot, memory=False: test_an_unresponsive_guest)
    svc.run(case())


def test_an_unresponsive_guest(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600)
        await svc.stop_guest_agent(a.sandbox_id)
        await _refused(s.pause(a.sandbox_id, require_healthy=True), GuestUnresponsive, "not responding")
        await _refused(s.pause(a.sandbox_id, memory=False), GuestUnresponsive, "not responding")
        assert (await s.get(a.sandbox_id)).state == SandboxState.RUNNING   # nothing was done
        marked = await s.pause(a.sandbox_id)
        assert marked.state == SandboxState.PAUSED and marked.envd_unresponsive and not marked.cold_boot
        e = await _refused(s.resume(a.sandbox_id), UnresponsiveSnapshot, "resumes only by cold boot")
        assert isinstance(e, Conflict)
        back = await s.resume(a.sandbox_id, memory=False)
        assert back.state == SandboxState.RUNNING and not back.envd_unresponsive
    svc.run(case())


def test_set_timeout(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600)
        t = await s.set_timeout(a.sandbox_id, 1234)
        assert t.timeout == 1234 and (await s.get(a.sandbox_id)).end_at == t.end_at
        assert t.end_at - a.end_at > 600
        await _refused(s.set_timeout(a.sandbox_id, -1), BadRequest, "timeout must be >= 0")
        await s.pause(a.sandbox_id)
        kept = await s.set_timeout(a.sandbox_id, 99)    # a paused sandbox keeps it for its next resume
        assert kept.state == SandboxState.PAUSED and kept.timeout == 99
        assert (await s.resume(a.sandbox_id)).timeout == 99
    svc.run(case())


def test_update_network(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc, network=parse_policy(allow_out=["example.com"], deny_out=["0.0.0.0/0"]))
        assert a.network.allow_out == ["example.com"] and a.allow_internet_access is None
        rules = parse_policy(allow_out=["198.51.100.7"], deny_out=["0.0.0.0/0"])
        updated = await s.update_network(a.sandbox_id, rules)
        assert updated.network == rules and updated.allow_internet_access is False
        assert (await s.get(a.sandbox_id)).network == rules
        open_ = await s.update_network(a.sandbox_id, NetworkPolicy())
        assert open_.network == NetworkPolicy() and open_.allow_internet_access is None
        await s.update_network(a.sandbox_id, rules)
        await s.pause(a.sandbox_id)
        assert (await s.get(a.sandbox_id)).network == rules        # kept across pause and resume
        assert (await s.resume(a.sandbox_id)).network == rules
        children = await s.fork(a.sandbox_id, 1)
        assert isinstance(children[0], SandboxInfo) and children[0].network == rules   # and inherited
        await s.update_network(children[0].sandbox_id, NetworkPolicy())
        assert (await s.get(a.sandbox_id)).network == rules
        b = await _create(svc, allow_internet_access=False)
        assert b.allow_internet_access is False and "0.0.0.0/0" in b.network.deny_out
    svc.run(case())


def test_annotate(svc: Impl) -> None:
    """The layer above's fields (the API's token generation): set on a running sandbox,
    the others kept, kept across pause and resume, refused while paused."""
    async def case() -> None:
        s = svc.service
        a = await _create(svc, annotations={"mine": "1"})
        got = await s.annotate(a.sandbox_id, {"gen": "2"})
        assert got.annotations == {"mine": "1", "gen": "2"}
        assert (await s.get(a.sandbox_id)).annotations == {"mine": "1", "gen": "2"}
        await s.pause(a.sandbox_id)
        await _refused(s.annotate(a.sandbox_id, {"gen": "3"}), Conflict, "is paused: connect")
        assert (await s.resume(a.sandbox_id)).annotations == {"mine": "1", "gen": "2"}
        await _refused(s.annotate("sbx-nope", {"gen": "1"}), NotFound, "unknown sandbox 'sbx-nope'")
    svc.run(case())


# -- snapshots and forks ------------------------------------------------------------------

def test_snapshot_and_create_from_it(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600)
        name = f"contract-{svc.name}-{int(time.time() * 1000) % 10**8}"
        snap = await s.snapshot(a.sandbox_id, name, team="team-contract")
        assert isinstance(snap, SnapshotInfo) and snap.snapshot_id.startswith("tpl-")
        assert snap.names == (name,) and snap.sandbox_id == a.sandbox_id and snap.team == "team-contract"
        listed = {x.snapshot_id: x for x in await s.list_snapshots()}
        assert listed[snap.snapshot_id].names == (name,) and listed[snap.snapshot_id].sandbox_id == a.sandbox_id
        assert listed[snap.snapshot_id].team == "team-contract"     # its record names its owner
        await _refused(s.snapshot(a.sandbox_id, name), Conflict, f"named '{name}' already exists")
        await _refused(s.snapshot(a.sandbox_id, "no/slashes here"), BadRequest, "snapshot name")
        assert (await s.get(a.sandbox_id)).state == SandboxState.RUNNING      # the parent runs on
        child = await _create(svc, template=name)
        assert child.template_id == snap.snapshot_id
        await _refused(s.delete_snapshot(snap.snapshot_id), Conflict, "in use by 1 sandbox")
        await s.kill(child.sandbox_id)
        await s.delete_snapshot(snap.snapshot_id)
        assert snap.snapshot_id not in {x.snapshot_id for x in await s.list_snapshots()}
        await _refused(s.delete_snapshot(snap.snapshot_id), NotFound, "unknown template")
        await _refused(s.delete_snapshot("base"), BadRequest, "is a template, not a snapshot")
    svc.run(case())


def test_fork(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=500, metadata={"k": "v"}, access_token=mint, annotations={"x": "y"})
        children = await s.fork(a.sandbox_id, 2, access_token=mint)
        assert len(children) == 2 and all(isinstance(c, SandboxInfo) for c in children), children
        kids = [c for c in children if isinstance(c, SandboxInfo)]
        assert len({k.sandbox_id for k in kids} | {a.sandbox_id}) == 3
        for k in kids:
            assert ID.match(k.sandbox_id) and k.state == SandboxState.RUNNING and k.timeout == 500
            assert k.metadata == {"k": "v", "forked_from": a.sandbox_id} and k.annotations == {"x": "y"}
            assert k.access_token == mint(k.sandbox_id)
            assert (await s.get(k.sandbox_id)).state == SandboxState.RUNNING
        assert (await s.get(a.sandbox_id)).state == SandboxState.RUNNING
        for bad in (0, 101):
            await _refused(s.fork(a.sandbox_id, bad), BadRequest, "fork count must be 1..100")
        await _refused(s.fork(a.sandbox_id, 1, timeout=-1), BadRequest, "timeout must be >= 0")
        await s.kill(kids[1].sandbox_id)
        unsecured = await s.fork(kids[0].sandbox_id, 1, timeout=42)
        assert isinstance(unsecured[0], SandboxInfo) and unsecured[0].timeout == 42
    svc.run(case())


async def _enter(cm: AbstractAsyncContextManager[SnapshotInfo]) -> None:
    async with cm:
        pass


def test_sandboxes_from_a_paused_sandboxs_pause(svc: Impl) -> None:
    """``pause_snapshot``: a paused sandbox's last pause as a hidden snapshot that sandboxes
    are created from; the paused sandbox stays as it is; the snapshot outlives it while a
    sandbox made from it lives, and is dropped with the last one (or, made for nothing,
    when the block ends)."""
    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600, metadata={"k": "v"}, access_token=mint)
        await _refused(_enter(s.pause_snapshot(a.sandbox_id)), Conflict, "is running: only a paused sandbox")
        await _refused(_enter(s.pause_snapshot("sbx-0000000000000000")), NotFound, "unknown sandbox")
        await s.pause(a.sandbox_id)
        async with s.pause_snapshot(a.sandbox_id) as snap:
            assert isinstance(snap, SnapshotInfo) and snap.snapshot_id.startswith("tpl-")
            assert snap.sandbox_id == a.sandbox_id and snap.names == ()
            kids = [await _create(svc, template=snap.snapshot_id, access_token=mint, metadata={"batch": "1"})
                    for _ in range(2)]
        assert snap.snapshot_id not in {x.snapshot_id for x in await s.list_snapshots()}     # hidden
        assert len({k.sandbox_id for k in kids} | {a.sandbox_id}) == 3
        for k in kids:
            assert ID.match(k.sandbox_id) and k.state == SandboxState.RUNNING and k.template_id == snap.snapshot_id
            assert k.access_token == mint(k.sandbox_id) and k.metadata == {"batch": "1"}
        source = await s.get(a.sandbox_id)
        assert source.state == SandboxState.PAUSED and source.metadata == {"k": "v"}    # untouched
        assert (await s.resume(a.sandbox_id)).state == SandboxState.RUNNING
        await s.pause(a.sandbox_id)
        # the source goes; its pause can no longer be asked for, the batch's snapshot stays
        await s.kill(a.sandbox_id)
        await _refused(_enter(s.pause_snapshot(a.sandbox_id)), NotFound, f"unknown sandbox '{a.sandbox_id}'")
        paused = await s.pause(kids[0].sandbox_id)
        assert paused.state == SandboxState.PAUSED
        assert (await s.resume(kids[0].sandbox_id)).state == SandboxState.RUNNING
        await s.kill(kids[1].sandbox_id)
        late = await _create(svc, template=snap.snapshot_id)      # still used by kids[0]: still there
        await s.kill(late.sandbox_id)
        await s.kill(kids[0].sandbox_id)
        await _refused(_create(svc, template=snap.snapshot_id), NotFound, "unknown template")   # dropped
        # a snapshot held for a batch that made nothing is dropped when the block ends
        b = await _create(svc, timeout=600)
        await s.pause(b.sandbox_id)
        async with s.pause_snapshot(b.sandbox_id) as unused:
            pass
        await _refused(_create(svc, template=unused.snapshot_id), NotFound, "unknown template")
        await s.resume(b.sandbox_id)
        await s.pause(b.sandbox_id, memory=False)
        await _refused(_enter(s.pause_snapshot(b.sandbox_id)), Conflict, "paused without its memory")
        # a paused sandbox this node does not hold: its pause is read from the shared repository
        c = await _create(svc, timeout=600)
        await s.pause(c.sandbox_id)
        await s.release(c.sandbox_id)
        async with s.pause_snapshot(c.sandbox_id) as moved:
            assert moved.sandbox_id == c.sandbox_id
            elsewhere = await _create(svc, template=moved.snapshot_id)
        assert elsewhere.template_id == moved.snapshot_id and elsewhere.state == SandboxState.RUNNING
        await s.kill(elsewhere.sandbox_id)
        assert (await s.adopt(c.sandbox_id)).state == SandboxState.PAUSED
    svc.run(case())


# a node's child fails only on a fault (tests/aenv_vm/sandboxes/test_faults.py): the fakes only
@pytest.mark.parametrize("impl", ["fake", "observed"], indirect=True)
def test_fork_results_carry_each_childs_error(svc: Impl) -> None:
    # the observed wrapper's inner service (the protocol does not have it)
    fake = svc.service if isinstance(svc.service, FakeSandboxService) else svc.service.inner  # type: ignore[attr-defined]

    async def case() -> None:
        a = await _create(svc)
        fake.fork_failures = [VmError("child 0 failed to restore"), None]
        results = await svc.service.fork(a.sandbox_id, 2)
        assert isinstance(results[0], VmError) and "child 0 failed" in str(results[0])
        assert isinstance(results[1], SandboxInfo)
    svc.run(case())


# -- expiry, capacity, moves ----------------------------------------------------------------

def test_expiry_pauses_or_kills_by_auto_pause(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        keep = await _create(svc, timeout=600, auto_pause=True)
        drop = await _create(svc, timeout=600, auto_pause=False)
        await s.set_timeout(keep.sandbox_id, 0)
        await svc.expire(keep.sandbox_id)
        assert (await s.get(keep.sandbox_id)).state == SandboxState.PAUSED
        assert (keep.sandbox_id, "paused") in svc.expired
        await s.set_timeout(drop.sandbox_id, 0)
        await svc.expire(drop.sandbox_id)
        await _refused(s.get(drop.sandbox_id), NotFound, "unknown sandbox")
        assert (drop.sandbox_id, "killed") in svc.expired
        # resumed without a timeout, one whose timeout was 0 gets the default, not an instant expiry
        back = await s.resume(keep.sandbox_id)
        assert back.timeout > 0 and back.state == SandboxState.RUNNING
    svc.run(case())


def test_capacity(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        held = [await _create(svc, timeout=600) for _ in range(MAX_SANDBOXES - 1)]
        # room for one child: it starts, the other fails alone, after it
        kids = await s.fork(held[0].sandbox_id, 2)
        assert isinstance(kids[0], SandboxInfo) and isinstance(kids[1], CapacityError)
        assert f"holds its maximum of {MAX_SANDBOXES} sandboxes" in str(kids[1])
        await s.kill(kids[0].sandbox_id)
        await s.pause(held[1].sandbox_id)          # a paused sandbox still counts
        third = await _create(svc)
        await _refused(_create(svc), CapacityError, f"holds its maximum of {MAX_SANDBOXES} sandboxes")
        # no room at all: the whole fork is refused
        await _refused(s.fork(held[0].sandbox_id, 2), CapacityError, f"holds its maximum of {MAX_SANDBOXES}")
        await s.kill(third.sandbox_id)
        await _create(svc)
    svc.run(case())


def test_release_and_adopt(svc: Impl) -> None:
    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600, metadata={"k": "v"})
        await _refused(s.release(a.sandbox_id), Conflict, "is running: pause it before releasing it")
        await _refused(s.adopt(a.sandbox_id), Conflict, f"already holds sandbox {a.sandbox_id} \\(running\\)")
        await s.pause(a.sandbox_id)
        await _refused(s.adopt(a.sandbox_id), Conflict, "already holds")
        await s.release(a.sandbox_id)
        await _refused(s.get(a.sandbox_id), NotFound, "unknown sandbox")
        back = await s.adopt(a.sandbox_id)
        assert back.state == SandboxState.PAUSED and back.metadata == {"k": "v"} and "adopted from" in back.note
        assert (await s.resume(a.sandbox_id)).state == SandboxState.RUNNING
        await _refused(s.adopt("sbx-0000000000000000"), NotFound, "the repository has no paused sandbox")
        # after a lapse of a fleet node's lease: nobody took it over, so it stays this node's
        assert await s.reclaim(a.sandbox_id) is True
        assert (await s.get(a.sandbox_id)).state == SandboxState.RUNNING
        await _refused(s.reclaim("sbx-0000000000000000"), NotFound, "unknown sandbox")
    svc.run(case())


# -- what the observed wrapper's listener hears ----------------------------------------------

@pytest.fixture(scope="module")
def observed() -> Iterator[Impl]:
    """The observed wrapper alone (the fake inside): only it has a listener to ask."""
    yield from _fake_impl("observed")


def test_the_listener_hears_every_change(observed: Impl) -> None:
    svc = observed
    assert svc.heard is not None
    heard = svc.heard

    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600)
        sid = a.sandbox_id
        assert heard.of(sid)[-1][0] == "bound"
        await s.pause(sid)
        assert heard.of(sid)[-1][1][:2] == (SandboxState.PAUSED, True)
        await s.resume(sid)
        assert heard.of(sid)[-1][1][0] == SandboxState.RUNNING
        await s.set_timeout(sid, 900)
        assert heard.of(sid)[-1][1][2].timeout == 900
        kids = await s.fork(sid, 1)
        assert isinstance(kids[0], SandboxInfo) and heard.of(kids[0].sandbox_id)[-1][0] == "bound"
        await s.kill(kids[0].sandbox_id)
        assert heard.of(kids[0].sandbox_id)[-1] == ("gone", None)
        await s.set_timeout(sid, 0)
        await svc.expire(sid)
        assert heard.of(sid)[-1][1][:2] == (SandboxState.PAUSED, True)
    svc.run(case())


def test_the_listener_hears_of_moves_and_network_updates(observed: Impl) -> None:
    svc = observed
    assert svc.heard is not None
    heard = svc.heard

    async def case() -> None:
        s = svc.service
        a = await _create(svc, timeout=600)
        sid = a.sandbox_id
        rules = parse_policy(allow_out=["198.51.100.7"], deny_out=["0.0.0.0/0"])
        await s.update_network(sid, rules)
        assert heard.of(sid)[-1][1][2].network == rules
        await s.pause(sid)
        await s.release(sid)
        assert heard.of(sid)[-1] == ("released", None)
        await s.adopt(sid)
        assert heard.of(sid)[-1][0] == "bound" and heard.of(sid)[-1][1][0] == SandboxState.PAUSED
    svc.run(case())
