"""aenv's block-image NBD export against qemu-nbd serving the flattened raw file.

One run: imports a raw disk image into a posix_fs repository, then measures,
with the same client (aenv_vm.blockimage.nbd_client, pipelined asyncio) for
both servers:

* sequential 1 MiB reads over the whole image, queue depth 1 and 16;
* random 4 KiB reads, queue depth 1 and 16;

cold (aenv: fresh node cache on a fresh data dir sharing the repository,
page cache dropped; qemu-nbd: page cache dropped) and warm (second pass), and
finally the commit time of an upper layer with 64 MiB written; at queue depth
1 also the p50 latency of one read (cold: a fresh server). Each server
runs in its own process. Prints a table; ``--markdown`` writes it for
docs/benchmarks.md, ``--json`` the raw numbers.

    .venv/bin/python benchmarks/block_bench.py                # 256 MiB image
    .venv/bin/python benchmarks/block_bench.py --size 64M --rand-ops 2000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from _common import (MiB, BenchError, Stopwatch, drop_caches, format_table, machine_info,  # noqa: E402
                     markdown_table, parse_size, throughput_mb_s, tool_version)

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings  # noqa: E402
from aenv_store.formats.ids import Digest  # noqa: E402
from aenv_store.store import Store  # noqa: E402
from aenv_vm.blockimage.nbd_client import NbdClient  # noqa: E402

EXPORT = "disk"


def settings(data_dir: Path, repo: Path) -> StoreSettings:
    return StoreSettings(paths=StorePaths(data_dir), repository=RepositoryConfig(path=str(repo)),
                         store=StoreConfig(), cache=CacheConfig(capacity=8 << 30, min_free_disk=0))


# ------------------------------------------------------------------ server process
def serve(args: argparse.Namespace) -> int:
    """Child mode: serve one image until SIGTERM (prints 'ready' when listening)."""
    from aenv_vm.blockimage.image import BlockImage
    from aenv_vm.blockimage.nbd_server import NbdServer
    from aenv_vm.blockimage.prefetch import Prefetcher

    store = Store.open(settings(Path(args.data_dir), Path(args.repo)))
    img = BlockImage.open(store, Digest.from_hex(args.top), EXPORT, upper_dir=Path(args.data_dir) / "upper",
                          memory_bytes=args.memory)
    Prefetcher(img)

    async def run() -> None:
        server = NbdServer(args.socket)
        server.add_export(img)
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        await server.close()

    try:
        asyncio.run(run())
    finally:
        img.close()
        store.close()
    return 0


class Server:
    def __init__(self, cmd: list[str], sock: Path, wait_line: bool) -> None:
        self.sock = sock
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        if wait_line:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            if line.strip() != "ready":
                raise BenchError(f"server did not start: {line} {self.proc.stderr.read() if self.proc.stderr else ''}")
        while not sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{cmd[0]} did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------ workloads
async def _run_queue(sock: Path, offsets: list[int], bs: int, qd: int) -> tuple[float, list[float]]:
    """(seconds for all reads, latency of each read in seconds)."""
    c = await NbdClient.connect(str(sock), EXPORT)
    try:
        it = iter(offsets)
        lat: list[float] = []

        async def worker() -> None:
            for off in it:
                t = time.perf_counter()
                data = await c.read(off, bs)
                lat.append(time.perf_counter() - t)
                if len(data) != bs:
                    raise BenchError("short read")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(qd)))
        return time.perf_counter() - t0, lat
    finally:
        await c.close()


def _p50_ms(lat: list[float]) -> float:
    return sorted(lat)[len(lat) // 2] * 1000 if lat else 0.0


def seq_read(sock: Path, size: int, qd: int) -> dict[str, float]:
    bs = MiB
    secs, lat = asyncio.run(_run_queue(sock, list(range(0, size - bs + 1, bs)), bs, qd))
    return {"MB/s": throughput_mb_s(size, secs), "seconds": secs, "p50 ms": _p50_ms(lat)}


def rand_read(sock: Path, size: int, qd: int, ops: int, seed: int = 7) -> dict[str, float]:
    bs = 4096
    rnd = random.Random(seed)
    offs = [rnd.randrange(0, size // bs) * bs for _ in range(ops)]
    secs, lat = asyncio.run(_run_queue(sock, offs, bs, qd))
    return {"IOPS": ops / secs, "MB/s": throughput_mb_s(ops * bs, secs), "seconds": secs, "p50 ms": _p50_ms(lat)}


def qemu_img_bench(sock: Path, size: int, bs: int, qd: int) -> dict[str, float]:
    """Sequential reads by QEMU's own NBD client (C, coroutines): a cross-check
    that the Python client is not what decides the comparison."""
    count = size // bs
    out = subprocess.run(["qemu-img", "bench", "-f", "raw", "-c", str(count), "-d", str(qd), "-s", str(bs),
                          "-S", str(bs), f"nbd+unix:///{EXPORT}?socket={sock}"],
                         capture_output=True, text=True, timeout=600)
    m = re.search(r"Run completed in ([0-9.]+) seconds", out.stdout)
    if out.returncode or not m:
        raise BenchError(f"qemu-img bench failed: {out.stderr.strip() or out.stdout.strip()}")
    secs = float(m.group(1))
    return {"MB/s": throughput_mb_s(count * bs, secs), "seconds": secs}


def workloads(sock: Path, size: int, rand_ops: int) -> dict[str, dict[str, float]]:
    return {
        "seq 1M QD1": seq_read(sock, size, 1),
        "seq 1M QD16": seq_read(sock, size, 16),
        "rand 4K QD1": rand_read(sock, size, 1, rand_ops),
        "rand 4K QD16": rand_read(sock, size, 16, rand_ops),
    }


def make_image(path: Path, size: int, seed: int = 1) -> None:
    """A disk-like image: 3/4 incompressible data, 1/4 zeros (in 1 MiB runs)."""
    rnd = random.Random(seed)
    with open(path, "wb") as f:
        f.truncate(size)
        for pos in range(0, size, MiB):
            if rnd.random() < 0.75:
                f.seek(pos)
                f.write(rnd.randbytes(min(MiB, size - pos)))


# ------------------------------------------------------------------ main
def bench(args: argparse.Namespace) -> dict[str, Any]:
    from aenv_vm.blockimage.image import BlockImage
    from aenv_vm.blockimage.importer import import_raw

    if shutil.which("qemu-nbd") is None:
        raise BenchError("qemu-nbd not found (apt-get install qemu-utils)")
    size = parse_size(args.size)
    root = Path(tempfile.mkdtemp(prefix="aenv-block-bench-", dir=args.workdir))
    results: dict[str, Any] = {"size": size, "rand_ops": args.rand_ops, "machine": machine_info(),
                               "qemu_nbd": tool_version(["qemu-nbd", "--version"])}
    try:
        raw = root / "disk.raw"
        make_image(raw, size)
        repo = root / "repo"
        with Store.open(settings(root / "builder", repo), create=True) as st, Stopwatch() as sw:
            top = import_raw(st, raw, "bench").layer_id
        results["import_seconds"] = sw.seconds
        sock = root / "nbd.sock"
        python = sys.executable
        me = str(Path(__file__).resolve())

        table: dict[str, dict[str, dict[str, float]]] = {"aenv cold": {}, "qemu-nbd cold": {}}
        runs = {"seq 1M QD1": lambda s: seq_read(s, size, 1), "seq 1M QD16": lambda s: seq_read(s, size, 16),
                "rand 4K QD1": lambda s: rand_read(s, size, 1, args.rand_ops),
                "rand 4K QD16": lambda s: rand_read(s, size, 16, args.rand_ops)}

        def aenv_server(node: Path, sock_path: Path) -> Server:
            return Server([python, me, "--serve", "--data-dir", str(node), "--repo", str(repo), "--top", top.hex(),
                           "--socket", str(sock_path), "--memory", str(args.memory)], sock_path, wait_line=True)

        def qemu_server(sock_path: Path) -> Server:
            return Server(["qemu-nbd", "--persistent", "--shared=16", "--format=raw", "--read-only",
                           f"--socket={sock_path}", f"--export-name={EXPORT}", str(raw)], sock_path, wait_line=False)

        # Cold: every workload on a fresh server; aenv on a fresh data dir (empty node
        # cache) sharing the repository; the page cache dropped before each.
        dropped = True
        for i, (wl, fn) in enumerate(runs.items()):
            dropped &= drop_caches()
            srv = aenv_server(root / f"cold-{i}", sock)
            try:
                table["aenv cold"][wl] = fn(sock)
            finally:
                srv.stop()
            dropped &= drop_caches()
            srv = qemu_server(sock)
            try:
                table["qemu-nbd cold"][wl] = fn(sock)
            finally:
                srv.stop()
        results["page_cache_dropped"] = dropped
        # Warm: both servers up, a full warming pass each, then each workload
        # `--repeat` times alternating servers (the machine is shared: alternating
        # spreads background load evenly); the median run is reported.
        sock_q = root / "qemu.sock"
        a_srv = aenv_server(root / "warm", sock)
        q_srv = qemu_server(sock_q)
        try:
            seq_read(sock, size, 16)
            seq_read(sock_q, size, 16)
            samples: dict[str, dict[str, list[dict[str, float]]]] = {"aenv warm": {}, "qemu-nbd warm": {}}
            for wl, fn in runs.items():
                for _ in range(args.repeat):
                    samples["aenv warm"].setdefault(wl, []).append(fn(sock))
                    samples["qemu-nbd warm"].setdefault(wl, []).append(fn(sock_q))
            qimg: dict[str, dict[str, list[dict[str, float]]]] = {"aenv warm": {}, "qemu-nbd warm": {}}
            for wl, (bs, qd) in {"qemu-img bench seq 1M QD1": (MiB, 1), "qemu-img bench seq 1M QD16": (MiB, 16),
                                 "qemu-img bench seq 4K QD16": (4096, 16)}.items():
                for _ in range(args.repeat):
                    qimg["aenv warm"].setdefault(wl, []).append(qemu_img_bench(sock, size, bs, qd))
                    qimg["qemu-nbd warm"].setdefault(wl, []).append(qemu_img_bench(sock_q, size, bs, qd))
            results["qemu_img_bench"] = {name: {wl: sorted(xs, key=lambda r: r["MB/s"])[len(xs) // 2]
                                                for wl, xs in per.items()} for name, per in qimg.items()}
            # alternating runs pair up: the median of per-pair ratios is robust to slow drift in load
            results["warm_pair_ratio"] = {
                wl: sorted(a["MB/s"] / q["MB/s"] for a, q in zip(samples["aenv warm"][wl],
                                                              samples["qemu-nbd warm"][wl]))[args.repeat // 2]
                for wl in runs}
            for name, per in samples.items():
                table[name] = {wl: sorted(xs, key=lambda r: r["MB/s"])[len(xs) // 2] for wl, xs in per.items()}
                results.setdefault("samples", {})[name] = {wl: [round(r["MB/s"], 1) for r in xs]
                                                           for wl, xs in per.items()}
        finally:
            a_srv.stop()
            q_srv.stop()
        results["table"] = table

        # --- commit of an upper layer with 64 MiB written (fresh data each time, so
        # nothing deduplicates; the median of --repeat commits is reported)
        commits = []
        with Store.open(settings(root / "committer", repo)) as st:
            with BlockImage.open(st, top, "c", upper_dir=root / "committer" / "upper") as img:
                rnd = random.Random(3)
                span = min(64 * MiB, size)
                for _ in range(args.repeat):
                    for pos in range(0, span, MiB):
                        img.write(pos, rnd.randbytes(MiB))
                    img.flush()
                    commits.append(img.commit("bench-commit"))
                    # the node cache is seeded in the background after a commit:
                    # let it finish so it does not overlap the next measurement
                    img.wait_seeded()
        commits.sort(key=lambda c: c.seconds)
        info = commits[len(commits) // 2]
        results["commit"] = {"written": span, "seconds": info.seconds, "data_bytes": info.data_bytes,
                             "extents": info.extents, "all_seconds": [round(c.seconds, 3) for c in commits]}
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def render(results: dict[str, Any], markdown: bool) -> str:
    table = results["table"]
    cols = ["seq 1M QD1", "seq 1M QD16", "rand 4K QD1", "rand 4K QD16"]
    rows = []
    for name, res in table.items():
        rows.append([name] + [f"{res[c]['MB/s']:.0f} MB/s" if c.startswith("seq")
                              else f"{res[c]['IOPS']:.0f} IOPS" for c in cols])
    for temp in ("cold", "warm"):
        a, q = table[f"aenv {temp}"], table[f"qemu-nbd {temp}"]
        rows.append([f"ratio aenv/qemu-nbd {temp}"] + [
            f"{a[c]['MB/s'] / q[c]['MB/s']:.2f}x" for c in cols])
    pr = results.get("warm_pair_ratio")
    if pr:
        rows.append(["median of paired ratios, warm"] + [f"{pr[c]:.2f}x" for c in cols])
    fmt = markdown_table if markdown else format_table
    out = fmt(rows, ["server"] + cols)
    # per-read latency at queue depth 1: a cold 1 MiB read fetches 16 chunks, a cold
    # random 4 KiB read one chunk (or finds it fetched by an earlier read)
    lrows = [[name] + [f"{res[c]['p50 ms']:.3f} ms" for c in cols if c.endswith("QD1")]
             for name, res in table.items() if all("p50 ms" in res[c] for c in cols)]
    if lrows:
        out += "\n\np50 latency of one read, queue depth 1:\n\n"
        out += fmt(lrows, ["server"] + [c for c in cols if c.endswith("QD1")])
    qi = results.get("qemu_img_bench")
    if qi:
        qcols = list(qi["aenv warm"])
        qrows = [[name] + [f"{per[c]['MB/s']:.0f} MB/s" for c in qcols] for name, per in qi.items()]
        qrows.append(["ratio aenv/qemu-nbd warm"] + [
            f"{qi['aenv warm'][c]['MB/s'] / qi['qemu-nbd warm'][c]['MB/s']:.2f}x" for c in qcols])
        out += "\n\nQEMU's own NBD client (qemu-img bench, sequential):\n\n"
        out += fmt(qrows, ["server"] + [c.replace("qemu-img bench ", "") for c in qcols])
    c = results["commit"]
    out += (f"\n\ncommit of an upper layer with {c['written'] // MiB} MiB written: {c['seconds']:.3f} s median "
            f"(runs: {', '.join(f'{x:.3f}' for x in c['all_seconds'])} s; {c['extents']} extents, "
            f"{c['data_bytes'] // MiB} MiB data)")
    out += f"\nimage {results['size'] // MiB} MiB, {results['rand_ops']} random reads per run, " \
           f"import {results['import_seconds']:.2f} s; {results['qemu_nbd']}"
    if not results.get("page_cache_dropped"):
        out += "\n(page cache NOT dropped: not root; 'cold' means empty node cache only)"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256M", help="image size (default 256M)")
    p.add_argument("--rand-ops", type=int, default=20000, help="random 4 KiB reads per run")
    p.add_argument("--repeat", type=int, default=3, help="warm runs per workload and server (median)")
    p.add_argument("--memory", type=int, default=64 << 20, help="aenv image chunk memory in bytes")
    p.add_argument("--workdir", default=None, help="where the temporary data lives (default: $TMPDIR)")
    p.add_argument("--json", help="write raw results to this file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    # child mode
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    p.add_argument("--repo", help=argparse.SUPPRESS)
    p.add_argument("--top", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args)
    try:
        results = bench(args)
    except BenchError as e:
        print(f"block_bench: error: {e}", file=sys.stderr)
        return 1
    print(render(results, args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
