"""The code interpreter (issue 15), driven by the real ``e2b-code-interpreter`` SDK
against ``aenv server`` and the ``code-interpreter-v1`` template:

1. ``Sandbox.create()`` → first ``run_code("1")`` result (a new sandbox each time);
2. ``run_code("1")`` warm, on one sandbox;
3. a 20-line pandas cell, warm;

and the peer: the same cells straight against a Jupyter kernel on the host
(Debian's ipykernel through jupyter_client on the host's python3, no VM, no HTTP),
so the difference is what the sandbox and the protocol add.

Starts its own server (``--data-dir``, default a temp dir) and builds the template
there if it is missing (minutes under TCG), unless
``--url``/``--api-key`` name a running server that has it.

    python benchmarks/code_interpreter_bench.py [--creates 10] [--calls 50] [--pandas 10]
        [--pool-size 1] [--data-dir DIR] [--markdown] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import BenchError, machine_info, markdown_table, percentile, print_table
from api_bench import start_server

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PANDAS_CELL = """
import numpy as np
import pandas as pd
rng = np.random.default_rng(7)
n = 2000
df = pd.DataFrame({
    "city": rng.choice(["Oslo", "Lima", "Pune", "Kyiv"], n),
    "year": rng.integers(2015, 2025, n),
    "sales": rng.gamma(2.0, 100.0, n).round(2),
    "units": rng.integers(1, 50, n),
})
df["price"] = (df["sales"] / df["units"]).round(3)
by_city = df.groupby("city").agg(total=("sales", "sum"), mean_price=("price", "mean"))
by_year = df.pivot_table(index="year", columns="city", values="units", aggfunc="sum")
top = df.nlargest(5, "sales")[["city", "year", "sales"]]
growth = by_year.pct_change().fillna(0).round(3)
summary = {
    "rows": len(df),
    "best_city": by_city["total"].idxmax(),
    "years": int(by_year.shape[0]),
}
by_city.round(2)
"""

PEER = r"""
import json, sys, time
from jupyter_client.manager import start_new_kernel
calls, pandas_n, cell = int(sys.argv[1]), int(sys.argv[2]), sys.stdin.read()
km, kc = start_new_kernel(kernel_name="python3")
def run(code):
    t0 = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=300, output_hook=lambda m: None)
    assert reply["content"]["status"] == "ok", reply
    return (time.perf_counter() - t0) * 1000
try:
    run("1")
    one = [run("1") for _ in range(calls)]
    run(cell)
    pandas = [run(cell) for _ in range(pandas_n)]
finally:
    kc.stop_channels(); km.shutdown_kernel(now=True)
print(json.dumps({"one": one, "pandas": pandas}))
"""


def stats(name: str, ms: list[float]) -> dict[str, float | str | int]:
    return {"name": name, "n": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99),
            "mean": sum(ms) / len(ms)}


def pooled(url: str, key: str) -> int:
    req = urllib.request.Request(url + "/metrics", headers={"X-API-Key": key})
    with urllib.request.urlopen(req, timeout=10) as r:
        m = re.search(r'aenv_sandboxes\{state="pooled"\} (\d+)', r.read().decode())
    return int(m.group(1)) if m else 0


def wait_pool(size: int, timeout: float = 300.0) -> None:
    """Until the node's pools hold ``size`` sandboxes (the metric counts every template's
    pool: `base`'s too)."""
    url, key = os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"]
    deadline = time.monotonic() + timeout
    while pooled(url, key) < size:
        if time.monotonic() > deadline:
            raise BenchError(f"warm pools did not refill to {size} within {timeout} s")
        time.sleep(0.2)


def settled_pool(quiet: float = 5.0, timeout: float = 300.0) -> int:
    """The pooled count once it has not grown for ``quiet`` seconds: what a full refill is."""
    url, key = os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"]
    deadline = time.monotonic() + timeout
    best, since = pooled(url, key), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.5)
        now = pooled(url, key)
        if now > best:
            best, since = now, time.monotonic()
    return best


