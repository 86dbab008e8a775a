"""MicroVM sandboxes: cold boot vs create-from-template, warm pool, host memory.

    sudo .venv/bin/python benchmarks/vm_bench.py [--creates 20] [--cold 3] [--idle 10] [--tcg-tb-mib N] [--markdown]

One run: builds (or finds cached) the guest, builds a template in a temporary
store, then measures
  * cold boot of the base image (root disk over aenv's NBD server) to envd /health;
  * create-from-template to the first successful ``commands.run("true")``
    through the real e2b SDK, without the pool (split into QEMU start, device
    state load, first envd answer, identity /init, /init, first command) and
    with a warm pool (the pool is allowed to refill between creates), plus the
    CPU time the sandbox's QEMU used over that span (load-independent) and
    the host's load average;
  * host memory: PSS (``/proc/PID/smaps_rollup``) of one idle sandbox alone,
    then summed over ``--idle`` idle sandboxes from the same template. Every
    sandbox measured was created without the pool and ran one
    ``commands.run("true")`` through the SDK, then sat idle for 2 s; one
    sandbox's PSS is split by mapping (TCG code buffer, template memory file:
    pages it wrote and pages it shares, the rest of QEMU). Measured twice in
    the same run: with QEMU's defaults and ksmd stopped, and with the node's
    default ``[vm] ksm`` settings (whole-process KSM, fixed layout, ksmd at the
    configured rate, after it finished 3 full scans; its CPU is reported).
    The creates use the node's default KSM settings too (``--no-ksm``: not).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from aenv_vm.blockimage.image import BlockImage  # noqa: E402
from aenv_vm.config import VmConfig  # noqa: E402
from aenv_vm.ksm import KsmSettings  # noqa: E402
from aenv_vm.blockimage.nbd_server import NbdServer  # noqa: E402
from aenv_vm.envd_client import wait_http_ok  # noqa: E402
from aenv_vm.guest import GuestImage, ensure_guest, kernel_cmdline  # noqa: E402
from aenv_vm.qemu.launcher import NbdDisk, QemuProcess, VmSpec, free_port  # noqa: E402
from aenv_vm.sandboxes.manager import SandboxManager  # noqa: E402
from aenv_vm.sandboxes.sandbox import Sandbox  # noqa: E402
from aenv_vm.templates.base import base_layer, build_template  # noqa: E402
from aenv_vm.templates.template import Template  # noqa: E402


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise BenchError(f"no Pss in /proc/{pid}/smaps_rollup")


def pss_kib_without_tcg(pid: int) -> int:
    """PSS minus TCG's translated-code buffer (the anonymous rwx mapping): what the
    same process would roughly cost under KVM, which translates nothing."""
    total = 0
    skip = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            skip = fields[1] == "rwxp" and len(fields) == 5  # no path: anonymous
        elif line.startswith("Pss:") and not skip:
            total += int(fields[1])
    return total


def pss_split_kib(pid: int) -> dict[str, int]:
    """One QEMU's PSS by mapping: TCG's code buffer (anonymous rwx), the template's
    memory file (pages this clone wrote = private COW, the rest shared page cache),
    everything else (QEMU's heap and TCG state, binaries, libraries)."""
    out = {"tcg_code": 0, "guest_written": 0, "guest_shared": 0, "qemu_other": 0}
    kind = "qemu_other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            if fields[1] == "rwxp" and len(fields) == 5:
                kind = "tcg_code"
            elif len(fields) > 5 and fields[5].endswith("/memory"):
                kind = "guest"
            else:
                kind = "qemu_other"
        elif kind == "guest" and line.startswith("Pss:"):
            out["guest_shared"] += int(fields[1])
        elif kind == "guest" and line.startswith("Private_Dirty:"):
            out["guest_written"] += int(fields[1])
            out["guest_shared"] -= int(fields[1])
        elif line.startswith("Pss:"):
            out[kind] += int(fields[1])
    return out


def cpu_ms(pid: int) -> float:
    """User + system CPU time of a process (all its threads), ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def first_command(sbx: Sandbox, token: str | None = None) -> float:
    from e2b import Sandbox as E2BSandbox

    t0 = time.perf_counter()
    if token is None:
        client = E2BSandbox.create(debug=True, sandbox_url=sbx.envd_url, api_key="bench")
    else:  # what Sandbox.create does with the API's answer for a secured sandbox
        from e2b.connection_config import ConnectionConfig
        from e2b.envd.versions import ENVD_DEBUG_FALLBACK

        config = ConnectionConfig(debug=True, sandbox_url=sbx.envd_url, api_key="bench",
                                  extra_sandbox_headers={"X-Access-Token": token})
        client = E2BSandbox(sandbox_id=sbx.id, sandbox_domain=None, envd_version=ENVD_DEBUG_FALLBACK,
                            envd_access_token=token, connection_config=config)
    cmd = "true" if token is None else '[ "$BENCH" = 1 ]'  # /init's env var arrived (a builtin, as cheap)
    result = client.commands.run(cmd)
    if result.exit_code != 0:
        raise BenchError(f"commands.run({cmd!r}) exited {result.exit_code}")
    return time.perf_counter() - t0


async def cold_boots(store: Store, guest: GuestImage, tpl: Template, work: Path, n: int) -> list[float]:
    out = []
    layer = base_layer(store, guest)
    for i in range(n):
        d = work / f"cold{i}"
        image = BlockImage.open(store, layer, "cold", upper_dir=d / "upper")
        server = NbdServer(d / "nbd.sock")
        server.add_export(image)
        await server.start()
        spec = VmSpec(name="cold", kernel=guest.kernel, initrd=guest.initrd, kernel_cmdline=kernel_cmdline(),
                      run_dir=d / "run", memory_mib=tpl.memory_mib, vcpus=tpl.vcpus, mem_path=d / "memory",
                      disk=NbdDisk(server.socket_path, "cold"), host_port=free_port())
        try:
            t0 = time.perf_counter()
            vm = await QemuProcess.start(spec)
            try:
                await wait_http_ok("127.0.0.1", spec.host_port or 0, "/health", timeout=300, alive=vm.alive)
                out.append(time.perf_counter() - t0)
            finally:
                await vm.stop()
        finally:
            await server.close()
            image.close()
        print(f"cold boot {i + 1}/{n}: {out[-1]:.2f} s", file=sys.stderr)
    return out


VARIANTS = ("nopool", "pool", "pool_init")


async def one_create(mgr: SandboxManager, pooled: bool, with_init: bool, i: int) -> dict[str, float]:
    """One create → first successful commands.run. ``with_init``: create with an env
    var and an access token, as a create through the API does (the SDK's default is a
    secured sandbox), so envd /init runs."""
    warm = 0.0
    cpu0: float | None = None
    if pooled:
        waiting = mgr.pooled("base")
        if not waiting:
            raise BenchError("the pool was empty at create time")
        assert waiting[0].timing is not None
        warm, cpu0 = waiting[0].timing.warm, cpu_ms(waiting[0].vm.pid)
    t0 = time.perf_counter()
    token = f"tok{i}" if with_init else None
    sbx = await mgr.create("base", env_vars={"BENCH": "1"} if with_init else None, access_token=token)
    first = await asyncio.to_thread(first_command, sbx, token)
    total = time.perf_counter() - t0
    t = sbx.timing
    assert t is not None and t.from_pool == pooled
    # no pool: CPU since QEMU started (restore included); pool: since create was called
    cpu = cpu_ms(sbx.vm.pid) - (cpu0 or 0.0)
    await mgr.kill(sbx.id)
    return {"qemu_start": t.qemu_start, "state_load": t.state_load, "first_answer": t.first_answer,
            "identity": t.identity, "init": t.init, "first_command": first, "total": total,
            "from_pool": float(t.from_pool), "warm": warm, "qemu_cpu": cpu / 1000, "load": os.getloadavg()[0]}


async def creates(plain: SandboxManager, pooled: SandboxManager, n: int) -> dict[str, list[dict[str, float]]]:
    """``n`` creates of each variant, interleaved (rotating order) so that every
    variant sees the same phases of this shared machine's load. Before each create
    the pool is full and no refill is running: nothing else of ours competes."""
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for i in range(n):
        for k in range(len(VARIANTS)):
            variant = VARIANTS[(i + k) % len(VARIANTS)]
            await pooled.fill_pool("base")
            mgr = plain if variant == "nopool" else pooled
            row = await one_create(mgr, variant != "nopool", variant == "pool_init", i)
            rows[variant].append(row)
            print(f"create {variant} {i + 1}/{n}: {row['total'] * 1000:.0f} ms", file=sys.stderr)
    return rows


async def used_sandbox(mgr: SandboxManager) -> Sandbox:
    """A sandbox as a user has it after creating it and running one command."""
    sbx = await mgr.create("base")
    await asyncio.to_thread(first_command, sbx)
    return sbx


async def settle(settings: KsmSettings | None) -> dict[str, float]:
    """Let an idle group settle: 2 s without KSM; with KSM until ksmd finished 3 more
    full scans at the node's configured rate (pages merge on the second scan that sees
    them unchanged), reporting ksmd's CPU over that time."""
    if settings is None:
        await asyncio.sleep(2)
        return {}
    cpu0, t0 = ksm.ksmd_cpu_seconds() or 0.0, time.perf_counter()
    scans = await ksm.wait_full_scans(3, timeout=600)
    await asyncio.sleep(2)
    wall = time.perf_counter() - t0
    return {"settle_s": wall, "scans": scans, "ksmd_cpu_pct": 100 * ((ksm.ksmd_cpu_seconds() or 0.0) - cpu0) / wall}


