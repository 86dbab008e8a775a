"""What QEMU confinement costs and what it bounds (issue 13, docs/security.md).

    sudo .venv/bin/python benchmarks/isolation_bench.py [--reps 10] [--fork 16] [--idle 8] [--markdown]

One run, in a temporary store, with two nodes side by side on the same machine:
``[vm] confine = "auto"`` (every part this host allows) and ``"off"``; each
measurement alternates between them round by round, so both see the same
phases of the machine's load:

  * device-state load of a clone: ``migrate-incoming exec:cat FILE`` (what the
    node did before) vs ``fd:`` (an fd passed over QMP, what it does now);
  * create → first ``commands.run`` through the e2b SDK, without and with the
    warm pool (QEMU start and state load split out);
  * pause with 16 MiB dirtied; resume (a) → running and (b) → first command,
    with the standby QEMU and without; fork 16 → all answering → all first
    commands;
  * a guest busy-looping on all its vCPUs and touching all its RAM next to
    another sandbox: that sandbox's ``commands.run("true")`` p50/p90, idle
    neighbour vs busy neighbour, confined vs not;
  * host memory: PSS of ``--idle`` idle clones with the node's KSM settings;
    the memory cgroup of one confined clone (usage after create, after
    commands, after importing every stdlib module, after filling its RAM) next
    to its bound.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from _common import BenchError, machine_info, markdown_table, percentile, print_table, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aenv_store.store import Store  # noqa: E402
from aenv_vm import ksm  # noqa: E402
from aenv_vm.config import VmConfig  # noqa: E402
from aenv_vm.confine.cgroups import Layout, host_layout  # noqa: E402
from aenv_vm.guest import ensure_guest  # noqa: E402
from aenv_vm.qemu import migration  # noqa: E402
from aenv_vm.qemu.launcher import QemuProcess  # noqa: E402
from aenv_vm.blockimage.image import BlockImage  # noqa: E402
from aenv_vm.sandboxes.manager import SandboxManager  # noqa: E402
from aenv_vm.machine.machine import teardown  # noqa: E402
from aenv_vm.machine.plan import Disk, Greeting, MachinePlan, Restore  # noqa: E402
from aenv_vm.machine.spec import machine_spec  # noqa: E402
from aenv_vm.sandboxes.restore import restore_from_template, teardown_sandbox  # noqa: E402
from aenv_vm.sandboxes.sandbox import Sandbox  # noqa: E402
from aenv_vm.templates.base import build_template  # noqa: E402

from snapshot_bench import dirty, guest, settings_for  # noqa: E402
from vm_bench import first_command, memory  # noqa: E402

MODES = ("off", "auto")
BUSY = ("for i in $(seq $(nproc)); do nohup sh -c 'while :; do :; done' >/dev/null 2>&1 & done; "
        "nohup python3 -c \"n=int(open('/proc/meminfo').read().split('MemAvailable:')[1].split()[0])*1024-(24<<20)\n"
        "b=bytearray(n)\nwhile True:\n    b[::4096]=bytes([b[0]^1])*len(b[::4096])\" >/dev/null 2>&1 &")
HEAVY = r'''python3 - <<'PY'
import importlib, pkgutil
skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "pydoc_data", "ensurepip"}
for m in pkgutil.iter_modules():
    if not m.name.startswith("_") and m.name not in skip:
        try:
            importlib.import_module(m.name)
        except BaseException:
            pass
PY
ls -laR /usr/lib >/dev/null 2>&1; ps aux >/dev/null; tar cf - /usr/share 2>/dev/null | gzip -1 | wc -c'''


def ms(xs: list[float]) -> dict[str, float]:
    """summarize() in ms, with the p90 the tables show."""
    out = summarize([x * 1000 for x in xs])
    out["p90"] = percentile([x * 1000 for x in xs], 90)
    return out


# ---------------------------------------------------------------- parts

async def state_loads(mgr: SandboxManager, reps: int) -> dict[str, list[float]]:
    """Device-state load into a fresh clone QEMU: exec:cat (before) vs fd: (now). The
    exec: URI needs an unconfined QEMU (seccomp spawn=deny forbids it): the off node."""
    rt = mgr.rt
    tpl = mgr.template("base")
    mem, state = await rt.templates.files(tpl)
    out: dict[str, list[float]] = {"exec:cat": [], "fd:": []}
    for i in range(reps):
        for how in out:
            sid = f"load-{i}-{how[:2]}"
            rt.vm_dir(sid).mkdir(parents=True)
            image = await asyncio.to_thread(BlockImage.open, rt.store, tpl.disk, sid, upper_dir=rt.sandbox_dir(sid) / "upper")
            rt.nbd.add_export(image)
            await rt.nbd.listen(sid, rt.vm_dir(sid) / "nbd.sock")
            plan = MachinePlan.restore(sid, rt.sandbox_dir(sid), tpl.shape, mem, Restore(state), Disk(tpl.disk),
                                       Greeting({}, None, rt.ready_timeout))
            vm = await QemuProcess.start(machine_spec(rt, plan, await rt.networks.attach(sid), None))
            try:
                t0 = time.perf_counter()
                if how == "fd:":
                    await migration.load_device_state(vm, state)
                else:
                    assert vm.qmp is not None
                    await vm.qmp.execute("migrate-set-capabilities", {"capabilities": [
                        {"capability": "x-ignore-shared", "state": True}]})
                    await vm.qmp.execute("migrate-incoming", {"uri": f"exec:cat {shlex.quote(str(state))}"})
                    while (await migration.status(vm)) not in ("running", "paused"):
                        await asyncio.sleep(0.002)
                out[how].append(time.perf_counter() - t0)
            finally:
                await teardown(rt, sid, vm, image, rt.sandbox_dir(sid))
    return out


async def creates(mgrs: dict[str, SandboxManager], reps: int) -> dict[str, dict[str, list[dict]]]:
    """Create → first command: from the warm pool (``create``), and a clone restored
    on the spot (``restore_from_template``, what a create does when the pool is empty);
    the pool is full and idle during each measurement."""
    out: dict[str, dict[str, list[dict]]] = {m: {"nopool": [], "pool": []} for m in mgrs}
    for i in range(reps):
        for mode in MODES if i % 2 == 0 else tuple(reversed(MODES)):
            mgr = mgrs[mode]
            for pooled in (True, False):
                await mgr.fill_pool("base")
                t0 = time.perf_counter()
                sbx = await mgr.create("base") if pooled else await restore_from_template(mgr.rt, mgr.template("base"))
                cmd = await asyncio.to_thread(first_command, sbx)
                total = time.perf_counter() - t0
                t = sbx.timing
                assert t is not None and t.from_pool == pooled
                out[mode]["pool" if pooled else "nopool"].append(
                    {"total": total, "first_command": cmd, "qemu_start": t.qemu_start, "state_load": t.state_load})
                if pooled:
                    await mgr.kill(sbx.id)
                else:
                    await teardown_sandbox(mgr.rt, sbx)
    return out


async def pauses_resumes(mgrs: dict[str, SandboxManager], reps: int) -> dict[str, dict[str, list[dict]]]:
    out: dict[str, dict[str, list[dict]]] = {m: {"pause16": [], "standby": [], "fresh": []} for m in mgrs}
    sbxs = {m: await mgrs[m].create("base") for m in mgrs}
    for m in mgrs:
        await guest(sbxs[m], "true")
    for i in range(reps):
        for mode in MODES if i % 2 == 0 else tuple(reversed(MODES)):
            mgr = mgrs[mode]
            for kind in ("standby", "fresh"):
                mgr.standby_limit = 4 if kind == "standby" else 0
                await dirty(sbxs[mode], 16, 1 + (i % 250))
                await mgr.pause(sbxs[mode].id)
                t = mgr.last_pause
                assert t is not None
                out[mode]["pause16"].append({"total": t.total})
                await mgr.wait_committed(sbxs[mode].id)
                t0 = time.perf_counter()
                sbxs[mode] = await mgr.resume(sbxs[mode].id)
                call = time.perf_counter() - t0
                cmd = await asyncio.to_thread(first_command, sbxs[mode])
                r = mgr.last_resume
                assert r is not None
                out[mode][kind].append({"running": r.running, "first_command": call + cmd, "qemu_start": r.qemu_start})
    for m in mgrs:
        await mgrs[m].kill(sbxs[m].id)
    return out


async def forks(mgrs: dict[str, SandboxManager], count: int, rounds: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {m: [] for m in mgrs}
    for i in range(rounds):
        for mode in MODES if i % 2 == 0 else tuple(reversed(MODES)):
            mgr = mgrs[mode]
            parent = await mgr.create("base")
            await guest(parent, "true")
            t0 = time.perf_counter()
            kids = await mgr.fork(parent.id, count)
            answering = time.perf_counter() - t0
            ok = [k for k in kids if isinstance(k, Sandbox)]
            if len(ok) != count:
                raise BenchError(f"{count - len(ok)} fork children failed: {next(k for k in kids if not isinstance(k, Sandbox))}")
            await asyncio.gather(*(asyncio.to_thread(first_command, k) for k in ok))
            out[mode].append({"answering": answering, "all_first_command": time.perf_counter() - t0,
                              "load": os.getloadavg()[0]})
            for k in ok + [parent]:
                await mgr.kill(k.id)
    return out


def _command_latencies(sbx: Sandbox, n: int) -> list[float]:
    from e2b import Sandbox as E2BSandbox
    client = E2BSandbox.create(debug=True, sandbox_url=sbx.envd_url, api_key="bench")
    client.commands.run("true")
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        if client.commands.run("true").exit_code != 0:
            raise BenchError("commands.run('true') failed")
        out.append(time.perf_counter() - t0)
    return out


async def busy_neighbour(mgrs: dict[str, SandboxManager], n: int) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for mode in MODES:
        mgr = mgrs[mode]
        neighbour = await mgr.create("base")
        busy = await mgr.create("busy")
        await guest(neighbour, "true")
        await guest(busy, "true")
        await mgr.fill_pool("base")      # no refill running meanwhile
        idle = await asyncio.to_thread(_command_latencies, neighbour, n)
        await guest(busy, BUSY)
        await asyncio.sleep(3)          # the hog has its RAM and the loops run
        cpu0, t0 = _cpu(busy.vm.pid), time.perf_counter()
        loaded = await asyncio.to_thread(_command_latencies, neighbour, n)
        busy_cpus = (_cpu(busy.vm.pid) - cpu0) / (time.perf_counter() - t0)
        out[mode] = {"idle": idle, "busy": loaded, "busy_qemu_cpus": busy_cpus, "busy_vcpus": busy.vm.spec.vcpus,
                     "busy_rss_mib": _rss_mib(busy.vm.pid)}
        for s in (neighbour, busy):
            await mgr.kill(s.id)
    return out


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _memcg(pid: int) -> dict[str, float]:
    """The QEMU's memory cgroup: usage, peak and bound (MiB), v1 or v2."""
    layout = host_layout()
    if not isinstance(layout, Layout):
        return {}
    own = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in (names.split(",") if names else [""]):
            own[name] = path
    h = next(h for h in layout.hierarchies if "memory" in h.controllers)
    d = h.mountpoint / own["memory" if h.version.value == 1 else ""].lstrip("/")
    files = (("usage", "memory.usage_in_bytes", "memory.current"), ("peak", "memory.max_usage_in_bytes", "memory.peak"),
             ("bound", "memory.limit_in_bytes", "memory.max"))
    out = {}
    for key, v1, v2 in files:
        f = d / (v1 if h.version.value == 1 else v2)
        if f.exists():
            out[key] = int(f.read_text()) / 2**20
    return out


