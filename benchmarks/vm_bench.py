"""MicroVM sandboxes: cold boot vs create-from-template, warm pool, host memory.

    sudo .venv/bin/python benchmarks/vm_bench.py [--creates 20] [--cold 3] [--idle 10] [--markdown]

One run: builds (or finds cached) the guest, builds a template in a temporary
store, then measures
  * cold boot of the base image (root disk over aenv's NBD server) to envd /health;
  * create-from-template to the first successful ``commands.run("true")``
    through the real e2b SDK, without the pool (split into QEMU start, device
    state load, first envd answer, /init, first command) and with a warm pool
    (the pool is allowed to refill between creates);
  * host memory: PSS (``/proc/PID/smaps_rollup``) of one idle sandbox alone,
    then summed over ``--idle`` idle sandboxes from the same template.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from _common import BenchError, machine_info, markdown_table, print_table, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings  # noqa: E402
from aenv_store.store import Store  # noqa: E402
from aenv_vm.blockimage.image import BlockImage  # noqa: E402
from aenv_vm.blockimage.nbd_server import NbdServer  # noqa: E402
from aenv_vm.guest import GuestImage, ensure_guest, kernel_cmdline, wait_http_ok  # noqa: E402
from aenv_vm.qemu.launcher import NbdDisk, QemuProcess, VmSpec, free_port  # noqa: E402
from aenv_vm.sandbox import Sandbox, SandboxManager  # noqa: E402
from aenv_vm.template import Template, base_layer, build_template  # noqa: E402


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


def first_command(sbx: Sandbox) -> float:
    from e2b import Sandbox as E2BSandbox

    t0 = time.perf_counter()
    client = E2BSandbox.create(debug=True, sandbox_url=sbx.envd_url, api_key="bench")
    result = client.commands.run("true")
    if result.exit_code != 0:
        raise BenchError(f"commands.run('true') exited {result.exit_code}")
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
                await wait_http_ok(spec.host_port or 0, "/health", timeout=300, alive=vm.alive)
                out.append(time.perf_counter() - t0)
            finally:
                await vm.stop()
        finally:
            await server.close()
            image.close()
        print(f"cold boot {i + 1}/{n}: {out[-1]:.2f} s", file=sys.stderr)
    return out


async def creates(mgr: SandboxManager, n: int, pooled: bool) -> list[dict[str, float]]:
    rows = []
    for i in range(n):
        if pooled:
            await mgr.fill_pool("base")  # steady state: the pool had time to refill
        t0 = time.perf_counter()
        sbx = await mgr.create("base")
        first = await asyncio.to_thread(first_command, sbx)
        total = time.perf_counter() - t0
        t = sbx.timing
        assert t is not None
        rows.append({"qemu_start": t.qemu_start, "state_load": t.state_load, "first_answer": t.first_answer,
                     "identity": t.identity, "init": t.init, "first_command": first, "total": total, "from_pool": float(t.from_pool)})
        await mgr.kill(sbx.id)
        print(f"create {'pool' if pooled else 'no-pool'} {i + 1}/{n}: {total * 1000:.0f} ms", file=sys.stderr)
    return rows


async def memory(mgr: SandboxManager, idle: int) -> tuple[int, int, int, int]:
    one = await mgr.create("base")
    await asyncio.sleep(2)
    single, single_nt = pss_kib(one.vm.pid), pss_kib_without_tcg(one.vm.pid)
    await mgr.kill(one.id)
    sbxs = [await mgr.create("base") for _ in range(idle)]
    await asyncio.sleep(2)
    total = sum(pss_kib(s.vm.pid) for s in sbxs)
    total_nt = sum(pss_kib_without_tcg(s.vm.pid) for s in sbxs)
    for s in sbxs:
        await mgr.kill(s.id)
    return single, total, single_nt, total_nt


async def main_async(args: argparse.Namespace) -> dict:
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
            async with SandboxManager(store, guest, work / "node") as mgr:
                nopool = await creates(mgr, args.creates, pooled=False)
            async with SandboxManager(store, guest, work / "node-pool", pool_size=args.pool) as mgr:
                pool = await creates(mgr, args.creates, pooled=True)
            async with SandboxManager(store, guest, work / "node-mem") as mgr:
                single, total, single_nt, total_nt = await memory(mgr, args.idle)
    return {"machine": machine_info(), "template_build_s": template_s, "cold": cold, "nopool": nopool,
            "pool": pool, "pss_single_kib": single, "pss_idle_total_kib": total, "idle": args.idle,
            "pss_single_no_tcg_kib": single_nt, "pss_idle_total_no_tcg_kib": total_nt,
            "memory_mib": args.memory_mib}


def report(res: dict, markdown: bool) -> None:
    ms = lambda xs: summarize([x * 1000 for x in xs])  # noqa: E731
    rows = []
    c = ms(res["cold"])
    rows.append(["cold boot to /health (NBD root)", f"{c['p50']:.0f}", f"{c['p99']:.0f}", int(c["n"])])
    for label, key in (("create → first commands.run, no pool", "nopool"),
                       ("create → first commands.run, warm pool", "pool")):
        s = ms([r["total"] for r in res[key]])
        rows.append([label, f"{s['p50']:.0f}", f"{s['p99']:.0f}", int(s["n"])])
    for part in ("qemu_start", "state_load", "first_answer", "identity", "init", "first_command"):
        s = ms([r[part] for r in res["nopool"]])
        rows.append([f"  no pool: {part.replace('_', ' ')}", f"{s['p50']:.0f}", f"{s['p99']:.0f}", int(s["n"])])
    for part in ("init", "first_command"):
        s = ms([r[part] for r in res["pool"]])
        rows.append([f"  pool: {part.replace('_', ' ')}", f"{s['p50']:.0f}", f"{s['p99']:.0f}", int(s["n"])])
    header = ["what (ms)", "p50", "p99", "n"]
    ratio = res["pss_idle_total_kib"] / (res["idle"] * res["pss_single_kib"])
    mem = [[f"1 idle sandbox ({res['memory_mib']} MiB guest)", f"{res['pss_single_kib'] / 1024:.1f} MiB"],
           [f"{res['idle']} idle sandboxes, one template", f"{res['pss_idle_total_kib'] / 1024:.1f} MiB"],
           [f"{res['idle']} × one sandbox", f"{res['idle'] * res['pss_single_kib'] / 1024:.1f} MiB"],
           ["ratio", f"{ratio * 100:.0f}%"],
           ["ratio without TCG's code buffer (≈ KVM)",
            f"{res['pss_idle_total_no_tcg_kib'] / (res['idle'] * res['pss_single_no_tcg_kib']) * 100:.0f}%"]]
    if markdown:
        print(markdown_table(rows, header))
        print()
        print(markdown_table(mem, ["host memory (PSS of QEMU)", "value"]))
    else:
        print_table(rows, header)
        print_table(mem, ["host memory (PSS of QEMU)", "value"])
    m = res["machine"]
    print(f"\n{m['cpus']} × {m['cpu']}, {m['memory']}, load {m['loadavg']}; template build "
          f"{res['template_build_s']:.1f} s; TCG")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--creates", type=int, default=20)
    p.add_argument("--cold", type=int, default=3)
    p.add_argument("--idle", type=int, default=10)
    p.add_argument("--pool", type=int, default=1)
    p.add_argument("--memory-mib", type=int, default=256)
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
