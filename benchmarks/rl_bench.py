"""How an RL harness loads a node (issue 27), aenv beside Docker in one run.

    sudo .venv/bin/python benchmarks/rl_bench.py [--bursts 16 48] [--forks 16 20] [--idle 32]
        [--sequential 10] [--configs gated ungated] [--peer docker|none] [--json out.json]

Every aenv figure is measured through the real E2B SDK against `aenv server` (default
config but ``max_sandboxes`` 200), the way an RL harness drives it:

* **burst N**: N ``AsyncSandbox.create`` + ``commands.run("true")`` started at once;
  per sandbox its time to interactive (burst start → first command done), then p50,
  p95, p99, the first, the wall time, successes, client-side failures, and how many
  429s the node answered (the SDK waits ``Retry-After`` and retries; a create still
  refused after the SDK's retries is retried by the harness a second later, as RL
  harnesses do, and counted);
* **fork N**: a prepared sandbox (a file written) forked into N through the SDK: the
  call, then every child's first command (reading the prepared file) done;
* **idle memory**: N sandboxes of ``base`` created one after another, each idle after
  one command; (MemTotal − MemAvailable after − before) / N;
* **sequential**: create → first command, one after another.

``--configs``: ``gated`` is the node's default restore gate ([vm] restore_slots = one
per CPU); ``ungated`` sets restore_slots to 1024 (every restore at once, as before the
gate); ``slots=N`` sets N. The peer: Debian's Docker engine (``docker.io``; its own ``dockerd`` with its own
data root, no bridge, no iptables), with an image of the guest's own root filesystem:
``docker run -d`` + ``docker exec true`` bursts, ``docker commit`` + N ``docker run`` as
its fork, idle memory per container (``sleep infinity``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import (
    ensure_debian_packages,
    machine_info,
    percentile,
    print_table,
    temp_env,
)

HARNESS_RETRIES = 20        # a create the SDK gave up on is retried this often, a second apart


def mem_used() -> int:
    """MemTotal − MemAvailable, bytes."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def stats(ttis: list[float], wall: float, ok: int, n: int, **extra: Any) -> dict[str, Any]:
    return {"n": n, "ok": ok, "failed": n - ok, "wall": wall,
            "first": min(ttis) if ttis else None, "p50": percentile(ttis, 50) if ttis else None,
            "p95": percentile(ttis, 95) if ttis else None, "p99": percentile(ttis, 99) if ttis else None,
            **extra}


# --------------------------------------------------------------------------------- aenv

def refused_total(url: str) -> float:
    import urllib.request
    req = urllib.request.Request(f"{url}/metrics", headers={"X-API-Key": os.environ["E2B_API_KEY"]})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r'^aenv_restore_refused_total\{[^}]*\} (\S+)$', text, re.MULTILINE))


async def aenv_interactive(t0: float, retried: list[int]) -> tuple[Any, float]:
    from e2b import AsyncSandbox
    from e2b.exceptions import RateLimitException
    for attempt in range(HARNESS_RETRIES + 1):
        try:
            sbx = await AsyncSandbox.create(timeout=600)
            break
        except RateLimitException:
            if attempt == HARNESS_RETRIES:
                raise
            retried[0] += 1
            await asyncio.sleep(1)
    await sbx.commands.run("true")
    return sbx, time.monotonic() - t0


async def kill_all(sandboxes: list[Any]) -> None:
    await asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True)


