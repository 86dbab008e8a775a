"""What the syscall allow-list and a user namespace per QEMU cost (issue 28, docs/security.md).

    sudo .venv/bin/python benchmarks/seccomp_bench.py [--reps 8] [--fork 16] [--rounds 2] [--markdown]

One run, one temporary store, three confined nodes side by side, each measurement
alternating between them round by round (so all see the same phases of the machine's
load):

  * ``qemu``: QEMU's own ``-sandbox`` only (``[vm] confine_seccomp = "qemu"``), no user
    namespace: what the node did before;
  * ``allow-list``: plus the node's allow-list, no user namespace;
  * ``allow-list + userns``: plus a user namespace per QEMU mapping only its uid (the
    default now).

Measured: a restore on the spot (no pool) → first ``commands.run``, with QEMU's start
and the state load split out; a fork of 16 → all answering → every child's first command.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from _common import BenchError, machine_info, markdown_table, print_table, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aenv_store.store import Store  # noqa: E402
from aenv_vm.confine.jail import Jail  # noqa: E402
from aenv_vm.confine.policy import Confinement  # noqa: E402
from aenv_vm.guest import ensure_guest  # noqa: E402
from aenv_vm.sandboxes.manager import SandboxManager  # noqa: E402
from aenv_vm.sandboxes.sandbox import Sandbox  # noqa: E402
from aenv_vm.templates.base import build_template  # noqa: E402

from snapshot_bench import guest, settings_for  # noqa: E402
from vm_bench import first_command  # noqa: E402

VARIANTS = ("qemu", "allow-list", "allow-list + userns")


class NoUserNs(Confinement):
    """A confinement whose jails get no user namespace (as before issue 28)."""

    def jail(self, holder: str) -> Jail | None:
        j = super().jail(holder)
        if j is not None and j.user_ns:
            j = dataclasses.replace(j, user_ns=False)
            self._jails[holder] = j
        return j


def confinement(variant: str) -> Confinement:
    if variant == "qemu":
        return NoUserNs(seccomp="qemu")
    return Confinement() if variant.endswith("userns") else NoUserNs()


def order(i: int) -> tuple[str, ...]:
    k = i % len(VARIANTS)
    return VARIANTS[k:] + VARIANTS[:k]


async def restores(mgrs: dict[str, SandboxManager], reps: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {v: [] for v in mgrs}
    for i in range(reps):
        for v in order(i):
            mgr = mgrs[v]
            t0 = time.perf_counter()
            sbx = await mgr.create("base")      # no pool: a clone restored on the spot
            await asyncio.to_thread(first_command, sbx)
            total = time.perf_counter() - t0
            t = sbx.timing
            assert t is not None and not t.from_pool
            out[v].append({"total": total, "qemu_start": t.qemu_start, "state_load": t.state_load})
            await mgr.kill(sbx.id)
    return out


async def forks(mgrs: dict[str, SandboxManager], count: int, rounds: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {v: [] for v in mgrs}
    for i in range(rounds):
        for v in order(i):
            mgr = mgrs[v]
            parent = await mgr.create("base")
            await guest(parent, "true")
            t0 = time.perf_counter()
            kids = await mgr.fork(parent.id, count)
            answering = time.perf_counter() - t0
            ok = [k for k in kids if isinstance(k, Sandbox)]
            if len(ok) != count:
                raise BenchError(f"{v}: {count - len(ok)} fork children failed")
            await asyncio.gather(*(asyncio.to_thread(first_command, k) for k in ok))
            out[v].append({"answering": answering, "all_first_command": time.perf_counter() - t0})
            for k in ok + [parent]:
                await mgr.kill(k.id)
    return out


async def run(args: argparse.Namespace) -> dict:
    guest_img = ensure_guest()
    with tempfile.TemporaryDirectory(prefix="aenv-seccomp-bench-") as tmp:
        work = Path(tmp)
        with Store.open(settings_for(work / "data"), create=True) as store:
            await build_template(store, guest_img, work / "tpl", alias="base", memory_mib=256)
            res: dict = {"machine": machine_info()}
            mgrs: dict[str, SandboxManager] = {}
            try:
                for n, v in enumerate(VARIANTS):
                    mgrs[v] = await SandboxManager(store, guest_img, work / f"n{n}", confine=confinement(v),
                                                   pool_size=0).__aenter__()
                res["confinement"] = {v: m.confinement.summary() for v, m in mgrs.items()}
                res["restore"] = await restores(mgrs, args.reps)
                print("[bench] restores done", file=sys.stderr)
                res["fork"] = await forks(mgrs, args.fork, args.rounds)
                print("[bench] forks done", file=sys.stderr)
            finally:
                for m in mgrs.values():
                    await m.__aexit__(None, None, None)
    return res


def report(res: dict, markdown: bool) -> None:
    rows = []
    for what, field in (("restore (no pool) → first commands.run", "total"), ("  of which QEMU start", "qemu_start"),
                        ("  of which state load", "state_load")):
        cells = []
        for v in VARIANTS:
            s = summarize([r[field] * 1000 for r in res["restore"][v]])
            cells.append(f"{s['p50']:.0f} / {s['p95']:.0f}")
        rows.append([what, *cells, len(res["restore"][VARIANTS[0]])])
    for what, field in (("fork 16 → all answering", "answering"),
                        ("fork 16 → every child's first command", "all_first_command")):
        rows.append([what, *(" / ".join(f"{r[field] * 1000:.0f}" for r in res["fork"][v]) for v in VARIANTS),
                     len(res["fork"][VARIANTS[0]])])
    header = ["ms (p50 / p95; fork: each run)", *VARIANTS, "n"]
    print(markdown_table(rows, header) if markdown else "")
    if not markdown:
        print_table(rows, header)
    m = res["machine"]
    print(f"\n{m['cpus']} × {m['cpu']}, {m['memory']}; TCG")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--fork", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="forks per variant")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = p.parse_args()
    res = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    report(res, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
