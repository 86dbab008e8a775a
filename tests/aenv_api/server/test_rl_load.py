"""RL load on a real node (issue 27): a real ``aenv server`` with its QEMUs, the real E2B
SDK and plain HTTP as clients.

* Over capacity: 32 creates at once on a node that holds 8. Exactly 8 are created; the
  other 24 are answered 429 with ``Retry-After`` and E2B's error body at once (each
  within 100 ms of its request: the refusal does not wait behind the restores the
  burst started), and the node stays responsive while it restores (``/health`` p99
  under 50 ms). The SDK's create on the full node raises its rate-limit error.
* A batch from a snapshot: a sandbox with a file and a background process is
  snapshotted and killed; ``POST /snapshots/{id}/fork`` with ``count: 32`` gives 32
  sandboxes, each with the file and the process still running.

The two time bounds are the issue's acceptance criteria about behaviour (refuse at
once, stay responsive), not benchmarks. They time the server's answer only: every
request goes out in one write on a connection opened beforehand, and its answer is
timed by the kernel's arrival stamp (SO_TIMESTAMPNS), not by when one of this client's
33 threads got round to reading it; every refusal of the burst is timed, and /health is
polled one request at a time every 5 ms for the whole burst (hundreds of samples). The
burst hits a warm node (its pool filled: the start's restores are over). What they
caught, each fixed in the server: QEMU forked on the event loop (Popen waits for the
child's exec), synced record writes on the event loop, each restore pinning its stack's
~26 000 chunks in Python with the GIL held, full GC collections of the start's heap
(50-120 ms), and admitted creates doing their setup before the refusals behind them
were answered. The test prints how long the server's event loop waited for a CPU: on a
machine loaded by other work, that is where a miss comes from.
"""
from __future__ import annotations

import asyncio
import re
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Server, serving, use_sdk_env
from .rawconn import Answer, Conn
from .rawconn import p99 as _p99

pytestmark = [pytest.mark.qemu, pytest.mark.slow]

BURST = 32
HOLDS = 8
REFUSE_WITHIN = 0.100       # seconds from a refused create's request to its 429
HEALTH_P99 = 0.050          # seconds: /health's 99th percentile while the node restores
HEALTH_EVERY = 0.005        # seconds between /health polls (one at a time) ...
HEALTH_FOR = 2.0            # ... for the burst and at least this long (hundreds of samples)
BATCH = 32


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _cpu_wait(pid: int) -> tuple[float, float]:
    """Seconds the process's main thread (its event loop) has run, and has waited for a
    CPU while runnable (/proc schedstat): a diagnostic of a loaded machine."""
    run, wait, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return int(run) / 1e9, int(wait) / 1e9


def _wait_warm(srv: Server, timeout: float = 300.0) -> None:
    """Until the node's warm pool holds its sandbox (the node's steady state: its start's
    restores are over)."""
    deadline = time.monotonic() + timeout
    while True:
        status, _, text = srv.request("GET", "/metrics")
        assert status == 200
        m = re.search(r'^aenv_sandboxes\{state="pooled"\} (\S+)$', text.decode(), re.MULTILINE)
        if m and float(m.group(1)) >= 1:
            return
        assert time.monotonic() < deadline, "the warm pool was not filled"
        time.sleep(0.2)


def _sandbox_ids(srv: Server) -> list[str]:
    status, _, page = srv.request("GET", "/v2/sandboxes?state=running&state=paused&limit=100")
    assert status == 200, page
    return [s["sandboxID"] for s in page]