async def aenv_burst(url: str, n: int) -> dict[str, Any]:
    before = refused_total(url)
    retried = [0]
    t0 = time.monotonic()
    results = await asyncio.gather(*(aenv_interactive(t0, retried) for _ in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    good = [r for r in results if not isinstance(r, BaseException)]
    errors = sorted({type(r).__name__ + ": " + str(r)[:120] for r in results if isinstance(r, BaseException)})
    await kill_all([s for s, _ in good])
    return stats([t for _, t in good], wall, len(good), n, node_429=refused_total(url) - before,
                 harness_retries=retried[0], errors=errors[:5])


async def aenv_fork(n: int) -> dict[str, Any]:
    from e2b import AsyncSandbox
    parent = await AsyncSandbox.create(timeout=600)
    await parent.files.write("/home/user/prepared", "state")
    await parent.commands.run("true")
    t0 = time.monotonic()
    children = await parent.fork(count=n)
    call = time.monotonic() - t0
    kids = [c for c in children if not isinstance(c, BaseException)]

    async def first(c: Any) -> float:
        r = await c.commands.run("cat /home/user/prepared")
        assert r.stdout.strip() == "state", r.stdout
        return time.monotonic() - t0
    ttis = await asyncio.gather(*(first(c) for c in kids), return_exceptions=True)
    done = [t for t in ttis if isinstance(t, float)]
    wall = time.monotonic() - t0
    await kill_all([*kids, parent])
    return stats(done, wall, len(done), n, call=call,
                 errors=sorted({str(c)[:120] for c in [*children, *ttis] if isinstance(c, BaseException)})[:5])


async def aenv_idle(n: int) -> dict[str, Any]:
    from e2b import AsyncSandbox
    await asyncio.sleep(3)
    before = mem_used()
    boxes = []
    for _ in range(n):
        s = await AsyncSandbox.create(timeout=600)
        await s.commands.run("true")
        boxes.append(s)
    await asyncio.sleep(10)
    after = mem_used()
    await kill_all(boxes)
    return {"n": n, "mib_per_sandbox": (after - before) / n / 2**20}


async def aenv_sequential(n: int) -> dict[str, Any]:
    ttis = []
    t_all = time.monotonic()
    for _ in range(n):
        t0 = time.monotonic()
        s, t = await aenv_interactive(t0, [0])
        ttis.append(t)
        await s.kill()
    return stats(ttis, time.monotonic() - t_all, n, n)


@contextlib.contextmanager
def aenv_server(work: Path, slots: int | None) -> Iterator[Any]:
    from tests.aenv_api.server.conftest import start_server
    env = {"AENV_SERVER__MAX_SANDBOXES": "200"}
    if slots is not None:
        env["AENV_VM__RESTORE_SLOTS"] = str(slots)
    srv = start_server(work / "node", work / "logs", env=env)
    try:
        with temp_env(**srv.sdk_env()):     # the SDK finds the node as a user's would: env vars only
            yield srv
    finally:
        srv.stop()


# ------------------------------------------------------------------------------- docker

class Docker:
    """A dockerd of the benchmark's own (own data root, no bridge, no iptables)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.sock = work / "docker.sock"
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.sock}")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        ensure_debian_packages({"docker.io": "dockerd"})
        with open(self.work / "dockerd.log", "wb") as log:   # dockerd keeps its own copy of the fd
            self.proc = subprocess.Popen(
                ["dockerd", "--data-root", str(self.work / "data"), "--exec-root", str(self.work / "exec"),
                 "--pidfile", str(self.work / "dockerd.pid"), "-H", f"unix://{self.sock}", "--bridge", "none",
                 "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
                 "--userland-proxy=false"], stdout=log, stderr=log)
        for _ in range(300):
            if self.sock.exists() and self.cli("version").returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"dockerd did not start: {(self.work / 'dockerd.log').read_text()[-2000:]}")

    def cli(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["/usr/bin/docker", *args], env=self.env, input=input, capture_output=True,
                              check=False)

    async def acli(self, *args: str) -> str:
        p = await asyncio.create_subprocess_exec("/usr/bin/docker", *args, env=self.env,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {err.decode()[-300:]}")
        return out.decode().strip()

    def import_rootfs(self, rootfs: Path, tag: str) -> None:
        """The guest's root filesystem (an ext4 image) as a docker image."""
        mnt = self.work / "rootfs"
        mnt.mkdir()
        subprocess.run(["mount", "-o", "loop,ro", str(rootfs), str(mnt)], check=True)
        try:
            tar = subprocess.Popen(["tar", "-C", str(mnt), "-cf", "-", "."], stdout=subprocess.PIPE)
            assert tar.stdout is not None
            imp = subprocess.run(["/usr/bin/docker", "import", "-", tag], env=self.env, stdin=tar.stdout,
                                 capture_output=True, check=False)
            tar.wait()
            if imp.returncode != 0:
                raise RuntimeError(f"docker import: {imp.stderr.decode()[-500:]}")
        finally:
            subprocess.run(["umount", str(mnt)], check=False)

    def stop(self) -> None:
        if self.proc is None:
            return
        ids = self.cli("ps", "-aq").stdout.decode().split()
        if ids:
            self.cli("rm", "-f", *ids)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def docker_interactive(d: Docker, image: str, t0: float) -> tuple[str, float]:
    cid = await d.acli("run", "-d", "--network", "none", image, "sleep", "infinity")
    await d.acli("exec", cid, "true")
    return cid, time.monotonic() - t0


async def docker_burst(d: Docker, image: str, n: int) -> dict[str, Any]:
    t0 = time.monotonic()
    results = await asyncio.gather(*(docker_interactive(d, image, t0) for _ in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    good = [r for r in results if not isinstance(r, BaseException)]
    if good:
        await d.acli("rm", "-f", *[c for c, _ in good])
    return stats([t for _, t in good], wall, len(good), n,
                 errors=sorted({str(r)[:120] for r in results if isinstance(r, BaseException)})[:5])


async def docker_fork(d: Docker, image: str, n: int) -> dict[str, Any]:
    parent = await d.acli("run", "-d", "--network", "none", image, "sleep", "infinity")
    await d.acli("exec", parent, "sh", "-c", "echo state > /home/prepared || echo state > /prepared")
    t0 = time.monotonic()
    snap = await d.acli("commit", parent, "rl-bench-fork:latest")
    call = time.monotonic() - t0

    async def child() -> tuple[str, float]:
        cid = await d.acli("run", "-d", "--network", "none", "rl-bench-fork:latest", "sleep", "infinity")
        await d.acli("exec", cid, "sh", "-c", "cat /home/prepared 2>/dev/null || cat /prepared")
        return cid, time.monotonic() - t0
    results = await asyncio.gather(*(child() for _ in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    good = [r for r in results if not isinstance(r, BaseException)]
    await d.acli("rm", "-f", parent, *[c for c, _ in good])
    await d.acli("rmi", "-f", snap)
    return stats([t for _, t in good], wall, len(good), n, call=call)


async def docker_idle(d: Docker, image: str, n: int) -> dict[str, Any]:
    await asyncio.sleep(3)
    before = mem_used()
    ids = []
    for _ in range(n):
        cid, _ = await docker_interactive(d, image, time.monotonic())
        ids.append(cid)
    await asyncio.sleep(10)
    after = mem_used()
    await d.acli("rm", "-f", *ids)
    return {"n": n, "mib_per_sandbox": (after - before) / n / 2**20}


async def docker_sequential(d: Docker, image: str, n: int) -> dict[str, Any]:
    ttis = []
    t_all = time.monotonic()
    for _ in range(n):
        cid, t = await docker_interactive(d, image, time.monotonic())
        ttis.append(t)
        await d.acli("rm", "-f", cid)
    return stats(ttis, time.monotonic() - t_all, n, n)


# --------------------------------------------------------------------------------- main

Part = Callable[[], Awaitable[dict[str, Any]]]


def parts_of(args: argparse.Namespace, burst: Callable[[int], Awaitable[dict[str, Any]]],
             fork: Callable[[int], Awaitable[dict[str, Any]]], idle: Callable[[int], Awaitable[dict[str, Any]]],
             sequential: Callable[[int], Awaitable[dict[str, Any]]]) -> list[tuple[str, Part]]:
    out: list[tuple[str, Part]] = []
    if args.sequential:
        out.append((f"sequential x{args.sequential}", lambda: sequential(args.sequential)))
    for n in args.bursts:
        out.append((f"burst {n}", functools.partial(burst, n)))
    for n in args.forks:
        out.append((f"fork {n}", functools.partial(fork, n)))
    if args.idle:
        out.append((f"idle {args.idle}", lambda: idle(args.idle)))
    return out


async def run_parts(label: str, parts: list[tuple[str, Part]], results: dict[str, dict[str, Any]]) -> None:
    for name, part in parts:
        t = time.monotonic()
        results[f"{label} / {name}"] = await part()
        print(f"[rl-bench] {label} / {name}: {json.dumps(results[f'{label} / {name}'], default=str)} "
              f"({time.monotonic() - t:.0f} s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", type=int, nargs="*", default=[16, 48])
    ap.add_argument("--forks", type=int, nargs="*", default=[16, 20])
    ap.add_argument("--idle", type=int, default=32)
    ap.add_argument("--sequential", type=int, default=10)
    ap.add_argument("--configs", nargs="+", default=["gated", "ungated"],
                    help="gated (the default restore gate), ungated (restore_slots 1024), or slots=N")
    ap.add_argument("--peer", choices=("docker", "none"), default="docker")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("rl_bench needs root (aenv's network namespaces, dockerd)", file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="aenv-rl-") as tmp:
        work = Path(tmp)
        for config in args.configs:
            if config not in ("gated", "ungated") and not re.fullmatch(r"slots=[1-9][0-9]*", config):
                ap.error(f"--configs: {config!r} is none of gated, ungated, slots=N")
            slots = None if config == "gated" else 1024 if config == "ungated" else int(config[6:])
            with aenv_server(work / config, slots) as srv:
                asyncio.run(run_parts(f"aenv {config}", parts_of(
                    args, functools.partial(aenv_burst, srv.url), aenv_fork, aenv_idle, aenv_sequential), results))
        if args.peer == "docker":
            from aenv_vm.guest import ensure_guest
            d = Docker(work / "docker")
            d.work.mkdir()
            try:
                d.start()
                d.import_rootfs(ensure_guest(quiet=True).rootfs, "rl-bench-rootfs:latest")
                image = "rl-bench-rootfs:latest"
                asyncio.run(run_parts("docker", parts_of(
                    args, functools.partial(docker_burst, d, image), functools.partial(docker_fork, d, image),
                    functools.partial(docker_idle, d, image), functools.partial(docker_sequential, d, image)),
                    results))
            finally:
                d.stop()
    rows = []
    for name, r in results.items():
        f = lambda v: "-" if v is None else f"{v:.2f}"
        if "mib_per_sandbox" in r:
            rows.append([name, "", "", "", "", "", f"{r['mib_per_sandbox']:.1f} MiB each", ""])
            continue
        rows.append([name, f"{r['ok']}/{r['n']}", f(r["first"]), f(r["p50"]), f(r["p95"]), f(r["p99"]),
                     f(r["wall"]), f"{r.get('node_429', '')}"])
    print_table(rows, ["part", "ok", "first s", "p50 s", "p95 s", "p99 s", "wall s", "429s"])
    print(json.dumps(machine_info()))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
