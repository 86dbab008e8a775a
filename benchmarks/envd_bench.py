"""envd latency through the real e2b SDK, envd running on the host.

    python benchmarks/envd_bench.py [--calls 200] [--markdown]

Starts ``python -m envd`` on a free loopback port, points the unmodified SDK at
it (debug mode + sandbox_url), warms up, then times each call end to end:
``commands.run("true")`` (a login bash per call, as the SDK always sends
``bash -l -c``) and a 1 MiB ``files.write`` followed by ``files.read``.
These are the baseline the VM and API layers are compared against.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import BenchError, MiB, machine_info, markdown_table, print_table, summarize

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_envd(port: int, user: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port", str(port), "--user", user],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise BenchError("envd did not start")


def _time_ms(fn, calls: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="timed calls per operation (default 200)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--user", default="nobody",
                    help="envd default user (default nobody: a plain /etc/profile login shell, like a fresh guest;"
                         " a developer's own profile can add hundreds of ms to every bash -l)")
    args = ap.parse_args()
    if args.calls < 1:
        print("envd_bench: error: --calls must be >= 1", file=sys.stderr)
        return 2
    try:
        from e2b import Sandbox
    except ImportError:
        print("envd_bench: error: the e2b SDK is not installed (pip install -r requirements.lock)", file=sys.stderr)
        return 2

    port = _free_port()
    try:
        proc = _start_envd(port, args.user)
    except BenchError as e:
        print(f"envd_bench: error: {e}", file=sys.stderr)
        return 1
    try:
        sbx = Sandbox.create(debug=True, sandbox_url=f"http://127.0.0.1:{port}", api_key="bench")
        payload = os.urandom(MiB)
        with tempfile.TemporaryDirectory(prefix="envd-bench-") as tmp:
            path = os.path.join(tmp, "blob.bin")

            def run_true() -> None:
                assert sbx.commands.run("true").exit_code == 0

            def write_read() -> None:
                sbx.files.write(path, payload)
                assert sbx.files.read(path, format="bytes") == payload

            def write_only() -> None:
                sbx.files.write(path, payload)

            def read_only() -> None:
                assert len(sbx.files.read(path, format="bytes")) == MiB

            for fn in (run_true, write_read):  # warm-up: imports, connection pool
                for _ in range(5):
                    fn()
            results = [
                ('commands.run("true")', _time_ms(run_true, args.calls)),
                ("files.write+read 1 MiB", _time_ms(write_read, args.calls)),
                ("files.write 1 MiB", _time_ms(write_only, args.calls)),
                ("files.read 1 MiB", _time_ms(read_only, args.calls)),
            ]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    header = [f"operation (envd on host, e2b SDK sync, user {args.user})", "calls", "p50 ms", "p95 ms", "p99 ms", "mean ms"]
    rows = []
    for name, xs in results:
        s = summarize(xs)
        rows.append([name, len(xs), f"{s['p50']:.2f}", f"{s['p95']:.2f}", f"{s['p99']:.2f}", f"{s['mean']:.2f}"])
    info = machine_info()
    print(f"# {info['date']} · {info['cpu']} · {info['cpus']} cpus · load {info['loadavg']} · python {info['python']}")
    if args.markdown:
        print(markdown_table(rows, header))
    else:
        print_table(rows, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