async def memory(mgr: SandboxManager, idle: int) -> dict:
    """PSS of one idle sandbox alone, then of ``idle`` idle sandboxes together, in
    ``mgr``'s KSM configuration. KSM is host-wide: without it, ksmd is stopped and
    everything merged is unmerged first, so that QEMU's own guest-RAM marking merges
    nothing either; with it, the node's settings start ksmd."""
    settings = mgr.ksm
    if settings is None:
        ksm.unmerge_all()
    else:
        ksm.enable(settings)
    one = await used_sandbox(mgr)
    solo = await settle(settings)
    single, single_nt, split = pss_kib(one.vm.pid), pss_kib_without_tcg(one.vm.pid), pss_split_kib(one.vm.pid)
    await mgr.kill(one.id)
    sbxs = [await used_sandbox(mgr) for _ in range(idle)]
    group = await settle(settings)
    total = sum(pss_kib(s.vm.pid) for s in sbxs)
    total_nt = sum(pss_kib_without_tcg(s.vm.pid) for s in sbxs)
    split_in_ten = pss_split_kib(sbxs[0].vm.pid)
    for s in sbxs:
        await mgr.kill(s.id)
    return {"pss_single_kib": single, "pss_idle_total_kib": total, "pss_single_no_tcg_kib": single_nt,
            "pss_idle_total_no_tcg_kib": total_nt, "split_single_kib": split, "split_in_group_kib": split_in_ten,
            "settle_single": solo, "settle_group": group}


