"""What a bigger ``base`` guest costs: two guest builds side by side in one run.

    sudo .venv/bin/python benchmarks/base_bench.py GUEST_JSON [GUEST_JSON ...] [--rounds 2] [--creates 5]

Each GUEST_JSON is a guest description (``<guest cache>/guest.json``, or a copy
of an older one). For every guest, alternating per round so both see the same
load: the store import of its root disk as a base layer (into a fresh store),
the template build (cold boot, envd, snapshot, commit), then ``--creates``
sandboxes without a pool: create → first ``commands.run("true")`` as ``user``
(the SDK's default user), and in the first of them ``python -c pass`` and
``node -e 0`` (what a first agent command pays under TCG). Prints a table,
``--json`` writes the raw numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings  # noqa: E402
from aenv_store.store import Store  # noqa: E402
from aenv_vm.blockimage.importer import import_raw  # noqa: E402
from aenv_vm.guest import GuestImage  # noqa: E402
from aenv_vm.sandboxes.manager import SandboxManager  # noqa: E402
from aenv_vm.templates.base import build_template  # noqa: E402


async def one_guest(guest: GuestImage, work: Path, creates: int) -> dict:
    settings = StoreSettings(paths=StorePaths(work / "data"), repository=RepositoryConfig(), store=StoreConfig(),
                             cache=CacheConfig(capacity=16 << 30, min_free_disk=0))
    out: dict = {"guest": guest.key, "rootfs_allocated_mib": guest.rootfs.stat().st_blocks * 512 >> 20}
    with Store.open(settings, create=True) as store:
        t0 = time.perf_counter()
        imported = await asyncio.to_thread(import_raw, store, guest.rootfs, f"guest-{guest.key}",
                                           {"guest_key": guest.key}, False)
        out["import_s"] = time.perf_counter() - t0
        out["import_data_mib"] = imported.data_bytes >> 20
        t0 = time.perf_counter()
        await build_template(store, guest, work / "tpl", alias="base", memory_mib=256)
        out["template_build_s"] = time.perf_counter() - t0
        firsts, extra = [], {}
        async with SandboxManager(store, guest, work / "node") as mgr:
            for i in range(creates):
                t0 = time.perf_counter()
                sbx = await mgr.create("base")
                res = await sbx.envd.run("true", user="user", timeout=120.0)
                firsts.append(time.perf_counter() - t0)
                assert res.exit_code == 0, res
                if i == 0:
                    for name, cmd in (("python_c_pass_s", "python3 -c pass"), ("node_e_0_s", "node -e 0")):
                        t1 = time.perf_counter()
                        r = await sbx.envd.run(cmd, user="user", timeout=300.0)
                        extra[name] = time.perf_counter() - t1 if r.exit_code == 0 else None
                await mgr.kill(sbx.id)
        out["create_first_cmd_s"] = firsts
        out.update(extra)
    return out


async def main_async(args: argparse.Namespace) -> list[dict]:
    guests = [GuestImage.from_json(json.loads(Path(p).read_text())) for p in args.guests]
    results = []
    for r in range(args.rounds):
        for guest in guests:
            with tempfile.TemporaryDirectory(prefix="aenv-base-bench-") as tmp:
                res = await one_guest(guest, Path(tmp), args.creates)
                res["round"] = r
                results.append(res)
                print(json.dumps(res), file=sys.stderr, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("guests", nargs="+")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--creates", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("| guest | rootfs allocated MiB | import s | template build s | create → first command s (p50) "
          "| python -c pass s | node -e 0 s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {r['guest']} | {r['rootfs_allocated_mib']} | {r['import_s']:.1f} | {r['template_build_s']:.1f} | "
              f"{statistics.median(r['create_first_cmd_s']):.2f} | {fmt(r.get('python_c_pass_s'))} | "
              f"{fmt(r.get('node_e_0_s'))} |")


if __name__ == "__main__":
    main()
