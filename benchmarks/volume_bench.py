"""Volume mount throughput inside a sandbox, against the guest's own root disk in the same run.

    python benchmarks/volume_bench.py [--mib 64] [--files 500] [--rounds 3] [--network user|tap] [--markdown]

Starts ``aenv server`` on a fresh data dir (or uses --url/--api-key), creates a volume
and a sandbox with it mounted at /mnt/vol (real e2b SDK), then runs the same Python
script in the guest on the volume and on the root disk (/var/tmp, ext4 on the NBD-served
layered image): sequential write of N MiB in 1 MiB writes + fsync, a sequential read
after dropping the guest's page cache, and a small-file create rate (100-byte files,
each open/write/close) and unlink rate. Each figure is the median of --rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _common import BenchError, machine_info, markdown_table, print_table
from api_bench import start_server

GUEST_SCRIPT = r"""
import json, os, sys, time
d, mib, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(d, exist_ok=True)
buf = os.urandom(1 << 20)
p = os.path.join(d, "big")
t = time.perf_counter()
fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for _ in range(mib):
    os.write(fd, buf)
os.fsync(fd); os.close(fd)
w = time.perf_counter() - t
os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
t = time.perf_counter()
fd = os.open(p, os.O_RDONLY)
while os.read(fd, 1 << 20):
    pass
os.close(fd)
r = time.perf_counter() - t
os.unlink(p)
sd = os.path.join(d, "small")
os.makedirs(sd, exist_ok=True)
t = time.perf_counter()
for i in range(files):
    with open(os.path.join(sd, f"f{i}"), "wb") as f:
        f.write(b"x" * 100)
c = time.perf_counter() - t
t = time.perf_counter()
for i in range(files):
    os.unlink(os.path.join(sd, f"f{i}"))
u = time.perf_counter() - t
os.rmdir(sd)
print(json.dumps({"write_mbs": mib * 1.048576 / w, "read_mbs": mib * 1.048576 / r,
                  "create_per_s": files / c, "unlink_per_s": files / u}))
"""

TARGETS = (("volume (FUSE, node-dialled channel)", "/mnt/vol/bench"), ("root disk (ext4, virtio-blk/NBD)",
                                                                       "/var/tmp/bench"))


def run(mib: int, files: int, rounds: int) -> dict:
    from e2b import Sandbox, Volume

    vol = Volume.create(f"bench-{uuid.uuid4().hex[:8]}")
    sbx = Sandbox.create(volume_mounts={"/mnt/vol": vol}, timeout=1800)
    try:
        sbx.files.write("/tmp/volbench.py", GUEST_SCRIPT)
        out: dict[str, dict[str, float]] = {}
        for name, path in TARGETS:
            runs = []
            for _ in range(rounds):
                r = sbx.commands.run(f"python3 /tmp/volbench.py {path} {mib} {files}", user="root", timeout=900)
                runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            out[name] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        # the same network path without FUSE: envd's own file API (SDK -> proxy -> envd)
        data = os.urandom(mib << 20)
        runs = []
        for _ in range(rounds):
            t = time.perf_counter()
            sbx.files.write("/var/tmp/sdk.bin", data)
            w = time.perf_counter() - t
            t = time.perf_counter()
            assert len(sbx.files.read("/var/tmp/sdk.bin", format="bytes")) == len(data)
            runs.append({"write_mbs": len(data) / 1e6 / w, "read_mbs": len(data) / 1e6 / (time.perf_counter() - t)})
        out["envd file API over the same network path (no FUSE)"] = {
            k: statistics.median(x[k] for x in runs) for k in runs[0]}
        return out
    finally:
        sbx.kill()
        Volume.destroy(vol.volume_id)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url"), p.add_argument("--api-key")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--files", type=int, default=500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--network", choices=("auto", "user", "tap"),
                   help="[vm] network of the server it starts (default: the server's, auto)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path, help="append the results as one JSON object")
    args = p.parse_args()
    proc = tmp = None
    try:
        if args.url:
            if not args.api_key:
                raise BenchError("--url needs --api-key")
            env = {"E2B_API_KEY": args.api_key, "E2B_API_URL": args.url, "E2B_SANDBOX_URL": args.url}
        else:
            tmp = tempfile.mkdtemp(prefix="volume-bench-")
            print(f"volume_bench: starting aenv server on {tmp}", file=sys.stderr)
            proc, env = start_server(Path(tmp), 0, args.network)
        env["E2B_VOLUME_API_URL"] = env["E2B_API_URL"]
        os.environ.update(env)
        result = run(args.mib, args.files, args.rounds)
    except BenchError as e:
        print(f"volume_bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    header = ["target", f"write {args.mib} MiB MB/s", f"read {args.mib} MiB MB/s", "creates/s", "unlinks/s"]
    rows = [[name, f"{v['write_mbs']:.1f}", f"{v['read_mbs']:.1f}", f"{v['create_per_s']:.0f}" if "create_per_s" in v
             else "-", f"{v['unlink_per_s']:.0f}" if "unlink_per_s" in v else "-"] for name, v in result.items()]
    print(f"machine: {machine_info()}")
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(result) + "\n")
    if args.markdown:
        print(markdown_table(rows, header))
    else:
        print_table(rows, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