async def main_async(args: argparse.Namespace) -> dict:
    """Runs the bench; the host's KSM knobs (the nodes here set them) are put back after."""
    with ksm.knobs_restored():
        return await _run(args)


async def _run(args: argparse.Namespace) -> dict:
    guest = ensure_guest()
    with tempfile.TemporaryDirectory(prefix="aenv-vm-bench-") as tmp:
        work = Path(tmp)
        settings = StoreSettings(paths=StorePaths(work / "data"), repository=RepositoryConfig(),
                                 store=StoreConfig(), cache=CacheConfig(capacity=8 << 30, min_free_disk=0))
        with Store.open(settings, create=True) as store:
            t0 = time.perf_counter()
            tpl = await build_template(store, guest, work / "tpl", alias="base", memory_mib=args.memory_mib)
            template_s = time.perf_counter() - t0
            cold = await cold_boots(store, guest, tpl, work, args.cold)
            tb = args.tcg_tb_mib
            node_ksm = None if args.no_ksm else VmConfig().ksm_settings()   # what `aenv server` uses
            async with SandboxManager(store, guest, work / "node", tcg_tb_mib=tb, ksm=node_ksm,
                                  network=args.network) as plain, \
                    SandboxManager(store, guest, work / "node-pool", pool_size=args.pool, tcg_tb_mib=tb,
                                   ksm=node_ksm, network=args.network) as pooled:
                rows = await creates(plain, pooled, args.creates)
            mem = {}
            for label, settings in (("plain", None), ("ksm", VmConfig().ksm_settings())):
                async with SandboxManager(store, guest, work / f"m-{label}", tcg_tb_mib=tb, ksm=settings,
                                          network=args.network) as mgr:
                    mem[label] = await memory(mgr, args.idle)
    return {"machine": machine_info(), "template_build_s": template_s, "cold": cold, **rows, "idle": args.idle, "memory_mib": args.memory_mib, "tcg_tb_mib": tb,
            "create_ksm": node_ksm is not None, "mem": mem}


