"""Pause, resume, fork and memory of snapshotted sandboxes (issue 6), and the
measurements that settle docs/snapshots.md's design question.

    sudo .venv/bin/python benchmarks/snapshot_bench.py [--memory-mib 512] [--reps 5] [--resumes 10]
                                                       [--cold 3] [--fork 16] [--json out.json] [--markdown]

One run, in a temporary store: builds a template (``--memory-mib`` guest), then
  * pause latency at 1, 16 and 128 MiB dirtied in guest memory since the last
    resume (p50/p99 over ``--reps``), split into stop / device state / private
    pages / write; beside it the two alternatives of the design question,
    measured on the same guest: (1) the stripping route — stop, full QEMU
    migration of the share=off clone into a file, split by aenv's stream
    reader; (2) copy-on-fork with share=on — the copy of the base memory file
    each clone would need (its x-ignore-shared save itself is the "device
    state" row);
  * resume latency from local files (``--resumes``) and from a cold node
    (``--cold``: local snapshot files, materialised template and node cache
    gone, everything fetched from the repository): (a) call → QMP status
    running, (b) call → first successful ``commands.run`` through the real e2b
    SDK, with the breakdown of (b);
  * fork of ``--fork`` children: call → all children answering (envd
    initialised), then → every child's first ``commands.run`` done;
  * host PSS of the idle children vs one sandbox, with and without TCG's
    translated-code buffer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import BenchError, machine_info, markdown_table, print_table, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings  # noqa: E402
from aenv_store.store import Store  # noqa: E402
from aenv_vm import ksm  # noqa: E402
from aenv_vm.config import VmConfig  # noqa: E402
from aenv_vm.guest import GuestImage, ensure_guest  # noqa: E402
from aenv_vm.sandboxes.manager import SandboxManager  # noqa: E402
from aenv_vm.sandboxes.sandbox import Sandbox  # noqa: E402
from aenv_vm.qemu import migration_stream  # noqa: E402
from aenv_vm.qemu.migration import migrate_to_file  # noqa: E402
from aenv_vm.memory.memory_image import Delta, consolidate  # noqa: E402
from aenv_vm.templates.base import build_template  # noqa: E402
from vm_bench import cpu_ms, first_command, pss_kib, pss_kib_without_tcg, pss_split_kib, settle  # noqa: E402

import numpy as np  # noqa: E402


PARTS = ("pause", "strip", "resume", "cold", "fork")


def settings_for(data: Path, cache: Path | None = None) -> StoreSettings:
    return StoreSettings(paths=StorePaths(data), repository=RepositoryConfig(), store=StoreConfig(),
                         cache=CacheConfig(capacity=8 << 30, min_free_disk=0, path=str(cache or "")))


async def settled(mgr: SandboxManager, sid: str) -> None:
    """Wait for the background commit of the last pause."""
    await mgr.wait_committed(sid)


async def guest(sbx: Sandbox, cmd: str) -> None:
    r = await sbx.envd.run(cmd, user="root", timeout=300.0)
    if r.exit_code != 0:
        raise BenchError(f"guest command {cmd!r} exited {r.exit_code}: {r.stderr[-300:]!r}")


async def dirty(sbx: Sandbox, mib: int, fill: int) -> None:
    """Make ``mib`` MiB of guest memory differ from the last pause: a tmpfs file
    overwritten in place, 1 MiB at a time (the same guest pages each time, so the
    delta grows only once)."""
    await guest(sbx, "python3 -c \"import os; f=os.open('/dev/shm/dirty', os.O_WRONLY | os.O_CREAT); "
                     f"b=bytes([{fill}])*(1<<20); [os.write(f, b) for _ in range({mib})]\"")


def _self_cpu() -> float:
    """CPU seconds of this process (all threads): what a pause costs the manager."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def pauses(mgr: SandboxManager, mib: int, reps: int) -> list[dict]:
    sbx = await mgr.create("base")
    out = []
    try:
        await mgr.pause(sbx.id)
        for i in range(reps):
            sbx = await mgr.resume(sbx.id)
            await dirty(sbx, mib, 1 + i % 250)
            t0, c0 = time.perf_counter(), _self_cpu()
            await mgr.pause(sbx.id)
            call, cpu = time.perf_counter() - t0, _self_cpu() - c0
            t = mgr.last_pause
            assert t is not None
            out.append({"total": t.total, "call": call, "stop": t.stop, "device_state": t.device_state,
                        "pages": t.pages, "write": t.write, "delta_mib": t.dirty_pages * 4096 / 2**20, "cpu": cpu,
                        "written_mib": t.written_pages * 4096 / 2**20,
                        "load": os.getloadavg()[0]})
            await settled(mgr, sbx.id)
    finally:
        await mgr.kill(sbx.id)
    return out


