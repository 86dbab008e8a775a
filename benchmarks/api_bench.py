"""The API layer, driven by the real e2b SDK (sync) against `aenv server`:

1. proxy overhead — ``commands.run("true")`` through the server's sandbox proxy
   vs straight to the sandbox's envd (its host port forward), interleaved
   call by call so both see the same machine load;
2. ``Sandbox.create()`` → first command done, with the warm pool refilled
   between creates (the pool sized for the request rate);
3. creates per second with N concurrent clients looping create → kill.

Starts its own server (``--data-dir``, default a temp dir: the first start
builds the template) unless ``--url``/``--api-key`` name a running one on
this host (the direct envd port is read from the QEMU command line in /proc).

    python benchmarks/api_bench.py [--calls 200] [--creates 20] [--clients 8]
        [--seconds 30] [--pool-size 2] [--markdown] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from envd import ENVD_PORT

from _common import BenchError, machine_info, markdown_table, percentile, print_table

REPO = Path(__file__).resolve().parent.parent


def start_server(data_dir: Path, pool_size: int, network: str | None = None) -> tuple[subprocess.Popen, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env["AENV_VM__POOL_SIZE"] = str(pool_size)
    env["AENV_SERVER__CODE_INTERPRETER"] = "false"   # no background build skews the figures
    if network is not None:
        env["AENV_VM__NETWORK"] = network
    proc = subprocess.Popen([sys.executable, "-m", "aenv_cli.main", "server", "--data-dir", str(data_dir),
                             "--port", "0", "--quiet"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    values: dict[str, str] = {}
    while len(values) < 3:
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"aenv server exited ({proc.wait()}) before it was ready")
        if line.startswith("export E2B_"):
            name, _, value = line[len("export "):].strip().partition("=")
            values[name] = value
    return proc, values


def envd_address(sandbox_id: str) -> str:
    """``host:port`` of the sandbox's envd as the node reaches it (from its QEMU: the
    host forward on its command line, on the sandbox namespace's address when the node
    isolates sandboxes, else 127.0.0.1; in tap mode the namespace's own address)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-name" in argv and argv[argv.index(b"-name") + 1].decode() == sandbox_id:
            m = re.search(rb"hostfwd=tcp:([0-9.]+):(\d+)-", b" ".join(argv))
            if m:
                return f"{m.group(1).decode()}:{int(m.group(2))}"
            return f"{namespace_address(entry)}:{ENVD_PORT}"
    raise BenchError(f"no QEMU process found for {sandbox_id} on this host")


def namespace_address(proc: Path) -> str:
    """The eth0 address of the named network namespace process ``proc`` runs in."""
    inode = os.stat(proc / "ns" / "net").st_ino
    for ns in Path("/run/netns").iterdir():
        if os.stat(ns).st_ino == inode:
            out = subprocess.run(["ip", "-n", ns.name, "-4", "-o", "addr", "show", "dev", "eth0"],
                                 capture_output=True, text=True, check=True).stdout
            return out.split()[3].split("/")[0]
    raise BenchError(f"the QEMU {proc.name} is in no named network namespace")


def pooled(url: str, key: str) -> int:
    req = urllib.request.Request(url + "/metrics", headers={"X-API-Key": key})
    with urllib.request.urlopen(req, timeout=10) as r:
        m = re.search(r'aenv_sandboxes\{state="pooled"\} (\d+)', r.read().decode())
    return int(m.group(1)) if m else 0


