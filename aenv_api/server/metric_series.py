"""E2B's view of a sandbox's metric samples (``GET /sandboxes/{id}/metrics``).

The node keeps raw samples (aenv_vm/sandboxes/metrics.py, every 5 s); E2B's API
answers them in buckets whose width grows with the range asked for (so a
week-long sandbox is not thousands of points): 5 s under an hour, 30 s under
6 h, 1 min under 12 h, 2 min under a day, 5 min under a week, 15 min beyond;
each bucket holds each field's maximum and is stamped with its start. A range
left open runs from the first to the last sample (the sandbox's life).
"""
from __future__ import annotations

from typing import Any

from aenv_vm.sandboxes.metrics import merged
from aenv_vm.service import MetricSample
from aenv_wire.listing import iso

MAX_SANDBOX_IDS = 100       # ids per GET /sandboxes/metrics, as E2B allows

_STEPS = ((3600, 5), (6 * 3600, 30), (12 * 3600, 60), (24 * 3600, 120), (7 * 24 * 3600, 300))


def step_for(span: float) -> int:
    """Bucket width in seconds for a range ``span`` seconds long."""
    for limit, step in _STEPS:
        if span < limit:
            return step
    return 900


def bucketed(samples: list[MetricSample], start: float | None, end: float | None) -> list[MetricSample]:
    """``samples`` (oldest first, already within the range) in buckets of E2B's width."""
    if not samples:
        return []
    lo = samples[0].timestamp if start is None else start
    hi = samples[-1].timestamp if end is None else end
    step = step_for(max(0.0, hi - lo))
    out: list[MetricSample] = []
    bucket = -1
    for s in samples:
        b = int(s.timestamp // step)
        at = float(b * step)
        if b != bucket:
            out.append(MetricSample(at, s.cpu_count, s.cpu_used_pct, s.mem_used, s.mem_total, s.mem_cache,
                                    s.disk_used, s.disk_total))
            bucket = b
        else:   # the bucket keeps its start: merged() takes the earlier time
            out[-1] = merged(out[-1], s)
    return out


def metric_json(s: MetricSample) -> dict[str, Any]:
    """A sample as E2B's ``SandboxMetric``."""
    ts = int(s.timestamp)
    return {"timestamp": iso(ts), "timestampUnix": ts, "cpuCount": s.cpu_count,
            "cpuUsedPct": round(s.cpu_used_pct, 2), "memUsed": s.mem_used, "memTotal": s.mem_total,
            "memCache": s.mem_cache, "diskUsed": s.disk_used, "diskTotal": s.disk_total}


def sandbox_ids(raw: str | None) -> list[str]:
    """The ``sandbox_ids`` query parameter (comma-separated, explode false), deduplicated."""
    return list(dict.fromkeys(x for x in (raw or "").split(",") if x))