async def memcg_of_a_clone(mgr: SandboxManager) -> list[tuple[str, dict[str, float]]]:
    sbx = await mgr.create("base")
    rows = [("after create", _memcg(sbx.vm.pid))]
    for _ in range(5):
        await guest(sbx, "true")
    rows.append(("after 5 commands", _memcg(sbx.vm.pid)))
    await guest(sbx, HEAVY)
    rows.append(("after importing every stdlib module, ls -R, tar | gzip", _memcg(sbx.vm.pid)))
    await sbx.envd.run("python3 -c \"n=int(open('/proc/meminfo').read().split('MemAvailable:')[1].split()[0])*1024"
                       "-(16<<20); b=bytearray(n)\"", user="root", timeout=300)
    rows.append(("after allocating all its free RAM", _memcg(sbx.vm.pid)))
    await mgr.kill(sbx.id)
    return rows


# ---------------------------------------------------------------- run and report

async def main_async(args: argparse.Namespace) -> dict:
    with ksm.knobs_restored():
        return await _run(args)


async def _run(args: argparse.Namespace) -> dict:
    guest_img = ensure_guest()
    node_ksm = VmConfig().ksm_settings()
    with tempfile.TemporaryDirectory(prefix="aenv-isolation-bench-") as tmp:
        work = Path(tmp)
        with Store.open(settings_for(work / "data"), create=True) as store:
            await build_template(store, guest_img, work / "tpl", alias="base", memory_mib=256)
            await build_template(store, guest_img, work / "tpl2", alias="busy", memory_mib=256, vcpus=2)
            res: dict = {"machine": machine_info()}
            async with SandboxManager(store, guest_img, work / "n-off", ksm=node_ksm, confine="off", pool_size=1) as off, \
                    SandboxManager(store, guest_img, work / "n-on", ksm=node_ksm, confine="auto",
                                   pool_size=1) as on:
                mgrs = {"off": off, "auto": on}
                res["confinement"] = on.confinement.summary()
                res["state_load"] = await state_loads(off, args.reps * 2)
                print("[bench] state loads done", file=sys.stderr)
                res["create"] = await creates(mgrs, args.reps)
                print("[bench] creates done", file=sys.stderr)
                res["pause_resume"] = await pauses_resumes(mgrs, args.reps // 2 or 1)
                print("[bench] pauses and resumes done", file=sys.stderr)
                res["fork"] = await forks(mgrs, args.fork, 2)
                print("[bench] forks done", file=sys.stderr)
                res["busy"] = await busy_neighbour(mgrs, args.commands)
                print("[bench] busy neighbour done", file=sys.stderr)
                res["memcg"] = await memcg_of_a_clone(on)
                res["pss"] = {m: await memory(mgrs[m], args.idle) for m in MODES}
                res["idle"] = args.idle
                print("[bench] memory done", file=sys.stderr)
    return res


def report(res: dict, markdown: bool) -> None:
    def table(rows: list[list[object]], header: list[str]) -> None:
        if markdown:
            print(markdown_table(rows, header))
            print()
        else:
            print_table(rows, header)

    s = {k: ms(v) for k, v in res["state_load"].items()}
    table([[k, f"{v['p50']:.1f}", f"{v['p90']:.1f}", int(v["n"])] for k, v in s.items()],
          ["device-state load of a clone (ms)", "p50", "p90", "n"])
    rows = []
    for part, what, key, field in (
            ("create", "create (no pool) → first commands.run", "nopool", "total"),
            ("create", "  of which QEMU start", "nopool", "qemu_start"),
            ("create", "  of which state load", "nopool", "state_load"),
            ("create", "create from the warm pool → first commands.run", "pool", "total"),
            ("pause_resume", "pause, 16 MiB dirtied", "pause16", "total"),
            ("pause_resume", "resume (a) → running, standby QEMU", "standby", "running"),
            ("pause_resume", "resume (b) → first commands.run, standby QEMU", "standby", "first_command"),
            ("pause_resume", "resume (a) → running, fresh QEMU", "fresh", "running"),
            ("pause_resume", "resume (b) → first commands.run, fresh QEMU", "fresh", "first_command")):
        a, b = (ms([r[field] for r in res[part][m][key]]) for m in MODES)
        rows.append([what, f"{a['p50']:.0f} / {a['p90']:.0f}", f"{b['p50']:.0f} / {b['p90']:.0f}", int(a["n"])])
    f = res["fork"]
    for what, field in (("fork 16 → all answering", "answering"), ("fork 16 → every child's first command",
                                                                     "all_first_command")):
        a = ms([r[field] for r in f["off"]])
        rows.append([what, " / ".join(f"{r[field] * 1000:.0f}" for r in f["off"]),
                     " / ".join(f"{r[field] * 1000:.0f}" for r in f["auto"]), int(a["n"])])
    table(rows, ["ms (p50 / p90; fork: each run)", "confine = off", "confine = auto", "n"])
    rows = []
    for m in MODES:
        b = res["busy"][m]
        i, l_ = ms(b["idle"]), ms(b["busy"])
        rows.append([m, f"{i['p50']:.0f} / {i['p90']:.0f}", f"{l_['p50']:.0f} / {l_['p90']:.0f}",
                     f"{l_['p50'] / i['p50']:.2f}×", f"{b['busy_qemu_cpus']:.2f} of {b['busy_vcpus']} vCPUs",
                     f"{b['busy_rss_mib']:.0f} MiB"])
    table(rows, ["neighbour's commands.run ms (p50 / p90)", "idle neighbour", "busy neighbour", "p50 ratio",
                 "busy QEMU's CPU", "busy QEMU's RSS"])
    table([[what, *(f"{v.get(k, 0):.0f}" for k in ("usage", "peak", "bound"))] for what, v in res["memcg"]],
          ["memory cgroup of one confined clone (MiB)", "usage", "peak", "bound"])
    rows = []
    for m in MODES:
        p = res["pss"][m]
        rows.append([m, f"{p['pss_single_kib'] / 1024:.1f}", f"{p['pss_idle_total_kib'] / 1024:.1f}",
                     f"{p['pss_idle_total_kib'] / p['pss_single_kib'] / res['idle']:.2f}"])
    table(rows, ["host PSS, [vm] ksm (MiB)", "1 idle sandbox", f"{res['idle']} idle sandboxes",
                 f"{res['idle']} idle / ({res['idle']} × one)"])
    m = res["machine"]
    print(f"{m['cpus']} × {m['cpu']}, {m['memory']}; TCG; confinement: {res['confinement']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--fork", type=int, default=16)
    p.add_argument("--idle", type=int, default=8)
    p.add_argument("--commands", type=int, default=30, help="neighbour's commands per phase")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("isolation_bench needs root (confinement, /proc/PID/mem, ksmd)")
    res = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    report(res, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
