"""The metric series a node keeps per sandbox (aenv_vm/sandboxes/metrics.py) and E2B's
buckets over it (aenv_api/server/metric_series.py): pure code, no VM."""
from __future__ import annotations

from hypothesis import given, strategies as st

from aenv_api.server.metric_series import bucketed, metric_json, sandbox_ids, step_for
from aenv_vm.sandboxes.metrics import MetricSeries, sample_from_envd
from aenv_vm.service import MetricSample


def _s(t: float, cpu: float = 1.0, mem: int = 100) -> MetricSample:
    return MetricSample(t, 1, cpu, mem, 1000, 10, 5, 50)


def test_series_keeps_order_and_filters() -> None:
    s = MetricSeries(16)
    for i in range(10):
        s.add(_s(1000.0 + 5 * i, cpu=float(i)))
    assert [x.timestamp for x in s] == [1000.0 + 5 * i for i in range(10)]
    assert [x.cpu_used_pct for x in s.between(1010, 1020)] == [2.0, 3.0, 4.0]
    assert s.latest() == _s(1045.0, cpu=9.0)


@given(st.integers(min_value=4, max_value=64), st.integers(min_value=0, max_value=500))
def test_series_is_bounded_and_keeps_the_newest(capacity: int, n: int) -> None:
    s = MetricSeries(capacity)
    for i in range(n):
        s.add(_s(float(i), cpu=float(i), mem=i))
    assert len(s) <= capacity
    got = list(s)
    assert [x.timestamp for x in got] == sorted(x.timestamp for x in got)
    if n:
        assert got[-1].timestamp == n - 1 and got[0].timestamp == 0   # the newest and the first kept
        assert max(x.cpu_used_pct for x in got) == n - 1               # peaks survive merging


def test_steps_as_e2b() -> None:
    assert step_for(0) == 5 and step_for(3599) == 5 and step_for(3600) == 30
    assert step_for(7 * 3600) == 60 and step_for(13 * 3600) == 120 and step_for(2 * 86400) == 300
    assert step_for(8 * 86400) == 900


def test_buckets_take_maxima_at_their_start() -> None:
    samples = [_s(3600.0 * 2 + 7 * i, cpu=float(i % 3)) for i in range(1000)]   # ~2 h: 30 s buckets
    out = bucketed(samples, None, None)
    assert all(b.timestamp % 30 == 0 for b in out)
    assert [b.timestamp for b in out] == sorted({(s.timestamp // 30) * 30 for s in samples})
    assert all(b.cpu_used_pct == 2.0 for b in out[1:-1])
    assert bucketed([], None, None) == []


def test_wire_forms() -> None:
    s = sample_from_envd({"cpu_count": 2, "cpu_used_pct": 12.345, "mem_used": 5, "mem_total": 9,
                          "mem_cache": 1, "disk_used": 3, "disk_total": 8}, 1700000000.7)
    j = metric_json(s)
    assert j == {"timestamp": "2023-11-14T22:13:20.000000Z", "timestampUnix": 1700000000, "cpuCount": 2,
                 "cpuUsedPct": 12.35, "memUsed": 5, "memTotal": 9, "memCache": 1, "diskUsed": 3, "diskTotal": 8}
    assert sandbox_ids("a,b,,a") == ["a", "b"]
    for bad in ({}, {"cpu_count": "x"}, {"cpu_count": True}):
        try:
            sample_from_envd(bad, 0)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
