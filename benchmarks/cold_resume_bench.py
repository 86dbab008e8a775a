"""Cold-node resume with lazy memory vs a warm node vs fetch-everything-then-resume.

    sudo .venv/bin/python benchmarks/cold_resume_bench.py [--memory-mib 512] [--fill-mib 320] [--rounds 2]
                                                          [--readahead-kb 1024]
                                                          [--json out.json] [--markdown]

One run, in a temporary directory: node A (its own data dir and node cache) builds a
``--memory-mib`` template, creates a sandbox, fills ``--fill-mib`` of its memory with
random bytes (two thirds a file in /dev/shm, the rest a Python process holding them),
takes a named snapshot (committed to the repository) and kills the sandbox. Then, for
each round, nodes that never saw the snapshot (empty data dir and node cache, the same
posix_fs repository) create a sandbox from it, side by side:

* **cold-first**: ``[vm] lazy_memory`` on, the very first restore of the snapshot on any
  node: the memory image is served page by page from the store through the node's FUSE
  mount (aenv_vm/memory/lazyfs.py), each fault a round trip; this node records the
  working set (aenv_vm/memory/workingset.py);
* **cold-lazy**: a later node that never saw the snapshot either: lazy memory plus the
  recorded working set fetched in batches into the page cache while QEMU starts;
* **naive peer**: lazy memory off: the whole memory image is fetched and assembled
  into a local file, then the sandbox is restored (what aenv did before);
* **warm node**: the naive node's second create (memory file local, its page cache hot).

Measured per create: call → vCPUs running, call → first ``commands.run("true")`` done
through the real e2b SDK, memory bytes fetched from the store before the first answer
(envd /init) against the memory image's size, and everything the node cache took in
(memory + the disk's chunks over NBD). Before each cold create the repository's files
are dropped from the page cache (posix_fadvise DONTNEED: only those files), so every
cold node reads the repository from disk. Target: cold to first command <= 2x warm.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _common import machine_info, markdown_table, print_table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings  # noqa: E402
from aenv_store.store import Store  # noqa: E402
from aenv_vm.guest import GuestImage, ensure_guest  # noqa: E402
from aenv_vm.memory import workingset  # noqa: E402
from aenv_vm.sandboxes import lazymem  # noqa: E402
from aenv_vm.sandboxes.manager import SandboxManager  # noqa: E402
from aenv_vm.templates.base import build_template  # noqa: E402
from aenv_vm.templates.template import Template, find_template  # noqa: E402
from vm_bench import first_command  # noqa: E402


@dataclass(frozen=True)
class Resume:
    kind: str               # cold-first | cold-lazy | naive | warm
    running: float          # s, call -> vCPUs running
    first_command: float    # s, call -> first commands.run done
    memory_fetched: int     # bytes of memory image fetched before the first answer
    cache_in: int           # bytes the node cache took in by the first answer (memory + disk)
    image: int              # memory image size (guest RAM)
    stored: int             # data bytes of the image in the store


def log(msg: str) -> None:
    print(f"[cold-resume {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def settings(data: Path, repo: Path) -> StoreSettings:
    return StoreSettings(paths=StorePaths(data), repository=RepositoryConfig(path=str(repo)), store=StoreConfig(),
                         cache=CacheConfig(capacity=8 << 30, min_free_disk=0))


def evict(path: Path) -> None:
    """Drop ``path``'s files (only those) from the page cache."""
    for p in path.rglob("*"):
        if p.is_file():
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def make_snapshot(guest: GuestImage, root: Path, repo: Path, memory_mib: int, fill_mib: int) -> Template:
    store = Store.open(settings(root / "node-a", repo), create=True)
    try:
        t0 = time.monotonic()
        await build_template(store, guest, root / "work", alias="bench", memory_mib=memory_mib)
        log(f"template built ({memory_mib} MiB) in {time.monotonic() - t0:.1f} s")
        async with SandboxManager(store, guest, root / "run-a") as mgr:
            sbx = await mgr.create("bench")
            shm, heap = fill_mib * 2 // 3, fill_mib - fill_mib * 2 // 3
            out = await sbx.envd.run(f"head -c {shm}M /dev/urandom > /dev/shm/fill && (setsid python3 -c "
                                     f"'import os,time; b=os.urandom({heap}<<20); open(\"/dev/shm/ready\",\"w\"); "
                                     f"time.sleep(1e9)' >/dev/null 2>&1 </dev/null &) && "
                                     f"while [ ! -e /dev/shm/ready ]; do sleep 0.1; done && free -m", timeout=300)
            log(f"guest memory filled with {fill_mib} MiB:\n{out.stdout.strip()}")
            t0 = time.monotonic()
            sid, _ = await mgr.snapshot(sbx.id, "cold-resume-bench")
            log(f"snapshot {sid} committed in {time.monotonic() - t0:.1f} s")
            await mgr.kill(sbx.id)
        return find_template(store, sid)
    finally:
        store.close()


