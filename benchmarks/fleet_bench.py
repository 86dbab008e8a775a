"""The fleet (issue 16), one run:

1. gateway overhead -- ``commands.run("true")`` through ``aenv gateway`` vs straight
   to the node (the node's own proxy), interleaved call by call, with the real e2b
   SDK; plus the gateway's CPU per call;
2. create -> first command through the gateway vs on the node directly;
3. cold-node resume (``cold_resume_bench.measure``: cold node vs warm node vs
   fetch-everything-then-resume);
4. scale simulation -- the scheduler and a real redis-server with N simulated node
   agents (default 1,000, heartbeating in their own process) and M sandboxes
   (default 100,000): placement p50/p99 per create, Redis operations per create
   (INFO commandstats), gateway CPU per create.

Sections 1-2 start a real redis-server, one ``aenv server`` with ``[cluster]`` and one
``aenv gateway`` on loopback (``--data-dir``: reuse a node data dir so the template is
not built again).

    python benchmarks/fleet_bench.py [--calls 200] [--creates 10] [--nodes 1000]
        [--sandboxes 100000] [--scale-only] [--markdown] [--json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BenchError, machine_info, markdown_table, percentile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


RedisServer = _load(REPO / "tests" / "aenv_fleet" / "redisserver.py", "fleet_redisserver").RedisServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stats(name: str, ms: list[float]) -> dict[str, Any]:
    return {"name": name, "n": len(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "mean": sum(ms) / len(ms)}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_exports(proc: subprocess.Popen, want: int) -> dict[str, str]:
    assert proc.stdout is not None
    values: dict[str, str] = {}
    while len(values) < want:
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"process exited ({proc.wait()}) before it was ready")
        if line.startswith("export E2B_"):
            name, _, value = line[len("export "):].strip().partition("=")
            values[name] = value
    return values


# --- 1 + 2: a node and a gateway -----------------------------------------------------------


# the fleet's shared secret (docs/cluster.md, "Trust"): node records are signed with it
FLEET_SECRET = "fleet-bench-secret-" + "0" * 24


def start_fleet(data_dir: Path, redis_url: str) -> tuple[subprocess.Popen, subprocess.Popen, dict[str, str]]:
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    secret = data_dir / "fleet-secret"
    secret.write_text(FLEET_SECRET + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_CLUSTER"))}
    env.update(AENV_VM__POOL_SIZE="1", AENV_SERVER__CODE_INTERPRETER="false", AENV_CLUSTER__REDIS_URL=redis_url, AENV_CLUSTER__NODE_ID="bench-node",
               AENV_CLUSTER__ADVERTISE_URL=f"http://127.0.0.1:{port}", AENV_CLUSTER__FLEET_SECRET_FILE=str(secret),
               PYTHONPATH=str(REPO))
    node = subprocess.Popen([sys.executable, "-m", "aenv_cli.main", "server", "--data-dir", str(data_dir),
                             "--port", str(port), "--quiet"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    node_env = read_exports(node, 3)
    genv = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_"))}
    genv.update(PYTHONPATH=str(REPO), AENV_GATEWAY__FLEET_SECRET_FILE=str(secret))
    gw = subprocess.Popen([sys.executable, "-m", "aenv_cli.main", "gateway", "--port", "0", "--quiet",
                           "--redis-url", redis_url, "--data-dir", str(data_dir / "gateway")], cwd=REPO, env=genv,
                          stdout=subprocess.PIPE, text=True)
    gw_env = read_exports(gw, 2)
    return node, gw, {"key": node_env["E2B_API_KEY"], "node": node_env["E2B_API_URL"],
                      "gateway": gw_env["E2B_API_URL"]}


def wait_pool(url: str, key: str, timeout: float = 300.0) -> None:
    import re
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + "/metrics", headers={"X-API-Key": key})
        with urllib.request.urlopen(req, timeout=10) as r:
            m = re.search(r'aenv_sandboxes\{state="pooled"\} (\d+)', r.read().decode())
        if m and int(m.group(1)) >= 1:
            return
        time.sleep(0.2)
    raise BenchError("the node's warm pool did not refill")


def bench_gateway(urls: dict[str, str], gw_pid: int, calls: int) -> dict[str, Any]:
    from e2b import Sandbox

    opts = {"api_key": urls["key"], "request_timeout": 600}
    via = Sandbox.create(timeout=3600, api_url=urls["gateway"], sandbox_url=urls["gateway"], **opts)
    try:
        direct = Sandbox.connect(via.sandbox_id, api_url=urls["node"], sandbox_url=urls["node"], **opts)
        for c in (via, direct):
            for _ in range(5):
                c.commands.run("true")
        gw_ms, node_ms = [], []
        for i in range(calls):
            for c in ((via, direct) if i % 2 == 0 else (direct, via)):
                t0 = time.perf_counter()
                c.commands.run("true")
                (gw_ms if c is via else node_ms).append((time.perf_counter() - t0) * 1000)
        c0 = cpu_seconds(gw_pid)
        for _ in range(calls // 2):
            via.commands.run("true")
        cpu_ms = (cpu_seconds(gw_pid) - c0) * 1000 / (calls // 2)
    finally:
        via.kill()
    return {"gateway": stats("commands.run(\"true\") through the gateway", gw_ms),
            "node": stats("commands.run(\"true\") straight to the node", node_ms),
            "overhead_p50_ms": percentile(gw_ms, 50) - percentile(node_ms, 50),
            "overhead_p99_ms": percentile(gw_ms, 99) - percentile(node_ms, 99),
            "gateway_cpu_ms_per_call": cpu_ms}


def bench_create(urls: dict[str, str], creates: int) -> dict[str, Any]:
    from e2b import Sandbox

    out: dict[str, list[float]] = {"gateway": [], "node": []}
    for i in range(creates):
        for where in (("gateway", "node") if i % 2 == 0 else ("node", "gateway")):
            wait_pool(urls["node"], urls["key"])
            t0 = time.perf_counter()
            s = Sandbox.create(timeout=600, api_url=urls[where], sandbox_url=urls[where], api_key=urls["key"],
                               request_timeout=600)
            s.commands.run("true")
            out[where].append((time.perf_counter() - t0) * 1000)
            s.kill()
    return {"gateway": stats("create -> first command, through the gateway", out["gateway"]),
            "node": stats("create -> first command, on the node", out["node"])}


# --- 3: cold-node resume --------------------------------------------------------------------
def bench_cold_resume(args: argparse.Namespace) -> dict[str, Any]:
    """Cold-node resume of a 512 MiB sandbox vs a warm-node resume vs fetch-everything-
    then-resume, in one run: benchmarks/cold_resume_bench.py (two nodes sharing one
    repository; docs/benchmarks.md "Cold-node resume")."""
    mod = _load(Path(__file__).with_name("cold_resume_bench.py"), "cold_resume_bench")
    return mod.measure(markdown=True)


# --- 4: scale simulation --------------------------------------------------------------------


def _agents(redis_url: str, nodes: int, slots: int, heartbeat: float, stop: Any, counter: Any) -> None:
    """The simulated node agents: ``nodes`` of them heartbeating every ``heartbeat`` s
    (their own process: their CPU is not the gateway's)."""
    from aenv_fleet.coord import Capacity, Coordinator
    from aenv_wire.fleet_auth import FleetKeys

    async def main() -> None:
        c = Coordinator(redis_url, FleetKeys.parse(FLEET_SECRET))
        cap = {i: Capacity(url=f"http://10.0.{i // 250}.{i % 250}:8000", max_sandboxes=slots, vcpus=64,
                           mem_total_mib=512 * 1024, mem_avail_mib=400 * 1024, disk_free_mib=10 ** 6,
                           sandbox_mem_mib=512, running=0, paused=0) for i in range(nodes)}
        for i in range(nodes):
            await c.heartbeat(f"sim-{i:04d}", cap[i], 60)
            await c.add_templates(f"sim-{i:04d}", ["base"] if i % 4 == 0 else ["base", f"tpl-{i % 10}"])
        counter.value = -1                       # registered
        per = heartbeat / nodes
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            await c.heartbeat(f"sim-{i % nodes:04d}", cap[i % nodes], 60)
            counter.value += 0 if counter.value < 0 else 1
            i += 1
            await asyncio.sleep(max(0.0, per - (time.perf_counter() - t0)))
        await c.close()

    asyncio.run(main())


def _commandstats(r: Any) -> int:
    return sum(v["calls"] for k, v in r.info("commandstats").items())


async def _place_many(redis_url: str, count: int, concurrency: int, start: int) -> tuple[list[float], int]:
    from aenv_fleet.coord import Coordinator
    from aenv_wire.fleet_auth import FleetKeys

    c = Coordinator(redis_url, FleetKeys.parse(FLEET_SECRET))
    lat: list[float] = []
    failed = 0
    it = iter(range(start, start + count))

    async def worker() -> None:
        nonlocal failed
        for n in it:
            t0 = time.perf_counter()
            got = await c.place("base" if n % 3 else f"tpl-{n % 10}", 0)
            lat.append((time.perf_counter() - t0) * 1000)
            if got is None:
                failed += 1
                continue
            node, rid = got
            await c.bind(f"sbx-{n:07d}", node, "running", {"templateID": "base", "startedAt": time.time()})
            await c.unreserve(node, rid)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await c.close()
    return lat, failed


def bench_scale(nodes: int, sandboxes: int, workdir: Path) -> dict[str, Any]:

    srv = RedisServer.start(workdir / "redis-scale")
    # appendfsync always in the test config; production uses everysec (docs/cluster.md)
    r = srv.client(decode_responses=False)
    r.config_set("appendfsync", "everysec")
    slots = -(-(sandboxes + 2000) * 5 // 4 // nodes)      # 25 % headroom
    stop, counter = multiprocessing.Event(), multiprocessing.Value("l", 0)
    agents = multiprocessing.Process(target=_agents, args=(srv.url, nodes, slots, 2.0, stop, counter))
    agents.start()
    try:
        while counter.value != -1:
            if not agents.is_alive():
                raise BenchError("the simulated agents died")
            time.sleep(0.1)
        counter.value = 0
        # Redis ops per create, without the heartbeats' (calibration: agents quiet)
        stop.set()
        agents.join()
        calib = min(2000, sandboxes // 10)
        ops0 = _commandstats(r)
        asyncio.run(_place_many(srv.url, calib, 8, 0))
        ops_per_create = (_commandstats(r) - ops0) / calib
        stop.clear()
        agents = multiprocessing.Process(target=_agents, args=(srv.url, nodes, slots, 2.0, stop, counter))
        agents.start()
        while counter.value != -1:
            time.sleep(0.1)
        counter.value = 0
        # the run: the rest of the sandboxes, heartbeats going on
        cpu0, t0 = time.process_time(), time.perf_counter()
        lat, failed = asyncio.run(_place_many(srv.url, sandboxes - calib, 32, calib))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        heartbeats = counter.value
        # one create at a time (heartbeats going on): the latency without queueing behind
        # the gateway's own concurrent creates
        solo, _ = asyncio.run(_place_many(srv.url, min(2000, max(1, sandboxes // 50)), 1, sandboxes))
        stop.set()
        agents.join()
        bound = r.zcard("aenv:nodes"), sum(int(r.scard(f"aenv:node:sim-{i:04d}:sbx")) for i in range(nodes))
        over = [i for i in range(nodes) if int(r.scard(f"aenv:node:sim-{i:04d}:sbx")) > slots]
        mem = r.info("memory")["used_memory"]
    finally:
        stop.set()
        if agents.is_alive():
            agents.join(timeout=10)
        r.close()
        srv.stop()
    return {"nodes": nodes, "sandboxes": sandboxes, "slots_per_node": slots, "placed": bound[1],
            "failed": failed, "nodes_over_capacity": len(over),
            "placement": stats("placement (PLACE), 32 creates in flight", lat),
            "placement_solo": stats("placement (PLACE), one create at a time", solo),
            "redis_ops_per_create": ops_per_create, "creates_per_s": (sandboxes - calib) / wall,
            "gateway_cpu_ms_per_create": cpu * 1000 / (sandboxes - calib), "heartbeats_during_run": heartbeats,
            "redis_used_memory_mib": mem / 2 ** 20}


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt     # SIGTERM cleans up as Ctrl-C does (servers stopped, temp dir removed)


def main() -> int:
    signal.signal(signal.SIGTERM, _terminated)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, help="the node's data dir (reuse one: the template is built once)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--creates", type=int, default=10)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--sandboxes", type=int, default=100_000)
    p.add_argument("--scale-only", action="store_true")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if shutil.which("redis-server") is None:
        print("fleet_bench: error: redis-server is not installed", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    result: dict[str, Any] = {"machine": machine_info(), "load_before": os.getloadavg()[0]}
    node = gw = srv = None
    try:
        if not args.scale_only:
            srv = RedisServer.start(tmp / "redis")
            data_dir = args.data_dir or tmp / "node"
            print(f"fleet_bench: node on {data_dir} + gateway, redis {srv.url}", file=sys.stderr)
            node, gw, urls = start_fleet(data_dir, srv.url)
            wait_pool(urls["node"], urls["key"])
            print("fleet_bench: gateway overhead ...", file=sys.stderr)
            result["gateway"] = bench_gateway(urls, gw.pid, args.calls)
            print("fleet_bench: create -> first command ...", file=sys.stderr)
            result["create"] = bench_create(urls, args.creates)
            result["cold_resume"] = bench_cold_resume(args)
        print(f"fleet_bench: scale simulation, {args.nodes} nodes, {args.sandboxes} sandboxes ...", file=sys.stderr)
        result["scale"] = bench_scale(args.nodes, args.sandboxes, tmp)
        result["load_after"] = os.getloadavg()[0]
    except BenchError as e:
        print(f"fleet_bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        for proc in (gw, node):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=180)
        if srv is not None:
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for sec in ("gateway", "create"):
        for k in ("gateway", "node"):
            if sec in result:
                s = result[sec][k]
                rows.append([s["name"], s["n"], f"{s['p50']:.1f}", f"{s['p90']:.1f}", f"{s['p99']:.1f}"])
    sc = result["scale"]
    for pl in (sc["placement"], sc["placement_solo"]):
        rows.append([f"{pl['name']}, {sc['nodes']} nodes, {sc['sandboxes']} sandboxes", pl["n"], f"{pl['p50']:.2f}",
                     f"{pl['p90']:.2f}", f"{pl['p99']:.2f}"])
    table = markdown_table(rows, ["measure", "n", "p50 ms", "p90 ms", "p99 ms"])
    print(table)
    if "gateway" in result:
        g = result["gateway"]
        print(f"\ngateway overhead p50 {g['overhead_p50_ms']:.2f} ms, p99 {g['overhead_p99_ms']:.2f} ms; "
              f"gateway CPU {g['gateway_cpu_ms_per_call']:.2f} ms per call")
    print(f"scale: {sc['redis_ops_per_create']:.1f} Redis ops per create, {sc['gateway_cpu_ms_per_create']:.3f} ms "
          f"gateway CPU per create, {sc['creates_per_s']:.0f} creates/s, placed {sc['placed']}, failed "
          f"{sc['failed']}, nodes over capacity {sc['nodes_over_capacity']}, Redis {sc['redis_used_memory_mib']:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
