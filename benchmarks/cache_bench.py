"""Node cache micro-benchmark: hit latency and fetch (miss + store) throughput.

    .venv/bin/python benchmarks/cache_bench.py [--dir DIR] [--chunk-size 64K]
                                              [--chunks 2000] [--lookups 20000] [--threads 4]

Measured phases (all on DIR's filesystem, warm page cache; the fetch itself returns
bytes already in memory, so "fetch" numbers are the cache's own cost of storing):
  floor        os.open + os.read + os.close of one chunk-sized file: what any hit costs at least
  get hit      NodeCache.get on cached chunks (LMDB read txn + file read + size/xxh3 check)
  fetch        get_or_fetch on missing chunks: in-flight lock, tmp file, rename + index txn
  fetch+evict  the same with a capacity of a quarter of the working set (every put evicts)
  threads      get hits from N threads at once (aggregate throughput)
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import blake3

from _common import BenchError, MB, machine_info, parse_size, percentile, print_table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from aenv_store.cache.node_cache import NodeCache  # noqa: E402
from aenv_store.config import CacheConfig  # noqa: E402
from aenv_store.formats.ids import Digest  # noqa: E402


def make_chunks(n: int, size: int) -> list[tuple[Digest, bytes]]:
    out = []
    for i in range(n):
        data = blake3.blake3(i.to_bytes(8, "little")).digest(length=size)
        out.append((Digest.of(data), data))
    return out


def latencies(fn, items, rng: random.Random, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    picks = [items[rng.randrange(len(items))] for _ in range(n)]
    out = []
    clock = time.perf_counter_ns
    for item in picks:
        t = clock()
        fn(item)
        out.append((clock() - t) / 1000.0)
    return out


def row(name: str, lat_us: list[float], nbytes_each: int) -> list[object]:
    total_s = sum(lat_us) / 1e6
    ops = len(lat_us) / total_s
    return [name, f"{percentile(lat_us, 50):.1f}", f"{percentile(lat_us, 99):.1f}",
            f"{sum(lat_us) / len(lat_us):.1f}", f"{ops:,.0f}", f"{ops * nbytes_each / MB:,.0f}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to create the cache (default: a temp dir)")
    ap.add_argument("--chunk-size", type=parse_size, default=64 * 1024)
    ap.add_argument("--chunks", type=int, default=2000, help="working set in chunks")
    ap.add_argument("--lookups", type=int, default=20000, help="timed hits per phase")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.chunks < 4 or args.lookups < 100:
        raise BenchError("--chunks must be >= 4 and --lookups >= 100")
    size = args.chunk_size
    base = Path(tempfile.mkdtemp(prefix="aenv-cache-bench-", dir=args.dir))
    rng = random.Random(args.seed)
    try:
        info = machine_info()
        print(f"# node cache bench  {info['date']}  {info['cpu']} x{info['cpus']}  load {info['loadavg']}")
        print(f"# dir {base}  chunk {size} B  working set {args.chunks} chunks "
              f"({args.chunks * size / MB:.0f} MB)  lookups {args.lookups}")
        items = make_chunks(args.chunks, size)
        rows: list[list[object]] = []

        # floor: the bare file read every hit needs
        floor_dir = base / "floor"
        floor_dir.mkdir()
        paths = []
        for i, (_, data) in enumerate(items[:256]):
            p = floor_dir / f"{i}"
            p.write_bytes(data)
            paths.append(str(p))

        def raw_read(p: str) -> None:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            os.read(fd, size + 1)
            os.close(fd)

        rows.append(row("floor (open+read+close)", latencies(raw_read, paths, rng, args.lookups), size))

        config = CacheConfig(capacity=args.chunks * size * 2, min_free_disk=0)
        with NodeCache(base / "roomy", config) as cache:
            fetch_lat = []
            for d, data in items:
                t = time.perf_counter_ns()
                cache.get_or_fetch(d, lambda: data)
                fetch_lat.append((time.perf_counter_ns() - t) / 1000.0)
            rows.append(row("fetch (miss, store)", fetch_lat, size))
            rows.append(row("get hit", latencies(lambda it: cache.get(it[0]), items, rng, args.lookups), size))
            rows.append(row("get_or_fetch hit", latencies(lambda it: cache.get_or_fetch(it[0], bytes),
                                                          items, rng, args.lookups), size))
            rows.append(row("location_of", latencies(lambda it: cache.location_of(it[0]), items, rng, args.lookups), 0))

            per_thread = args.lookups // args.threads
            barrier = threading.Barrier(args.threads + 1)

            def hammer(seed: int) -> None:
                r = random.Random(seed)
                picks = [items[r.randrange(len(items))][0] for _ in range(per_thread)]
                barrier.wait()
                for d in picks:
                    cache.get(d)

            threads = [threading.Thread(target=hammer, args=(i,)) for i in range(args.threads)]
            for t in threads:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            secs = time.perf_counter() - t0
            n = per_thread * args.threads
            rows.append([f"get hit, {args.threads} threads", "-", "-", f"{secs / n * 1e6:.1f}",
                         f"{n / secs:,.0f}", f"{n * size / MB / secs:,.0f}"])
            roomy = cache.stats()

        small = CacheConfig(capacity=max(4, args.chunks // 4) * size, min_free_disk=0)
        with NodeCache(base / "small", small) as cache:
            evict_lat = []
            for d, data in items:
                t = time.perf_counter_ns()
                cache.get_or_fetch(d, lambda: data)
                evict_lat.append((time.perf_counter_ns() - t) / 1000.0)
            rows.append(row("fetch+evict (cap = 1/4 set)", evict_lat, size))
            tight = cache.stats()

        print_table(rows, ["phase", "p50 us", "p99 us", "mean us", "ops/s", "MB/s"])
        print(f"# roomy: {roomy.entries} entries, {roomy.hits} hits, {roomy.fetches} fetches; "
              f"small: {tight.entries} entries, {tight.evictions} evictions, used {tight.used_bytes / MB:.1f} MB "
              f"of {tight.capacity / MB:.1f} MB")
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"cache_bench: error: {e}", file=sys.stderr)
        sys.exit(2)