async def one_create(mgr: SandboxManager, store: Store, tpl: Template, kind: str) -> Resume:
    assert store.cache is not None
    cache0 = store.cache.stats().used_bytes
    t0 = time.perf_counter()
    sbx = await mgr.create(tpl.id)
    answered = time.perf_counter() - t0
    cache_in = store.cache.stats().used_bytes - cache0
    img = mgr.rt.templates.lazy_image(sbx.vm.spec.mem_path)
    manifest = store.load_manifest(tpl.memory)
    if kind.startswith("cold"):
        if img is None:
            raise SystemExit("the cold node did not take the lazy path")
        fetched = img.fetched_bytes
    else:
        fetched = manifest.stored_bytes() if kind == "naive" else 0
    t = sbx.timing
    running = answered - ((t.first_answer + t.identity + t.init) if t is not None else 0.0)
    cmd = await asyncio.to_thread(first_command, sbx)
    await mgr.kill(sbx.id)
    r = Resume(kind, running, answered + cmd, fetched, cache_in, manifest.size, manifest.stored_bytes())
    filled = img.filled_bytes if img is not None else 0
    log(f"{kind}: filled ahead {filled >> 20} MiB; running {r.running * 1000:.0f} ms, first command {r.first_command * 1000:.0f} ms, memory fetched "
        f"{r.memory_fetched >> 20} MiB of {r.image >> 20} MiB ({r.stored >> 20} MiB stored), node cache +{cache_in >> 20} MiB")
    return r


async def record(guest: GuestImage, root: Path, repo: Path, tpl: Template) -> Resume:
    """The first lazy restore of the snapshot anywhere: no working set yet, every fault a
    round trip; its node records the working set (saved when the node closes)."""
    evict(repo)
    store = Store.open(settings(root / "first", repo))
    try:
        async with SandboxManager(store, guest, root / "run-first", lazy_memory=True) as mgr:
            r = await one_create(mgr, store, tpl, "cold-first")
        ws = workingset.load(store, tpl.memory)
        if ws is None:
            raise SystemExit("the first cold node recorded no working set")
        log(f"working set recorded: {len(ws.units) * ws.unit >> 20} MiB in {len(ws.units)} units")
        return r
    finally:
        store.close()


async def round_(guest: GuestImage, root: Path, repo: Path, tpl: Template, i: int, lazy_first: bool) -> list[Resume]:
    out: list[Resume] = []

    async def lazy() -> None:
        evict(repo)
        store = Store.open(settings(root / f"lazy-{i}", repo))
        try:
            async with SandboxManager(store, guest, root / f"run-lazy-{i}", lazy_memory=True) as mgr:
                out.append(await one_create(mgr, store, tpl, "cold-lazy"))
        finally:
            store.close()

    async def naive_and_warm() -> None:
        evict(repo)
        store = Store.open(settings(root / f"naive-{i}", repo))
        try:
            async with SandboxManager(store, guest, root / f"run-naive-{i}", lazy_memory=False) as mgr:
                out.append(await one_create(mgr, store, tpl, "naive"))
                out.append(await one_create(mgr, store, tpl, "warm"))
        finally:
            store.close()

    for part in ((lazy, naive_and_warm) if lazy_first else (naive_and_warm, lazy)):
        await part()
    return out


