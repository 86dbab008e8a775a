"""What a hostile guest's offence costs everyone else (issue 28), watched from outside.

``watching(srv, neighbour)`` wraps an offence: before it, the neighbour's idle
``commands.run("true")`` latency and the node's RSS are taken; during it, three
threads sample the node's ``/health`` every 5 ms (answers timed by the kernel's arrival
stamp, rawconn.py), the node's RSS (its own process, not its QEMUs) and the neighbour's
``commands.run("true")`` in a loop. The ``Harm`` it yields is filled when the block
ends; ``Harm.check()`` holds the node to the issue's bounds:

* the node's RSS grows by less than 64 MiB over its value before the offence;
* ``/health`` p99 stays under 50 ms;
* the neighbour keeps working: every one of its commands succeeds.

The neighbour's p50 against its idle p50 is reported (``Harm.summary``), not asserted:
a time ratio is a benchmark's (benchmarks/hostile_bench.py runs this suite and tables
what each offence cost: with ``HOSTILE_BENCH_REPORT`` set to a file, ``check`` appends a
JSON line per offence to it), not a unit test's.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..conftest import Server
from ..rawconn import Conn, p99

RSS_GROWTH = 64 << 20          # bytes the node's RSS may grow during an offence
HEALTH_P99 = 0.050             # seconds
HEALTH_EVERY = 0.005           # seconds between /health polls (one at a time)
IDLE_RUNS = 10                 # the neighbour's commands before the offence (its idle p50)


def rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@dataclass
class Harm:
    """What the offence did to the node and the neighbour (filled when ``watching`` ends)."""
    rss_before: int = 0
    rss_max: int = 0
    health: list[float] = field(default_factory=list)          # seconds per /health answer
    health_errors: list[str] = field(default_factory=list)
    neighbour_idle: list[float] = field(default_factory=list)  # seconds per command, before
    neighbour: list[float] = field(default_factory=list)       # seconds per command, during
    neighbour_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rss_growth(self) -> int:
        return max(0, self.rss_max - self.rss_before)

    @property
    def health_p99(self) -> float:
        return p99(self.health) if len(self.health) >= 2 else float("inf")

    @property
    def neighbour_ratio(self) -> float:
        """The neighbour's p50 during the offence over its idle p50."""
        if not self.neighbour or not self.neighbour_idle:
            return float("inf")
        return statistics.median(self.neighbour) / statistics.median(self.neighbour_idle)

    def summary(self, what: str) -> str:
        return (f"[hostile] {what}: {self.seconds:.1f} s; node RSS +{self.rss_growth / 2**20:.1f} MiB; "
                f"/health p99 {self.health_p99 * 1000:.1f} ms over {len(self.health)} polls; neighbour "
                f"p50 {statistics.median(self.neighbour or [0]) * 1000:.0f} ms (idle "
                f"{statistics.median(self.neighbour_idle or [0]) * 1000:.0f} ms, x{self.neighbour_ratio:.2f}) "
                f"over {len(self.neighbour)} commands")

    def record(self, what: str) -> dict[str, object]:
        return {"offence": what, "seconds": round(self.seconds, 2),
                "rss_growth_mib": round(self.rss_growth / 2**20, 1),
                "health_p99_ms": round(self.health_p99 * 1000, 1), "health_polls": len(self.health),
                "neighbour_p50_ms": round(statistics.median(self.neighbour or [0]) * 1000, 1),
                "neighbour_idle_p50_ms": round(statistics.median(self.neighbour_idle or [0]) * 1000, 1),
                "neighbour_ratio": round(self.neighbour_ratio, 2), "neighbour_commands": len(self.neighbour),
                "neighbour_errors": len(self.neighbour_errors)}

    def check(self, what: str = "offence") -> None:
        print("\n" + self.summary(what))
        report = os.environ.get("HOSTILE_BENCH_REPORT")
        if report:
            with open(report, "a") as f:
                f.write(json.dumps(self.record(what)) + "\n")
        assert not self.health_errors, self.health_errors[:3]
        assert not self.neighbour_errors, self.neighbour_errors[:3]
        assert self.neighbour, "the neighbour ran no command during the offence"
        assert len(self.health) >= 20, len(self.health)
        assert self.rss_growth < RSS_GROWTH, f"node RSS grew by {self.rss_growth / 2**20:.1f} MiB"
        assert self.health_p99 < HEALTH_P99, sorted(self.health)[-10:]


def _neighbour_run(neighbour: Any) -> float:
    t0 = time.monotonic()
    r = neighbour.commands.run("true", timeout=60)
    assert r.exit_code == 0, r
    return time.monotonic() - t0


@contextmanager
def watching(srv: Server, neighbour: Any) -> Iterator[Harm]:
    """Watch the node and ``neighbour`` (a sync ``e2b.Sandbox`` on the same node) while the
    block runs its offence."""
    harm = Harm()
    for _ in range(IDLE_RUNS):
        harm.neighbour_idle.append(_neighbour_run(neighbour))
    harm.rss_before = harm.rss_max = rss(srv.proc.pid)
    health = Conn(srv, timeout=30)
    assert health.call("GET", "/health", auth=False).status == 204
    stop = threading.Event()

    def poll_health() -> None:
        while not stop.is_set():
            try:
                a = health.call("GET", "/health", auth=False)
                if a.status != 204:
                    harm.health_errors.append(f"/health answered {a.status}")
                harm.health.append(a.seconds)
            except Exception as e:  # noqa: BLE001 - reported by check()
                harm.health_errors.append(repr(e))
                return
            time.sleep(HEALTH_EVERY)

    def poll_rss() -> None:
        while not stop.is_set():
            harm.rss_max = max(harm.rss_max, rss(srv.proc.pid))
            time.sleep(0.05)

    def poll_neighbour() -> None:
        while not stop.is_set():
            try:
                harm.neighbour.append(_neighbour_run(neighbour))
            except Exception as e:  # noqa: BLE001 - reported by check()
                harm.neighbour_errors.append(repr(e))
            time.sleep(0.1)

    threads = [threading.Thread(target=f, daemon=True) for f in (poll_health, poll_rss, poll_neighbour)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    try:
        yield harm
    finally:
        harm.seconds = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(timeout=120)
        health.close()
        harm.rss_max = max(harm.rss_max, rss(srv.proc.pid))