@pytest.fixture
def full_node(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """A node that holds at most ``HOLDS`` sandboxes."""
    with serving(node_data_dir, tmp_path_factory.mktemp("rl-full-logs"),
                 env={"AENV_SERVER__MAX_SANDBOXES": str(HOLDS)}) as srv:
        yield use_sdk_env(srv, monkeypatch)


@pytest.fixture
def roomy_node(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """A node with room for a batch of ``BATCH`` and its parent."""
    with serving(node_data_dir, tmp_path_factory.mktemp("rl-batch-logs"),
                 env={"AENV_SERVER__MAX_SANDBOXES": str(BATCH + 8)}) as srv:
        yield use_sdk_env(srv, monkeypatch)


def test_a_burst_over_capacity_is_refused_at_once_and_the_node_stays_responsive(full_node: Server) -> None:
    from e2b import Sandbox
    from e2b.exceptions import RateLimitException

    srv = full_node
    assert _sandbox_ids(srv) == []
    _wait_warm(srv)
    conns = [Conn(srv) for _ in range(BURST)]
    health = Conn(srv, timeout=30)
    assert health.call("GET", "/health", auth=False).status == 204      # warm: the connection is served
    go = threading.Barrier(BURST + 1)
    answers: list[Answer | BaseException | None] = [None] * BURST
    samples: list[float] = []
    poll_errors: list[BaseException] = []
    burst_over = threading.Event()

    def create(i: int) -> None:
        go.wait()
        try:
            answers[i] = conns[i].call("POST", "/sandboxes", {"templateID": "base", "timeout": 600})
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            answers[i] = e

    def poll_health() -> None:
        go.wait()
        until = time.monotonic() + HEALTH_FOR
        try:
            while not burst_over.is_set() or time.monotonic() < until:
                a = health.call("GET", "/health", auth=False)
                assert a.status == 204, a
                samples.append(a.seconds)
                time.sleep(HEALTH_EVERY)
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            poll_errors.append(e)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(BURST)]
    poller = threading.Thread(target=poll_health)
    for t in [*threads, poller]:
        t.start()
    t0 = time.monotonic()
    cpu0 = _cpu_wait(srv.proc.pid)
    try:
        for t in threads:
            t.join(timeout=600)
    finally:
        burst_over.set()
        poller.join(timeout=60)
        for c in [*conns, health]:
            c.close()
    burst = time.monotonic() - t0
    cpu = [b - a for a, b in zip(cpu0, _cpu_wait(srv.proc.pid))]
    failures = [a for a in answers if not isinstance(a, Answer)]
    assert not failures and not poll_errors, (failures[:3], poll_errors)
    done = [a for a in answers if isinstance(a, Answer)]
    created = [a for a in done if a.status == 201]
    refused = [a for a in done if a.status == 429]
    refusal = sorted(a.seconds for a in refused)
    health_p99 = _p99(samples) if len(samples) >= 2 else float("inf")
    print(f"\n[rl-load] burst of {BURST} on a node holding {HOLDS}: {len(created)} created (last after "
          f"{burst:.1f} s), {len(refused)} refused: 429 latency max {_ms(max(refusal, default=0))}, "
          f"p99 {_ms(_p99(refusal) if len(refusal) >= 2 else 0)}, median "
          f"{_ms(statistics.median(refusal) if refusal else 0)}; /health over {len(samples)} polls: p99 "
          f"{_ms(health_p99)}, max {_ms(max(samples, default=0))}; the server's event loop ran "
          f"{cpu[0]:.2f} s and waited {cpu[1]:.2f} s for a CPU")
    assert len(created) == HOLDS and len(refused) == BURST - HOLDS, sorted(a.status for a in done)
    assert len({a.body["sandboxID"] for a in created}) == HOLDS
    for a in refused:
        assert re.fullmatch(r"[1-9][0-9]*", a.headers.get("retry-after", "")), a.headers
        assert a.headers["content-type"].startswith("application/json"), a.headers
        assert a.body["code"] == 429 and isinstance(a.body["message"], str) and a.body["message"], a.body
    # refused at once, not after the restores the burst started
    assert max(refusal) < REFUSE_WITHIN, [_ms(s) for s in refusal]
    # the node answered throughout (a poll every 5 ms over the seconds the restores took)
    assert len(samples) >= 200, len(samples)
    assert health_p99 < HEALTH_P99, [_ms(s) for s in sorted(samples)[-10:]]
    # what the E2B SDK makes of the full node's answer: its rate-limit error (told not to retry)
    with pytest.raises(RateLimitException):
        Sandbox.create(timeout=60)
    # the 8 are sandboxes that work
    ids = sorted(a.body["sandboxID"] for a in created)
    assert sorted(_sandbox_ids(srv)) == ids
    for sid in ids:
        s = Sandbox.connect(sid)
        assert s.commands.run("echo up").stdout.strip() == "up"
    for sid in ids:
        assert Sandbox.kill(sid)
    assert _sandbox_ids(srv) == []


def test_a_batch_of_32_from_a_snapshot_of_a_killed_sandbox(roomy_node: Server) -> None:
    from e2b import AsyncSandbox, Sandbox

    srv = roomy_node
    content = "state of the episode's start\n" * 64
    parent = Sandbox.create(timeout=600)
    try:
        parent.files.write("/home/user/rl.txt", content)
        # timeout=0: the SDK's default (60 s) would have envd kill it (E2B's semantics)
        bg = parent.commands.run("sleep 100000", background=True, timeout=0)
        pid = bg.pid
        assert str(pid) in parent.commands.run("pgrep -x sleep").stdout.split()
        snap = parent.create_snapshot()
    finally:
        parent.kill()
    assert parent.sandbox_id not in _sandbox_ids(srv)

    ids: list[str] = []
    try:
        conn = Conn(srv)
        try:
            t0 = time.monotonic()
            batch = conn.call("POST", f"/snapshots/{snap.snapshot_id}/fork", {"count": BATCH, "timeout": 600})
            batch_seconds = time.monotonic() - t0
        finally:
            conn.close()
        assert batch.status == 201, batch
        assert len(batch.body) == BATCH
        ids += [r["sandbox"]["sandboxID"] for r in batch.body if "sandbox" in r]
        errors = [r["error"] for r in batch.body if "sandbox" not in r]
        # a child the restore gate refused (its queue or wait bound) is created again as a
        # client told to retry does: the SDK's create waits Retry-After and retries
        assert all(e["code"] == 429 for e in errors), errors

        async def retried(n: int) -> list[str]:
            return [s.sandbox_id for s in await asyncio.gather(
                *(AsyncSandbox.create(snap.snapshot_id, timeout=600) for _ in range(n)))]
        ids += asyncio.run(retried(len(errors))) if errors else []
        print(f"\n[rl-load] batch of {BATCH} from snapshot {snap.snapshot_id}: {BATCH - len(errors)} in "
              f"{batch_seconds:.1f} s, {len(errors)} refused by the restore gate and created again")
        assert len(ids) == BATCH and len(set(ids)) == BATCH and parent.sandbox_id not in ids

        probe = (f"cat /home/user/rl.txt; echo '--'; pgrep -x sleep; echo '--'; "
                 f"tr '\\0' ' ' < /proc/{pid}/cmdline; echo; cut -d' ' -f3 /proc/{pid}/stat; echo '--'; hostname")

        async def check(sid: str) -> str:
            s = await AsyncSandbox.connect(sid)
            return (await s.commands.run(probe, timeout=300)).stdout

        async def check_all() -> list[str]:
            return list(await asyncio.gather(*(check(sid) for sid in ids)))
        t1 = time.monotonic()
        seen = asyncio.run(check_all())
        print(f"[rl-load] the {BATCH} answered a command in {time.monotonic() - t1:.1f} s")
        for sid, out in zip(ids, seen):
            files, pids, proc, hostname = out.split("--\n")
            assert files == content, (sid, out[-300:])
            cmdline, state = proc.split("\n")[:2]
            # the parent's background process, alive (not a zombie) in every child
            assert str(pid) in pids.split() and cmdline.strip() == "sleep 100000", (sid, out[-300:])
            assert state in ("S", "R"), (sid, out[-300:])
            assert hostname.strip() == sid
        for sid in ids:
            assert Sandbox.kill(sid)
        assert _sandbox_ids(srv) == []
    finally:
        srv.kill_all()      # after a failure: the children go before their snapshot
        Sandbox.delete_snapshot(snap.snapshot_id)
