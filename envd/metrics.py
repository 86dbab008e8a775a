"""``GET /metrics``: CPU, memory and disk of the machine envd runs on."""

from __future__ import annotations

import os
import time


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]), idle


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * 1024
    return out


class MetricsSampler:
    """CPU use is a ratio of deltas, so it is measured since the previous call
    (since boot for the first one) instead of sleeping inside a request."""

    def __init__(self) -> None:
        self._last = _cpu_times()

    def sample(self) -> dict[str, float | int]:
        total, idle = _cpu_times()
        dt, di = total - self._last[0], idle - self._last[1]
        if dt <= 0:
            dt, di = total, idle
        self._last = (total, idle)
        mem = _meminfo()
        mem_total = mem.get("MemTotal", 0)
        used = mem_total - mem.get("MemAvailable", mem.get("MemFree", 0))
        vfs = os.statvfs("/")
        disk_total = vfs.f_blocks * vfs.f_frsize
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": round(100.0 * (dt - di) / dt, 2) if dt else 0.0,
            "mem_total": mem_total,
            "mem_used": used,
            "mem_cache": mem.get("Cached", 0),
            "mem_total_mib": mem_total >> 20,
            "mem_used_mib": used >> 20,
            "disk_used": disk_total - vfs.f_bfree * vfs.f_frsize,
            "disk_total": disk_total,
        }
