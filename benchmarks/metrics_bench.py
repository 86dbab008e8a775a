"""What sampling a sandbox's metrics costs the node (aenv_vm/sandboxes/metrics.py).

    sudo .venv/bin/python benchmarks/metrics_bench.py [--sandboxes 4] [--rounds 20] [--markdown]

In a temporary store: ``--sandboxes`` sandboxes of the base template, the
manager's own sampling loop stopped, then ``--rounds`` rounds of one sample of
every sandbox, one after another. Reported per sample:

  * wall time of the envd ``GET /metrics`` exchange (p50/p90);
  * CPU of this process (the manager: connection, HTTP, JSON) — getrusage;
  * CPU of the sandbox's QEMU (the guest's envd answering, which under TCG is
    mostly translated Python), less what the same QEMU used idle over as long
    a time just before;
  * what that is at one sample per 5 s, as a share of one host CPU per sandbox,
    and for 100 sandboxes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from _common import machine_info, markdown_table, percentile, print_table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aenv_store.store import Store  # noqa: E402
from aenv_vm.guest import ensure_guest  # noqa: E402
from aenv_vm.sandboxes.manager import SandboxManager  # noqa: E402
from aenv_vm.sandboxes.metrics import INTERVAL  # noqa: E402
from aenv_vm.templates.base import build_template  # noqa: E402

from snapshot_bench import settings_for  # noqa: E402
from vm_bench import cpu_ms  # noqa: E402


def _self_cpu_ms() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_utime + r.ru_stime) * 1000


async def measure(mgr: SandboxManager, n: int, rounds: int) -> dict:
    sbxs = [await mgr.create("base") for _ in range(n)]
    mgr.metrics.stop()      # only this benchmark samples now
    await asyncio.sleep(2 * mgr.metrics.tick)
    for s in sbxs:          # first answers (TCG translates envd's path once per QEMU)
        assert await mgr.metrics.sample(s) is not None
    idle_s = 5.0
    q0 = {s.id: cpu_ms(s.vm.pid) for s in sbxs}
    await asyncio.sleep(idle_s)
    idle_rate = {s.id: (cpu_ms(s.vm.pid) - q0[s.id]) / idle_s for s in sbxs}   # ms of CPU per s, idle

    walls: list[float] = []
    q1 = {s.id: cpu_ms(s.vm.pid) for s in sbxs}
    c0, t0 = _self_cpu_ms(), time.perf_counter()
    for _ in range(rounds):
        for s in sbxs:
            w = time.perf_counter()
            assert await mgr.metrics.sample(s) is not None
            walls.append(time.perf_counter() - w)
    elapsed = time.perf_counter() - t0
    host_ms = (_self_cpu_ms() - c0) / (rounds * n)
    guest_ms = sum(cpu_ms(s.vm.pid) - q1[s.id] - idle_rate[s.id] * elapsed for s in sbxs) / (rounds * n)
    per_sandbox = (host_ms + max(guest_ms, 0.0)) / (INTERVAL * 1000)
    return {"sandboxes": n, "samples": rounds * n,
            "wall_ms_p50": percentile([w * 1000 for w in walls], 50),
            "wall_ms_p90": percentile([w * 1000 for w in walls], 90),
            "host_cpu_ms": host_ms, "qemu_cpu_ms": guest_ms,
            "idle_qemu_cpu_ms_per_s": sum(idle_rate.values()) / n,
            "cpu_share_per_sandbox_pct": 100 * per_sandbox,
            "cpu_share_100_sandboxes_pct": 100 * 100 * per_sandbox}


async def main_async(args: argparse.Namespace) -> dict:
    guest_img = ensure_guest()
    with tempfile.TemporaryDirectory(prefix="aenv-metrics-bench-") as tmp:
        work = Path(tmp)
        with Store.open(settings_for(work / "data"), create=True) as store:
            await build_template(store, guest_img, work / "tpl", alias="base")
            async with SandboxManager(store, guest_img, work / "node") as mgr:
                return {"machine": machine_info(), **await measure(mgr, args.sandboxes, args.rounds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sandboxes", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(res, indent=2))
        return
    rows = [[res["sandboxes"], res["samples"], f"{res['wall_ms_p50']:.1f} / {res['wall_ms_p90']:.1f}",
             f"{res['host_cpu_ms']:.2f}", f"{res['qemu_cpu_ms']:.1f}", f"{res['cpu_share_per_sandbox_pct']:.2f}",
             f"{res['cpu_share_100_sandboxes_pct']:.0f}"]]
    header = ["sandboxes", "samples", "wall ms p50 / p90", "manager CPU ms", "QEMU CPU ms",
              "% of a CPU per sandbox at 5 s", "% for 100 sandboxes"]
    if args.markdown:
        print(markdown_table(rows, header))
    else:
        print_table(rows, header)
    print(f"load average: {os.getloadavg()[0]:.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