async def strip_route(mgr: SandboxManager, mib: int, reps: int, tmp: Path) -> list[dict]:
    """The alternative: stop, full migration of the share=off clone, split the stream."""
    out = []
    for i in range(reps):
        sbx = await mgr.create("base")
        try:
            await dirty(sbx, mib, 1 + i)
            vm = sbx.vm
            assert vm.qmp is not None
            await vm.qmp.execute("migrate-set-parameters", {"max-bandwidth": 64 << 30})
            await vm.qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "x-ignore-shared", "state": True}]})
            path = tmp / "full-stream"
            t0 = time.perf_counter()
            await vm.qmp.execute("stop")
            t1 = time.perf_counter()
            await migrate_to_file(vm, path)
            t2 = time.perf_counter()
            data = path.read_bytes()
            split = migration_stream.split(data)
            # keep only the pages that differ from the base memory file (vectorised compare)
            base = np.memmap(mgr.run_root / "templates" / sbx.template.id / "memory", dtype=np.uint8,
                             mode="r").reshape(-1, 4096)
            ram = max(split.blocks.values(), key=lambda b: split.ram_sizes[b.name])
            changed = sum(int((rows != base[offs // 4096]).any(axis=1).sum()) for offs, rows in ram.runs())
            t3 = time.perf_counter()
            out.append({"total": t3 - t0, "stop": t1 - t0, "migrate": t2 - t1, "split": t3 - t2,
                        "stream_mib": len(data) / 2**20, "changed_pages": changed,
                        "stripped_kib": len(split.stripped()) / 1024})
            path.unlink()
        finally:
            await mgr.kill(sbx.id)
    return out


def copy_route(tpl_mem: Path, tmp: Path, reps: int) -> list[float]:
    """share=on copy-on-fork: the private copy of the base memory file a clone needs."""
    empty = Delta(b"\0" * 32, tpl_mem.stat().st_size, np.zeros(0, np.int64), np.zeros(0, np.uint64),  # type: ignore[arg-type]
                  memoryview(b""))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        consolidate(tpl_mem, empty, tmp / "copy")
        out.append(time.perf_counter() - t0)
        (tmp / "copy").unlink()
    return out


async def resumes(mgr: SandboxManager, n: int, standby: bool) -> list[dict]:
    sbx = await mgr.create("base")
    mgr.standby_limit = 4 if standby else 0
    out = []
    try:
        await guest(sbx, "true")
        for _ in range(n):
            await mgr.pause(sbx.id)
            await settled(mgr, sbx.id)  # measure the resume alone
            t0 = time.perf_counter()
            sbx = await mgr.resume(sbx.id)
            call = time.perf_counter() - t0
            cmd = await asyncio.to_thread(first_command, sbx)
            out.append(_resume_row(mgr, call, cmd))
    finally:
        await mgr.kill(sbx.id)
    return out


def _resume_row(mgr: SandboxManager, call: float, cmd: float) -> dict:
    """One resume's numbers: the manager's ResumeTiming, the call and the first command."""
    t = mgr.last_resume
    assert t is not None
    return {"running": t.running, "first_command_total": call + cmd, "fetch": t.fetch, "qemu_start": t.qemu_start,
            "inject": t.inject, "state_load": t.state_load, "first_answer": t.first_answer, "init": t.init,
            "first_command": cmd, "load": os.getloadavg()[0]}


async def cold_resumes(store: Store, guest_img: GuestImage, work: Path, n: int) -> list[dict]:
    node = work / "node-cold"
    async with SandboxManager(store, guest_img, node) as mgr:
        sbx = await mgr.create("base")
        await guest(sbx, "true")
        sid = sbx.id
        await mgr.pause(sid)
    out = []
    for i in range(n):
        # a node that has nothing local: no snapshot files, no template files, an empty node cache
        rec_local = None
        shutil.rmtree(node / "templates", ignore_errors=True)
        for d in (node / "paused" / sid).iterdir():
            rec_local = d
            if d.is_dir():
                shutil.rmtree(d)
            else:       # the sandbox's spare delta file
                d.unlink()
        cache = work / f"cold-cache-{i}"
        with Store.open(settings_for(work / "data", cache)) as cold_store:
            async with SandboxManager(cold_store, guest_img, node) as mgr:
                t0 = time.perf_counter()
                sbx = await mgr.resume(sid)
                call = time.perf_counter() - t0
                cmd = await asyncio.to_thread(first_command, sbx)
                out.append(_resume_row(mgr, call, cmd))
                await mgr.pause(sid)
                await settled(mgr, sid)
                if i == n - 1:
                    await mgr.kill(sid)
        shutil.rmtree(cache, ignore_errors=True)
        del rec_local
    return out


async def _pss_both_ways(mgr: SandboxManager, pids: list[int]) -> dict[str, dict[str, int]]:
    """Summed PSS (and without TCG's code) of ``pids`` twice: with ksmd stopped and
    everything unmerged (QEMU's defaults), then — if the node uses KSM — after ksmd
    at the node's rate finished 3 full scans. ksmd is left running as the node has it."""
    def sums() -> dict:
        return {"pss": sum(map(pss_kib, pids)), "no_tcg": sum(map(pss_kib_without_tcg, pids)),
                "split": pss_split_kib(pids[0])}

    ksm.unmerge_all()
    await settle(None)
    out = {"plain": sums()}
    if mgr.ksm is not None:
        ksm.enable(mgr.ksm)
        ksmd = await settle(mgr.ksm)      # merged at the node's rate; ksmd's time and CPU
        out["ksm"] = {**sums(), **ksmd}
    return out


async def _neighbour_p50(sbx: Sandbox, stop: asyncio.Event | None, n: int = 10) -> tuple[float, int]:
    """p50 (ms) of a running neighbour's ``true`` commands: ``n`` of them, or (``stop``)
    one after another until it is set; and how many ran."""
    times: list[float] = []
    while (len(times) < n) if stop is None else not stop.is_set():
        t = time.perf_counter()
        await guest(sbx, "true")
        times.append((time.perf_counter() - t) * 1000)
    return float(np.median(times)), len(times)


async def fork(mgr: SandboxManager, count: int, busy: bool = False) -> dict:
    """``busy``: the parent runs a busy loop when forked (so does each child at once), and
    a neighbour sandbox runs ``true`` commands throughout: its p50 against its idle p50."""
    parent = await mgr.create("base")
    await guest(parent, "true")
    one_mem = await _pss_both_ways(mgr, [parent.vm.pid])
    neighbour = await mgr.create("base") if busy else None
    idle_p50 = 0.0
    if neighbour is not None:
        await guest(parent, "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 &")
        idle_p50, _ = await _neighbour_p50(neighbour, None)
    stop = asyncio.Event()
    watching = asyncio.ensure_future(_neighbour_p50(neighbour, stop)) if neighbour is not None else None
    t0, c0 = time.perf_counter(), _self_cpu()
    kids = await mgr.fork(parent.id, count)
    answering, manager_cpu = time.perf_counter() - t0, _self_cpu() - c0
    stop.set()
    during = await watching if watching is not None else None
    failed = [k for k in kids if isinstance(k, Exception)]
    if failed:
        raise BenchError(f"{len(failed)} fork children failed: {failed[0]}")
    ok = [k for k in kids if isinstance(k, Sandbox)]
    cpu_before = sum(cpu_ms(k.vm.pid) for k in ok)
    # per child (p50 over children): where its restore went (sandbox.CreateTiming + the fork's /init)
    per_child = {f: float(np.median([getattr(k.timing, f) for k in ok if k.timing is not None]))
                 for f in ("qemu_start", "state_load", "first_answer", "identity", "init", "total")}
    await asyncio.gather(*(asyncio.to_thread(first_command, k) for k in ok))
    all_commands = time.perf_counter() - t0
    kids_mem = await _pss_both_ways(mgr, [k.vm.pid for k in ok])
    for k in ok + [parent] + ([neighbour] if neighbour is not None else []):
        await mgr.kill(k.id)
    nb = None if during is None else {"idle_p50_ms": idle_p50, "fork_p50_ms": during[0], "commands": during[1],
                                      "ratio": during[0] / idle_p50 if idle_p50 else 0.0}
    return {"count": count, "busy": busy, "neighbour": nb, "answering": answering,
            "children_cpu_ms_at_answering": cpu_before,
            "snapshot_s": mgr.last_fork_snapshot,
            "manager_cpu_ms": manager_cpu * 1000, "per_child_s": per_child,
            "snapshot_parts_s": mgr.last_fork_timing,
            "all_first_command": all_commands, "mem_one": one_mem, "mem_children": kids_mem}


async def main_async(args: argparse.Namespace) -> dict:
    """Runs the parts; the host's KSM knobs are put back as they were afterwards."""
    with ksm.knobs_restored():
        return await _run(args)


async def _run(args: argparse.Namespace) -> dict:
    guest_img = ensure_guest()
    with tempfile.TemporaryDirectory(prefix="aenv-snap-bench-") as tmp:
        work = Path(tmp)
        with Store.open(settings_for(work / "data"), create=True) as store:
            t0 = time.perf_counter()
            await build_template(store, guest_img, work / "tpl", alias="base", memory_mib=args.memory_mib)
            template_s = time.perf_counter() - t0
            res: dict = {"machine": machine_info(), "memory_mib": args.memory_mib, "template_build_s": template_s,
                         "pause": {}, "strip": {}}
            parts = set(args.only or PARTS)
            node_ksm = None if args.no_ksm else VmConfig().ksm_settings()   # what `aenv server` uses
            res["ksm"] = node_ksm is not None
            async with SandboxManager(store, guest_img, work / "node", ksm=node_ksm, network=args.network) as mgr:
                for mib in args.dirty if "pause" in parts else ():
                    res["pause"][mib] = await pauses(mgr, mib, args.reps)
                    if "strip" in parts:
                        res["strip"][mib] = await strip_route(mgr, mib, args.strip_reps, work)
                    print(f"[bench] pause at {mib} MiB done", file=sys.stderr)
                if "strip" in parts:
                    tpl_mem = next((work / "node" / "templates").glob("tpl-*/memory"))
                    res["copy"] = copy_route(tpl_mem, work, 3)
                    res["copy_file_mib"] = tpl_mem.stat().st_blocks * 512 / 2**20
                if args.resumes and "resume" in parts:
                    res["resume"] = await resumes(mgr, args.resumes, standby=True)
                    res["resume_nostandby"] = await resumes(mgr, args.resumes, standby=False)
                    print("[bench] resumes done", file=sys.stderr)
                if args.fork and "fork" in parts:
                    res["fork"] = await fork(mgr, args.fork, busy=args.fork_busy)
                    print("[bench] fork done", file=sys.stderr)
            if args.cold and "cold" in parts:
                res["cold"] = await cold_resumes(store, guest_img, work, args.cold)
    return res


def report(res: dict, markdown: bool) -> None:
    ms = lambda xs: summarize([x * 1000 for x in xs])  # noqa: E731
    rows = []
    for mib, reps in res["pause"].items():
        s = ms([r["total"] for r in reps])
        parts = ", ".join(f"{k} {ms([r[k] for r in reps])['p50']:.0f}" for k in ("stop", "device_state", "pages", "write"))
        if "cpu" in reps[0]:
            parts += f"; manager CPU {ms([r['cpu'] for r in reps])['p50']:.0f}"
        delta = summarize([r["delta_mib"] for r in reps])["p50"]
        written = f", written {summarize([r['written_mib'] for r in reps])['p50']:.0f}" if "written_mib" in reps[0] else ""
        rows.append([f"pause, {mib} MiB dirtied (delta {delta:.0f}{written} MiB)", f"{s['p50']:.0f}",
                     f"{s['p99']:.0f}", int(s["n"]), parts])
    for mib, reps in res["strip"].items():
        s = ms([r["total"] for r in reps])
        parts = ", ".join(f"{k} {ms([r[k] for r in reps])['p50']:.0f}" for k in ("stop", "migrate", "split"))
        parts += " (split = parse + compare with the base)"
        stream = summarize([r["stream_mib"] for r in reps])["p50"]
        rows.append([f"  alternative: strip route, {mib} MiB (stream {stream:.0f} MiB)", f"{s['p50']:.0f}",
                     f"{s['p99']:.0f}", int(s["n"]), parts])
    if "copy" in res:
        c = ms(res["copy"])
        rows.append([f"  alternative: share=on copy of the base file ({res['copy_file_mib']:.0f} MiB allocated)",
                     f"{c['p50']:.0f}", f"{c['p99']:.0f}", int(c["n"]), "per clone, at create/fork"])
    for label, key in (("resume, local (standby QEMU)", "resume"), ("resume, local, no standby", "resume_nostandby"),
                       ("resume, cold node (from the repository)", "cold")):
        reps = res.get(key)
        if not reps:
            continue
        for what, field in (("(a) → running", "running"), ("(b) → first commands.run", "first_command_total")):
            s = ms([r[field] for r in reps])
            parts = ""
            if field == "first_command_total":
                parts = ", ".join(f"{k} {ms([r[k] for r in reps])['p50']:.0f}" for k in
                                  ("fetch", "qemu_start", "inject", "state_load", "first_answer", "init",
                                   "first_command"))
            rows.append([f"{label} {what}", f"{s['p50']:.0f}", f"{s['p99']:.0f}", int(s["n"]), parts])
    f = res.get("fork")
    if f is None:
        print(markdown_table(rows, ["what (ms)", "p50", "p99", "n", "p50 breakdown (ms)"]) if markdown else "")
        if not markdown:
            print_table(rows, ["what (ms)", "p50", "p99", "n", "p50 breakdown (ms)"])
        return
    rows.append([f"fork {f['count']} → all answering (envd initialised)", f"{f['answering'] * 1000:.0f}", "", 1,
                 f"snapshot {f['snapshot_s'] * 1000:.0f} ("
                 + ", ".join(f"{k} {v * 1000:.0f}" for k, v in (f.get("snapshot_parts_s") or {}).items())
                 + f"); children's QEMU CPU time until then "
                 f"{f['children_cpu_ms_at_answering']:.0f}, manager CPU {f.get('manager_cpu_ms', 0):.0f}; "
                 "per child p50: " + ", ".join(f"{k} {v * 1000:.0f}" for k, v in f.get("per_child_s", {}).items())])
    rows.append([f"fork {f['count']} → every child's first commands.run done", f"{f['all_first_command'] * 1000:.0f}",
                 "", 1, "a busy parent (and children)" if f.get("busy") else ""])
    if f.get("neighbour"):
        nb = f["neighbour"]
        rows.append(["a running neighbour's `true` during the fork, p50", f"{nb['fork_p50_ms']:.0f}", "",
                     nb["commands"], f"idle p50 {nb['idle_p50_ms']:.0f}: {nb['ratio']:.2f}× idle"])
    header = ["what (ms)", "p50", "p99", "n", "p50 breakdown (ms)"]
    modes = [m for m in ("plain", "ksm") if m in f["mem_children"]]
    one, kids = f["mem_one"], f["mem_children"]
    mib = lambda kib: f"{kib / 1024:.1f} MiB"  # noqa: E731
    mem = [[f"1 sandbox ({res['memory_mib']} MiB guest)", *(mib(one[m][k]) for m in modes for k in ("pss", "no_tcg"))],
           [f"{f['count']} idle fork children", *(mib(kids[m][k]) for m in modes for k in ("pss", "no_tcg"))],
           ["children / one sandbox", *(f"{kids[m][k] / one[m][k]:.2f}×" for m in modes for k in ("pss", "no_tcg"))]]
    mem += [[f"one child: {k.replace('_', ' ')}", *(x for m in modes for x in (mib(kids[m]["split"][k]), ""))]
            for k in kids["plain"]["split"]]
    if "ksm" in kids:
        mem.append(["ksmd: time to 3 full scans / CPU of one core meanwhile", "", "",
                    f"{kids['ksm']['settle_s']:.0f} s / {kids['ksm']['ksmd_cpu_pct']:.1f}%", ""])
    names = {"plain": "QEMU defaults", "ksm": "[vm] ksm"}
    mh = ["host PSS", *(x for m in modes for x in (f"{names[m]}: total", f"{names[m]}: without TCG code (≈ KVM)"))]
    if markdown:
        print(markdown_table(rows, header))
        print()
        print(markdown_table(mem, mh))
    else:
        print_table(rows, header)
        print_table(mem, mh)
    loads = [r["load"] for k in ("resume", "resume_nostandby", "cold") for r in res.get(k, [])] or [0.0]
    m = res["machine"]
    print(f"\n{m['cpus']} × {m['cpu']}, {m['memory']}; load average {min(loads):.1f}-{max(loads):.1f}; "
          f"template build {res['template_build_s']:.1f} s; TCG")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-mib", type=int, default=512)
    p.add_argument("--dirty", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--strip-reps", type=int, default=2)
    p.add_argument("--resumes", type=int, default=10)
    p.add_argument("--cold", type=int, default=3)
    p.add_argument("--fork", type=int, default=16)
    p.add_argument("--fork-busy", action="store_true",
                   help="fork a parent running a busy loop, a neighbour running commands meanwhile (its p50 ratio)")
    p.add_argument("--no-ksm", action="store_true", help="the node without its default [vm] ksm settings")
    p.add_argument("--network", choices=("auto", "user", "tap"), default="auto",
                   help="[vm] network of the node (default: auto, what `aenv server` uses)")
    p.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts (default: all)")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("snapshot_bench: error: needs root (guest build, /proc/PID/mem)", file=sys.stderr)
        return 2
    try:
        res = asyncio.run(main_async(args))
    except BenchError as e:
        print(f"snapshot_bench: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    report(res, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