def table(results: list[Resume]) -> tuple[list[list[object]], list[str], dict[str, float]]:
    kinds = ("cold-first", "cold-lazy", "warm", "naive")
    med = {k: {f: statistics.median([getattr(r, f) for r in results if r.kind == k])
               for f in ("running", "first_command", "memory_fetched", "cache_in")} for k in kinds}
    image, stored = results[0].image, results[0].stored
    warm = med["warm"]["first_command"]
    rows = [[k, f"{med[k]['running'] * 1000:.0f}", f"{med[k]['first_command'] * 1000:.0f}",
             f"{med[k]['first_command'] / warm:.2f}x",
             f"{med[k]['memory_fetched'] / 2**20:.0f} MiB ({med[k]['memory_fetched'] / image * 100:.0f} %)",
             f"{med[k]['cache_in'] / 2**20:.0f} MiB"] for k in kinds]
    header = ["resume", "to running ms", "to first command ms", "vs warm", f"memory fetched of {image >> 20} MiB "
              f"({stored >> 20} MiB stored)", "node cache in"]
    ratio = {"cold_over_warm": med["cold-lazy"]["first_command"] / warm,
             "naive_over_warm": med["naive"]["first_command"] / warm,
             "naive_over_cold": med["naive"]["first_command"] / med["cold-lazy"]["first_command"]}
    return rows, header, ratio


async def main_async(args: argparse.Namespace) -> dict:
    guest = ensure_guest(quiet=True)
    lazymem.READAHEAD_KB = args.readahead_kb
    with tempfile.TemporaryDirectory(prefix="aenv-cold-resume-", dir=args.work) as tmp:
        root = Path(tmp)
        repo = root / "repo"
        tpl = await make_snapshot(guest, root, repo, args.memory_mib, args.fill_mib)
        results: list[Resume] = [await record(guest, root, repo, tpl)]
        for i in range(args.rounds):
            results += await round_(guest, root, repo, tpl, i, lazy_first=i % 2 == 1)
    rows, header, ratio = table(results)
    print_table(rows, header)
    if args.markdown:
        print(markdown_table(rows, header))
    log(f"cold-lazy / warm to first command: {ratio['cold_over_warm']:.2f}x (target <= 2x); naive / warm "
        f"{ratio['naive_over_warm']:.2f}x")
    return {"machine": machine_info(), "args": vars(args), "results": [asdict(r) for r in results], "ratio": ratio}


def measure(memory_mib: int = 512, fill_mib: int = 320, rounds: int = 2, work: str | None = None,
            readahead_kb: int = lazymem.READAHEAD_KB, markdown: bool = False) -> dict:
    """The whole run as a function (benchmarks/fleet_bench.py calls it): the JSON this
    script writes with --json, ``ratio["cold_over_warm"]`` the target's figure."""
    args = argparse.Namespace(memory_mib=memory_mib, fill_mib=fill_mib, rounds=rounds, work=work,
                              readahead_kb=readahead_kb, markdown=markdown, json=None)
    return asyncio.run(main_async(args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memory-mib", type=int, default=512)
    ap.add_argument("--fill-mib", type=int, default=320, help="guest memory filled with random bytes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--readahead-kb", type=int, default=lazymem.READAHEAD_KB,
                    help="KiB a page fault of a lazy image reads around the faulting page")
    ap.add_argument("--work", default=None, help="directory for the temporary nodes (default: $TMPDIR)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (QEMU confinement, FUSE)")
    out = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
