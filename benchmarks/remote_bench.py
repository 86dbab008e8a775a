"""Remote repository and P2P benchmark, in one run:

1. pack upload to a moto S3 server (a real HTTP server process on loopback):
   one PUT vs multipart with 1 and with N parts in flight;
2. ranged reads of 64 KiB from a pack (lazy chunk fetch), 1 and 8 threads;
3. fetching a committed artifact on node B: from the repository (S3 range
   reads) vs from node A over P2P (iroh, loopback), A in its own process with
   the chunks in its node cache. Also the protocol's ceiling (batched GETs
   straight on a P2PNode) and the single-chunk round trip.

    .venv/bin/python benchmarks/remote_bench.py [--blob-mib 64] [--pack-mib 32] [--json]

Numbers go to docs/benchmarks.md ("Remote repository and P2P")."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_store.assembly import open_node_store, peer_source  # noqa: E402
from aenv_store.config import CacheConfig, P2PConfig, RepositoryConfig, StorePaths, StoreSettings  # noqa: E402
from aenv_store.formats.catalog import CatalogRecord  # noqa: E402
from aenv_store.formats.ids import Digest  # noqa: E402
from aenv_store.p2p.node import P2PNode  # noqa: E402
from aenv_store.repository.backends.oss import OssBackend  # noqa: E402
from aenv_store.store import Store  # noqa: E402

MiB = 1 << 20
MB = 1e6


def _motoserver() -> Any:
    spec = importlib.util.spec_from_file_location("aenv_tests_motoserver", ROOT / "tests" / "remote" / "motoserver.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def settings(data_dir: Path, repo: RepositoryConfig, p2p: P2PConfig | None = None) -> StoreSettings:
    return StoreSettings(paths=StorePaths(data_dir), repository=repo, p2p=p2p or P2PConfig(),
                         cache=CacheConfig(capacity=4 << 30, min_free_disk=0))


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / MB if seconds > 0 else 0.0


# ------------------------------------------------------------------ S3 part
def bench_upload(repo: RepositoryConfig, tmp: Path, pack_mib: int, runs: int) -> dict[str, float]:
    src = tmp / "pack"
    src.write_bytes(os.urandom(pack_mib * MiB))
    out: dict[str, float] = {}
    cases = [("single PUT", dataclasses.replace(repo, max_concurrency=1), 1 << 40),
             ("multipart, 1 part in flight", dataclasses.replace(repo, max_concurrency=1), 0),
             (f"multipart, {repo.max_concurrency} parts in flight", repo, 0)]
    for label, cfg, threshold in cases:
        b = OssBackend(cfg, multipart_threshold=threshold or 8 * MiB)
        times = []
        for i in range(runs):
            t = time.perf_counter()
            b.put_file(f"bench/upload-{i}", src)
            times.append(time.perf_counter() - t)
        b.close()
        out[label] = rate(pack_mib * MiB, statistics.median(times))
    return out


def bench_ranges(repo: RepositoryConfig, count: int) -> dict[str, Any]:
    b = OssBackend(repo)
    size = b.stat("bench/upload-0").size
    rng = random.Random(1)
    offsets = [rng.randrange(0, size - 65536) for _ in range(count)]
    out: dict[str, Any] = {}
    for threads in (1, 8):
        lat: list[float] = []

        def one(off: int) -> None:
            t = time.perf_counter()
            assert len(b.get_range("bench/upload-0", off, 65536)) == 65536
            lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, offsets))
        wall = time.perf_counter() - t0
        out[f"{threads} thread(s)"] = {"MB/s": rate(count * 65536, wall),
                                       "p50 ms": statistics.median(lat) * 1000}
    b.close()
    return out


# ----------------------------------------------------------------- P2P part
def serve(data_dir: str, repo_json: str, size: int) -> None:
    """Node A (own process): commit ``size`` random bytes, warm its node cache with
    them (as the node that ran the sandbox would have), print ticket + ids, serve."""
    repo = RepositoryConfig(**json.loads(repo_json))
    data = random.Random(5).randbytes(size)
    store = open_node_store(settings(Path(data_dir), repo, P2PConfig(enabled=True)), create=True)
    with store.workspace() as ws:
        w = ws.blob_writer(size=size)
        for off in range(0, size, 8 * MiB):
            w.write(off, data[off:off + 8 * MiB])
        mid = w.close()
        ws.commit(CatalogRecord(name="bench", kind="snapshot", manifests=(("disk", mid),)))
    blob = store.open_blob(mid)
    for off in range(0, size, 8 * MiB):
        blob.read(off, 8 * MiB)
    peers = peer_source(store)
    assert peers is not None
    chunks = [e.chunk.hex() for e in blob.manifest.extents if e.chunk is not None]
    print(json.dumps({"ticket": peers.ticket, "mid": mid.hex(), "chunks": chunks}), flush=True)
    sys.stdin.readline()
    store.close()


def read_blob(store: Store, mid: Digest, step: int = 4 * MiB) -> tuple[float, int]:
    blob = store.open_blob(mid)
    t = time.perf_counter()
    n = 0
    for off in range(0, blob.size, step):
        n += len(blob.read(off, step))
    return time.perf_counter() - t, n


def bench_p2p(repo: RepositoryConfig, tmp: Path, blob_mib: int) -> dict[str, Any]:
    size = blob_mib * MiB
    a = subprocess.Popen([sys.executable, __file__, "_serve", str(tmp / "a"),
                          json.dumps(dataclasses.asdict(repo)), str(size)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert a.stdout is not None
        line = a.stdout.readline()
        if not line:
            raise SystemExit("node A failed to start")
        info = json.loads(line)
        mid = Digest.from_hex(info["mid"])
        chunks = [Digest.from_hex(c) for c in info["chunks"]]
        out: dict[str, Any] = {"blob MiB": blob_mib, "chunks": len(chunks)}

        with Store.open(settings(tmp / "b-repo", repo)) as b:
            secs, n = read_blob(b, mid)
            s3 = b.backend.stats()
        out["B reads from repository (S3 range reads)"] = {"MB/s": rate(n, secs), "s3 range GETs": s3.get("get_range", 0)}

        p2p = P2PConfig(enabled=True, peers=(info["ticket"],))
        with open_node_store(settings(tmp / "b-p2p", repo, p2p)) as b:
            secs, n = read_blob(b, mid)
            s3 = b.backend.stats()
            peers = peer_source(b)
            assert peers is not None
            totals = peers.status()["totals"]
        out["B reads from A over P2P (Store, 4 MiB reads)"] = {
            "MB/s": rate(n, secs), "s3 range GETs": s3.get("get_range", 0), "p2p bytes in": totals["bytes_in"]}

        with P2PNode(tmp / "c", P2PConfig(enabled=True, peers=(info["ticket"],)), write_status=False).start() as c:
            t = time.perf_counter()
            got = 0
            for i in range(0, len(chunks), 256):
                got += sum(len(v) for v in c.fetch_many(chunks[i:i + 256]).values())
            out["P2P batched GET, 256 chunks per request"] = {"MB/s": rate(got, time.perf_counter() - t)}
            lat = []
            for cid in chunks[:200]:
                t = time.perf_counter()
                assert c.fetch(cid) is not None
                lat.append(time.perf_counter() - t)
            out["P2P single chunk (have? + GET)"] = {"p50 ms": statistics.median(lat) * 1000,
                                                     "MB/s": rate(200 * 65536, sum(lat))}
        return out
    finally:
        if a.poll() is None:
            assert a.stdin is not None
            a.stdin.write("\n")
            a.stdin.flush()
            try:
                a.wait(30)
            except subprocess.TimeoutExpired:
                a.kill()


def print_section(title: str, rows: dict[str, Any]) -> None:
    print(f"\n{title}")
    for k, v in rows.items():
        if isinstance(v, dict):
            print(f"  {k}: " + ", ".join(f"{kk} {vv:.1f}" if isinstance(vv, float) else f"{kk} {vv}"
                                         for kk, vv in v.items()))
        else:
            print(f"  {k}: {v:.1f}" if isinstance(v, float) else f"  {k}: {v}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blob-mib", type=int, default=64)
    ap.add_argument("--pack-mib", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranges", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    moto = _motoserver().MotoServer.start()
    try:
        with tempfile.TemporaryDirectory(prefix="aenv-remote-bench-") as d:
            tmp = Path(d)
            repo = RepositoryConfig(**moto.repository_config(moto.new_bucket()))
            results = {
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
                "pack upload MB/s": bench_upload(repo, tmp, args.pack_mib, args.runs),
                "ranged 64 KiB reads": bench_ranges(repo, args.ranges),
            }
            repo2 = RepositoryConfig(**moto.repository_config(moto.new_bucket()))
            results["artifact fetch on node B"] = bench_p2p(repo2, tmp, args.blob_mib)
    finally:
        moto.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(results["machine"])
    print_section(f"pack upload to moto ({args.pack_mib} MiB pack, median of {args.runs}), MB/s",
                  results["pack upload MB/s"])
    print_section(f"ranged 64 KiB reads from moto ({args.ranges} random ranges)", results["ranged 64 KiB reads"])
    print_section("artifact fetch on node B", results["artifact fetch on node B"])


if __name__ == "__main__":
    main()