def report(res: dict, markdown: bool) -> None:
    ms = lambda xs: summarize([x * 1000 for x in xs])  # noqa: E731
    rows = []
    if res["cold"]:  # --cold 0 skips them
        c = ms(res["cold"])
        rows.append(["cold boot to /health (NBD root)", f"{c['p50']:.0f}", f"{c['p99']:.0f}", int(c["n"])])
    for label, key in (("create → first commands.run, no pool", "nopool"),
                       ("create → first commands.run, warm pool", "pool"),
                       ("same, create with env var + access token (/init runs)", "pool_init")):
        s = ms([r["total"] for r in res[key]])
        rows.append([label, f"{s['p50']:.0f}", f"{s['p99']:.0f}", int(s["n"])])
    labels = {"identity": "identity (/init)", "qemu_cpu": "QEMU CPU time, restore to first command done",
              "warm": "warm-up before hand-out (off the create path)"}
    parts = ("qemu_start", "state_load", "first_answer", "identity", "init", "first_command")
    labels["setup"] = "setup (template lookup, upper disk layer, NBD export: rest of the total)"
    for r in res["nopool"]:
        r["setup"] = r["total"] - sum(r[p] for p in parts)
    for part in (*parts, "setup", "qemu_cpu"):
        s = ms([r[part] for r in res["nopool"]])
        rows.append([f"  no pool: {labels.get(part, part.replace('_', ' '))}", f"{s['p50']:.0f}", f"{s['p99']:.0f}",
                     int(s["n"])])
    labels["qemu_cpu"] = "QEMU CPU time, create to first command done"
    for key, part in (("pool", "first_command"), ("pool", "qemu_cpu"), ("pool", "warm"), ("pool_init", "init"),
                      ("pool_init", "first_command"), ("pool_init", "qemu_cpu")):
        s = ms([r[part] for r in res[key]])
        what = "pool" if key == "pool" else "pool + /init"
        rows.append([f"  {what}: {labels.get(part, part.replace('_', ' '))}", f"{s['p50']:.0f}", f"{s['p99']:.0f}",
                     int(s["n"])])
    header = ["what (ms)", "p50", "p99", "n"]
    names = {"tcg_code": "TCG translated code (private)", "guest_written": "guest pages written since restore (private COW)",
             "guest_shared": "template memory pages read (shared page cache)",
             "qemu_other": "rest of QEMU (heap, TCG tables, binaries, libraries)"}
    n = res["idle"]
    mem_header = ["host memory (PSS of QEMU)", "QEMU defaults (no KSM)", "[vm] ksm (node default)"]
    split_header = ["one sandbox's PSS (MiB)", "alone", f"one of {n}", "alone, ksm", f"one of {n}, ksm"]
    mems = [res["mem"][k] for k in ("plain", "ksm")]
    mib = lambda kib: f"{kib / 1024:.1f} MiB"  # noqa: E731
    mem = [[f"1 idle sandbox ({res['memory_mib']} MiB guest)", *(mib(m["pss_single_kib"]) for m in mems)],
           [f"{n} idle sandboxes, one template", *(mib(m["pss_idle_total_kib"]) for m in mems)],
           [f"{n} × one sandbox", *(mib(n * m["pss_single_kib"]) for m in mems)],
           ["ratio", *(f"{m['pss_idle_total_kib'] / (n * m['pss_single_kib']) * 100:.1f}%" for m in mems)],
           ["ratio without TCG's code buffer (≈ KVM)",
            *(f"{m['pss_idle_total_no_tcg_kib'] / (n * m['pss_single_no_tcg_kib']) * 100:.1f}%" for m in mems)]]
    g = res["mem"]["ksm"]["settle_group"]
    mem.append(["ksmd: time to 3 full scans (group) / CPU of one core meanwhile", "",
                f"{g['settle_s']:.0f} s / {g['ksmd_cpu_pct']:.1f}%"])
    split = [[names[k], *(f"{m[part][k] / 1024:.1f}" for m in mems for part in ("split_single_kib", "split_in_group_kib"))]
             for k in names]
    if markdown:
        print(markdown_table(rows, header))
        print()
        print(markdown_table(mem, mem_header))
        print()
        print(markdown_table(split, split_header))
    else:
        print_table(rows, header)
        print_table(mem, mem_header)
        print_table(split, split_header)
    m = res["machine"]
    loads = [r["load"] for r in res["nopool"] + res["pool"] + res["pool_init"]]
    print(f"\n{m['cpus']} × {m['cpu']}, {m['memory']}, load average during the creates "
          f"{min(loads):.1f}-{max(loads):.1f}; template build {res['template_build_s']:.1f} s; TCG, "
          f"tb-size {res['tcg_tb_mib'] or 'default'}; creates {'with' if res['create_ksm'] else 'without'} "
          f"the node's KSM settings")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--creates", type=int, default=20)
    p.add_argument("--cold", type=int, default=3)
    p.add_argument("--idle", type=int, default=10)
    p.add_argument("--pool", type=int, default=1)
    p.add_argument("--memory-mib", type=int, default=256)
    p.add_argument("--tcg-tb-mib", type=int, default=None, help="TCG translation buffer (default: QEMU's)")
    p.add_argument("--no-ksm", action="store_true", help="creates without the node's default KSM settings")
    p.add_argument("--network", choices=("auto", "user", "tap"), default="auto",
                   help="[vm] network of the node (default: auto, what `aenv server` uses)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = p.parse_args()
    try:
        res = asyncio.run(main_async(args))
    except BenchError as e:
        print(f"vm_bench: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    report(res, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