def bench_sandbox(creates: int, calls: int, pandas_n: int, pool_size: int) -> tuple[list[dict], float | None]:
    from e2b import Template
    from e2b_code_interpreter import Sandbox

    from tests.codeint.template import NAME, code_interpreter_template
    built = None
    if not Template.exists(NAME):
        t0 = time.monotonic()
        Template.build(code_interpreter_template(), NAME, cpu_count=2, memory_mb=1024)
        built = time.monotonic() - t0
    first: list[float] = []
    full = 0
    if pool_size:
        # the other templates' pools (base's) first; this template's pool fills once it
        # has been used, with `pool_size` more
        full = settled_pool() + pool_size
        Sandbox.create().kill()
        wait_pool(full)
    for _ in range(creates):
        if pool_size:
            wait_pool(full)
            time.sleep(1.0)        # the refill's QEMU settles (docs/benchmarks.md, API)
        t0 = time.perf_counter()
        sbx = Sandbox.create()
        try:
            r = sbx.run_code("1")
            first.append((time.perf_counter() - t0) * 1000)
            if r.text != "1":
                raise BenchError(f"run_code('1') gave {r}")
        finally:
            sbx.kill()
    sbx = Sandbox.create()
    try:
        sbx.run_code("1")
        one = []
        for _ in range(calls):
            t0 = time.perf_counter()
            sbx.run_code("1")
            one.append((time.perf_counter() - t0) * 1000)
        r = sbx.run_code(PANDAS_CELL)
        if r.error is not None:
            raise BenchError(f"the pandas cell failed: {r.error}")
        pandas = []
        for _ in range(pandas_n):
            t0 = time.perf_counter()
            sbx.run_code(PANDAS_CELL)
            pandas.append((time.perf_counter() - t0) * 1000)
    finally:
        sbx.kill()
    return [stats("aenv: create → first run_code('1')", first), stats("aenv: run_code('1') warm", one),
            stats("aenv: 20-line pandas cell", pandas)], built


def bench_peer(calls: int, pandas_n: int) -> list[dict]:
    # in a directory of its own: a kernel imports from its cwd first (a stray tty.py in /tmp broke one)
    out = subprocess.run(["/usr/bin/python3", "-c", PEER, str(calls), str(pandas_n)], input=PANDAS_CELL,
                         capture_output=True, text=True, timeout=900, cwd=tempfile.mkdtemp(prefix="ci-peer-"),
                         env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    if out.returncode != 0:
        raise BenchError(f"the host Jupyter peer failed:\n{out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return [stats("host Jupyter kernel: execute('1')", got["one"]),
            stats("host Jupyter kernel: 20-line pandas cell", got["pandas"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--creates", type=int, default=10)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--pandas", type=int, default=10)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--pool-size", type=int, default=1, help="warm pool per template (0: every create restores)")
    ap.add_argument("--url", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    proc = None
    if args.url:
        env = {"E2B_API_URL": args.url, "E2B_SANDBOX_URL": args.url, "E2B_API_KEY": args.api_key or ""}
    else:
        data = args.data_dir or Path(tempfile.mkdtemp(prefix="aenv-ci-bench-"))
        os.environ.setdefault("AENV_TEMPLATES__READY_TIMEOUT", "600")   # the warm-up imports, under TCG
        proc, env = start_server(data, args.pool_size)
    os.environ.update(env)
    try:
        rows, built = bench_sandbox(args.creates, args.calls, args.pandas, args.pool_size if not args.url else 0)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    rows += bench_peer(args.calls, args.pandas)
    table = [[r["name"], r["n"], f"{r['p50']:.1f}", f"{r['p99']:.1f}", f"{r['mean']:.1f}"] for r in rows]
    header = ["what (ms)", "n", "p50", "p99", "mean"]
    print(markdown_table(table, header) if args.markdown else "", end="\n" if args.markdown else "")
    if not args.markdown:
        print_table(table, header)
    if built is not None:
        print(f"template build: {built:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "rows": rows, "template_build_s": built},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