def wait_pool(url: str, key: str, size: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while pooled(url, key) < size:
        if time.monotonic() > deadline:
            raise BenchError(f"warm pool did not refill to {size} within {timeout} s")
        time.sleep(0.2)


def stats(name: str, ms: list[float]) -> dict[str, float | str | int]:
    return {"name": name, "n": len(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "mean": sum(ms) / len(ms)}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def guest_tokens(data_dir: Path) -> Callable[[str], str]:
    """The guest token of each sandbox of the server this benchmark started on ``data_dir``
    (its envd secret: AENV_ENVD_SECRET, else the file it made there). A secured sandbox's
    envd takes that token only; the client's token is the proxy's (access_tokens.py)."""
    from aenv_api.server.access_tokens import AccessTokens
    from aenv_api.server.auth import ENVD_SECRET_ENV, ENVD_SECRET_FILE

    secret = os.environ.get(ENVD_SECRET_ENV, "").strip() or (data_dir / ENVD_SECRET_FILE).read_text().strip()
    return AccessTokens(secret.encode()).guest


def has_guest_tokens() -> bool:
    """Whether this tree's node gives guests a token of their own (issue 29)."""
    try:
        from aenv_api.server.access_tokens import AccessTokens  # noqa: F401
    except ImportError:
        return False
    return True


def direct_client(sandbox_id: str, guest_token: Callable[[str], str] | None) -> Any:
    """A client of the sandbox's envd straight through its host forward, no node code
    between (with the guest's own token when it is secured)."""
    from e2b import Sandbox

    url = f"http://{envd_address(sandbox_id)}"
    if guest_token is None:      # a node whose client and guest tokens are one (before issue 29)
        return Sandbox.connect(sandbox_id, sandbox_url=url)
    from e2b.connection_config import ConnectionConfig
    from e2b.envd.versions import ENVD_DEBUG_FALLBACK

    token = guest_token(sandbox_id)
    config = ConnectionConfig(sandbox_url=url, extra_sandbox_headers={"X-Access-Token": token})
    return Sandbox(sandbox_id=sandbox_id, sandbox_domain=None, envd_version=ENVD_DEBUG_FALLBACK,
                   envd_access_token=token, connection_config=config)


def bench_proxy(calls: int, server_pid: int | None, guest_token: Callable[[str], str] | None = None) -> dict:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=3600)
    try:
        direct = direct_client(sbx.sandbox_id, guest_token)
        for c in (sbx, direct):
            for _ in range(5):
                c.commands.run("true")
        via, straight = [], []
        for i in range(calls):
            order = (sbx, direct) if i % 2 == 0 else (direct, sbx)
            for c in order:
                t0 = time.perf_counter()
                c.commands.run("true")
                (via if c is sbx else straight).append((time.perf_counter() - t0) * 1000)
        # The proxy's CPU cost, independent of how loaded the machine is: server-process
        # CPU per call through the proxy minus per call straight to envd (the server also
        # serves every sandbox's disk over NBD, which both kinds of call use).
        cpu_ms = None
        if server_pid:
            per: dict[str, float] = {}
            for name, c in (("direct", direct), ("proxy", sbx)):
                c0 = cpu_seconds(server_pid)
                for _ in range(calls // 2):
                    c.commands.run("true")
                per[name] = (cpu_seconds(server_pid) - c0) * 1000 / (calls // 2)
            cpu_ms = per["proxy"] - per["direct"]
    finally:
        sbx.kill()
    diffs = [a - b for a, b in zip(via, straight)]
    return {"server_cpu_ms_per_call": cpu_ms, "proxy": stats("through the proxy", via), "direct": stats("straight to envd", straight),
            "overhead_p50_ms": percentile(via, 50) - percentile(straight, 50),
            "overhead_p99_ms": percentile(via, 99) - percentile(straight, 99),
            "paired_diff_p50_ms": percentile(diffs, 50)}


def bench_create(url: str, key: str, creates: int, pool_size: int) -> dict:
    from e2b import Sandbox

    total, create_only = [], []
    for _ in range(creates):
        if pool_size:
            wait_pool(url, key, pool_size)
        t0 = time.perf_counter()
        s = Sandbox.create()
        t1 = time.perf_counter()
        s.commands.run("true")
        t2 = time.perf_counter()
        total.append((t2 - t0) * 1000)
        create_only.append((t1 - t0) * 1000)
        s.kill()
    return {"create_to_first_command": stats("create → first command", total),
            "create": stats("create (API answer)", create_only)}


def bench_throughput(clients: int, seconds: float) -> dict:
    from e2b import Sandbox

    done: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            try:
                s = Sandbox.create()
                s.kill()
            except Exception as e:  # counted and reported, never hidden
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                continue
            with lock:
                done.append((time.perf_counter() - t0) * 1000)
    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"clients": clients, "seconds": wall, "creates": len(done), "creates_per_s": len(done) / wall,
            "errors": len(errors), "error_samples": errors[:3],
            "create_kill": stats("create+kill", done) if done else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url"), p.add_argument("--api-key")
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--creates", type=int, default=20)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--pool-size", type=int, default=2)
    p.add_argument("--network", choices=("auto", "user", "tap"),
                   help="[vm] network of the server it starts (default: the server's, auto)")
    p.add_argument("--only-proxy", action="store_true", help="measure the proxy overhead only")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    proc = None
    tmp = None
    try:
        if args.url:
            if not args.api_key:
                raise BenchError("--url needs --api-key")
            env = {"E2B_API_KEY": args.api_key, "E2B_API_URL": args.url, "E2B_SANDBOX_URL": args.url}
        else:
            data_dir = args.data_dir or Path(tmp := tempfile.mkdtemp(prefix="api-bench-"))
            print(f"api_bench: starting aenv server on {data_dir} (pool {args.pool_size})", file=sys.stderr)
            proc, env = start_server(data_dir, args.pool_size, args.network)
        os.environ.update(env)
        url, key = env["E2B_API_URL"], env["E2B_API_KEY"]
        if args.pool_size:
            wait_pool(url, key, args.pool_size, timeout=300)
        result = {"machine": machine_info(), "load_before": os.getloadavg()[0]}
        print("api_bench: proxy overhead ...", file=sys.stderr)
        tokens = guest_tokens(data_dir) if proc is not None and has_guest_tokens() else None
        result["proxy"] = bench_proxy(args.calls, proc.pid if proc is not None else None, tokens)
        if args.only_proxy:
            result["create"] = result["throughput"] = None
        if not args.only_proxy:
            print("api_bench: create → first command ...", file=sys.stderr)
            result["create"] = bench_create(url, key, args.creates, args.pool_size)
            print(f"api_bench: {args.clients} clients creating for {args.seconds:.0f} s ...", file=sys.stderr)
            result["throughput"] = bench_throughput(args.clients, args.seconds)
        result["load_after"] = os.getloadavg()[0]
    except BenchError as e:
        print(f"api_bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    measures = [result["proxy"]["proxy"], result["proxy"]["direct"]]
    if result["create"]:
        measures += [result["create"]["create_to_first_command"], result["create"]["create"]]
    rows = [[s["name"], s["n"], f"{s['p50']:.1f}", f"{s['p90']:.1f}", f"{s['p99']:.1f}", f"{s['mean']:.1f}"]
            for s in measures]
    header = ["measure", "n", "p50 ms", "p90 ms", "p99 ms", "mean ms"]
    if args.markdown:
        print(markdown_table(rows, header))
    else:
        print_table(rows, header)
    pr, th = result["proxy"], result["throughput"]
    cpu = pr["server_cpu_ms_per_call"]
    print(f"\nproxy overhead: p50 {pr['overhead_p50_ms']:+.2f} ms, p99 {pr['overhead_p99_ms']:+.2f} ms, "
          f"paired-difference p50 {pr['paired_diff_p50_ms']:+.2f} ms"
          + (f"; proxy CPU {cpu:.2f} ms per call (server process, proxied minus direct)" if cpu is not None else ""))
    if th:
        print(f"creates/s with {th['clients']} clients: {th['creates_per_s']:.2f} ({th['creates']} in "
              f"{th['seconds']:.1f} s, {th['errors']} errors)")
    print(f"load average {result['load_before']:.1f} -> {result['load_after']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
