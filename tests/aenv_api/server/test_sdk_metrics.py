"""Metrics over time through the real SDK (sync and async) against `aenv server`: a
series sampled from the guest every 5 s over ≥ 20 s, ``start``/``end`` filtering, kept
across a pause, ``GET /sandboxes/metrics``, and E2B's errors."""
from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any, Iterator

import pytest

from .conftest import Server, use_sdk_env

pytestmark = pytest.mark.qemu

SPAN = 22.0     # seconds of life a series is read over


@pytest.fixture(scope="module")
def pair(server: Server) -> Iterator[tuple[Any, str, float]]:
    """A sandbox for the sync test and one for the async test, created together so that
    the second test's sandbox has lived its ``SPAN`` by the time the first one is done."""
    from e2b import Sandbox

    with pytest.MonkeyPatch.context() as mp:
        use_sdk_env(server, mp)
        t0 = time.time()
        a = Sandbox.create(metadata={"suite": "metrics"}, timeout=600)
        b = Sandbox.create(metadata={"suite": "metrics"}, timeout=600)
        yield a, b.sandbox_id, t0
        for s in (a, b):
            try:
                s.kill()
            except Exception:
                pass


def _wait_age(t0: float) -> None:
    time.sleep(max(0.0, t0 + SPAN - time.time()))


def _check_series(ms: list[Any], memory_mb: int, cpus: int) -> None:
    assert len(ms) >= 4, ms
    ts = [m.timestamp.timestamp() for m in ms]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)
    assert all(b - a >= 5 for a, b in zip(ts, ts[1:])), ts      # 5 s buckets, one sample each
    assert sum(1 for a, b in zip(ts, ts[1:]) if b - a <= 10) >= len(ts) // 2, ts
    for m in ms:
        assert m.cpu_count == cpus
        assert 0 <= m.cpu_used_pct <= 100
        assert memory_mb << 19 < m.mem_total <= memory_mb << 20      # the guest's view of its RAM
        assert 0 < m.mem_used < m.mem_total and 0 <= m.mem_cache < m.mem_total
        assert 0 < m.disk_used < m.disk_total


def test_metrics_series_sync(pair: tuple[Any, str, float], sdk_env: Server) -> None:
    from e2b import Sandbox, SandboxException, SandboxNotFoundException

    sbx, _, t0 = pair
    # load the guest: a CPU burner and 40 MiB written to its root filesystem
    first = sbx.get_metrics()     # at least the sample taken at its start
    assert first
    sbx.commands.run("timeout 8 sh -c 'while :; do :; done'", background=True)
    sbx.commands.run("dd if=/dev/urandom of=/home/user/blob bs=1M count=40 status=none && sync")
    t_written = time.time()
    _wait_age(t0)
    time.sleep(max(0.0, t_written + 11 - time.time()))     # two samples after the write
    info = sbx.get_info()
    ms = sbx.get_metrics()
    _check_series(ms, info.memory_mb, info.cpu_count)
    assert ms[0].timestamp.timestamp() <= info.started_at.timestamp() + 5    # sampled from its start
    assert max(m.cpu_used_pct for m in ms) >= 40, [m.cpu_used_pct for m in ms]   # the burner
    after = [m.disk_used for m in ms if m.timestamp.timestamp() > t_written + 1]
    assert after and max(after) - first[0].disk_used >= 35 << 20, (first[0], after)

    # start/end filter the samples (unix seconds, inclusive), as E2B does, before they are
    # put in buckets stamped with their start: end=a bucket's start leaves that bucket's
    # sample (taken within it) out
    k = len(ms) // 2
    mid = ms[k].timestamp
    late = Sandbox.get_metrics(sbx.sandbox_id, start=mid)
    assert late and late[0].timestamp == mid and late[-1].timestamp >= ms[-1].timestamp
    early = Sandbox.get_metrics(sbx.sandbox_id, end=mid)
    assert early[0].timestamp == ms[0].timestamp and early[-1].timestamp in (ms[k - 1].timestamp, mid)
    assert Sandbox.get_metrics(sbx.sandbox_id, start=datetime.datetime(2001, 1, 1, tzinfo=datetime.timezone.utc),
                               end=datetime.datetime(2001, 1, 2, tzinfo=datetime.timezone.utc)) == []
    status, _, body = sdk_env.request("GET", f"/sandboxes/{sbx.sandbox_id}/metrics?start=20&end=10")
    assert status == 400 and body["code"] == 400 and "time range" in body["message"]
    with pytest.raises(SandboxException):
        Sandbox.get_metrics(sbx.sandbox_id, start=ms[-1].timestamp, end=ms[0].timestamp)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_metrics("nosuchsandbox")

    # kept across a pause: nothing new while paused, sampled again at once after resume
    sbx.pause()
    held = Sandbox.get_metrics(sbx.sandbox_id)
    assert [m.timestamp for m in held][:len(ms)] == [m.timestamp for m in ms]
    time.sleep(6)
    assert len(Sandbox.get_metrics(sbx.sandbox_id)) == len(held)
    t_resume = time.time()
    again = Sandbox.connect(sbx.sandbox_id)
    deadline = time.time() + 10
    while len(after_resume := again.get_metrics()) == len(held) and time.time() < deadline:
        time.sleep(0.5)
    assert after_resume[:len(held)] == held
    assert after_resume[-1].timestamp.timestamp() >= int(t_resume) - 5 and len(after_resume) > len(held)


def test_metrics_series_async(pair: tuple[Any, str, float], sdk_env: Server) -> None:
    from e2b import AsyncSandbox

    _, sid, t0 = pair
    _wait_age(t0)

    async def flow() -> None:
        sbx = await AsyncSandbox.connect(sid)
        info = await sbx.get_info()
        ms = await sbx.get_metrics()
        _check_series(ms, info.memory_mb, info.cpu_count)
        assert ms[-1].timestamp.timestamp() >= time.time() - 11        # still being sampled
        window = await AsyncSandbox.get_metrics(sid, start=ms[1].timestamp,
                                                end=ms[-1].timestamp)
        assert [m.timestamp for m in window] == [m.timestamp for m in ms[1:-1]]

    asyncio.run(flow())

    # the newest sample of several sandboxes at once (E2B's SandboxesWithMetrics)
    a_id = pair[0].sandbox_id
    status, _, body = sdk_env.request("GET", f"/sandboxes/metrics?sandbox_ids={sid},{a_id},nosuch")
    assert status == 200 and set(body["sandboxes"]) == {sid, a_id}
    one = body["sandboxes"][sid]
    assert {"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal", "memCache",
            "diskUsed", "diskTotal"} <= set(one) and one["timestampUnix"] >= time.time() - 11
    many = ",".join(f"id{i}" for i in range(101))
    status, _, body = sdk_env.request("GET", f"/sandboxes/metrics?sandbox_ids={many}")
    assert status == 400 and "maximum is 100" in body["message"]
    status, _, body = sdk_env.request("GET", "/sandboxes/metrics")
    assert status == 400
