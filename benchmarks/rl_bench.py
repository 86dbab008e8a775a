"""How an RL harness loads a node (issue 27), aenv beside Docker in one run.

    sudo .venv/bin/python benchmarks/rl_bench.py [--bursts 16 48] [--forks 16 20] [--idle 32 64]
        [--sequential 10] [--staggered 50] [--snapshot-batches 32] [--rollouts 8 8 10]
        [--breakdown 8] [--configs gated ungated] [--peer docker|none] [--json out.json]

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
* **sequential**: create → first command, one after another;
* **staggered N**: a create → first command every 200 ms, each timed from its own start;
* **N from a snapshot**: a prepared sandbox (a file, a background ``sleep``) snapshotted
  and killed, then ``POST /snapshots/{id}/fork {count: N}``: the call, then every
  sandbox connected and answering with the file and the process;
* **rollouts T F C**: an RL step: T tasks at once, each a prepared sandbox forked into F
  rollouts of C commands each: rollouts per minute;
* **breakdown N** (aenv only): N creates one at a time (no pool): the QEMU's CPU until
  the create answered, for the first and a second command, the node's CPU per create;
  then the CPU those N idle sandboxes cost per second.

``--configs``: ``gated`` is the node's default restore gate ([vm] restore_slots = one
per CPU); ``ungated`` sets restore_slots to 1024 (every restore at once, as before the
gate); ``slots=N`` sets N. The peer: Debian's Docker engine (``docker.io``; its own ``dockerd`` with its own
data root, no bridge, no iptables), with an image of the guest's own root filesystem:
``docker run -d`` + ``docker exec true`` bursts, ``docker commit`` + N ``docker run`` as
its fork (and, with the source removed, its "N from a snapshot"; a commit holds files,
not processes), idle memory per container (``sleep infinity``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
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
    if n <= 20:     # the SDK's bound
        children = await parent.fork(count=n)
    else:           # E2B's API takes up to 100: the REST call, then the SDK connects to each child
        answered = await asyncio.to_thread(_post_json, f"/sandboxes/{parent.sandbox_id}/fork", {"count": n})
        children = list(await asyncio.gather(*(AsyncSandbox.connect(a["sandbox"]["sandboxID"])
                                               for a in answered if "sandbox" in a), return_exceptions=True))
        children += [RuntimeError(str(a["error"])) for a in answered if "error" in a]
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


async def aenv_staggered(n: int, every: float = 0.2) -> dict[str, Any]:
    """One create → first command every ``every`` seconds, each timed from its own start."""
    retried = [0]

    async def one(i: int) -> tuple[Any, float]:
        await asyncio.sleep(i * every)
        return await aenv_interactive(time.monotonic(), retried)
    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    good = [r for r in results if not isinstance(r, BaseException)]
    await kill_all([s for s, _ in good])
    return stats([t for _, t in good], wall, len(good), n, harness_retries=retried[0])


def _post_json(path: str, body: dict[str, Any]) -> Any:
    import urllib.request
    req = urllib.request.Request(os.environ["E2B_API_URL"] + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"X-API-Key": os.environ["E2B_API_KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


async def aenv_snapshot_batch(n: int) -> dict[str, Any]:
    """A prepared sandbox (a file, a background process) snapshotted then killed; ``n``
    sandboxes from the snapshot in one call (POST /snapshots/{id}/fork), each then
    answering with the file and the process."""
    from e2b import AsyncSandbox
    src = await AsyncSandbox.create(timeout=600)
    await src.files.write("/home/user/prepared", "state")
    await src.commands.run("sleep 100000", background=True)
    snap = await src.create_snapshot()
    await src.kill()
    t0 = time.monotonic()
    answered = await asyncio.to_thread(_post_json, f"/snapshots/{snap.snapshot_id}/fork", {"count": n})
    call = time.monotonic() - t0
    ids = [a["sandbox"]["sandboxID"] for a in answered if "sandbox" in a]

    async def first(sid: str) -> tuple[Any, float]:
        c = await AsyncSandbox.connect(sid)
        r = await c.commands.run("cat /home/user/prepared; echo; pgrep -x sleep >/dev/null && echo running")
        assert r.stdout.split() == ["state", "running"], r.stdout
        return c, time.monotonic() - t0
    got = await asyncio.gather(*(first(i) for i in ids), return_exceptions=True)
    good = [g for g in got if not isinstance(g, BaseException)]
    wall = time.monotonic() - t0
    await kill_all([c for c, _ in good])
    with contextlib.suppress(Exception):
        await AsyncSandbox.delete_snapshot(snap.snapshot_id)
    return stats([t for _, t in good], wall, len(good), n, call=call,
                 errors=sorted({str(a.get("error"))[:120] for a in answered if "error" in a}
                               | {str(g)[:120] for g in got if isinstance(g, BaseException)})[:5])


async def aenv_rollouts(tasks: int, forks: int, commands: int) -> dict[str, Any]:
    """An RL step: ``tasks`` prepared sandboxes (one per task), each forked into ``forks``
    rollouts that run ``commands`` commands each; all tasks at once."""
    from e2b import AsyncSandbox

    async def task(i: int) -> int:
        parent = await AsyncSandbox.create(timeout=600)
        await parent.files.write("/home/user/task", f"task {i}")
        kids = [c for c in await parent.fork(count=forks) if not isinstance(c, BaseException)]

        async def rollout(c: Any) -> None:
            for k in range(commands):
                r = await c.commands.run(f"echo step {k} >> /home/user/log; cat /home/user/task")
                assert r.stdout.strip() == f"task {i}", r.stdout
        done = await asyncio.gather(*(rollout(c) for c in kids), return_exceptions=True)
        await kill_all([*kids, parent])
        failed.extend(f"{type(d).__name__}: {d}"[:160] for d in done if isinstance(d, BaseException))
        failed.extend(["a fork child was not made"] * (forks - len(kids)))
        return sum(1 for d in done if not isinstance(d, BaseException))
    failed: list[str] = []
    t0 = time.monotonic()
    done = await asyncio.gather(*(task(i) for i in range(tasks)), return_exceptions=True)
    wall = time.monotonic() - t0
    ok = sum(d for d in done if isinstance(d, int))
    failed += [f"{type(d).__name__}: {d}"[:160] for d in done if isinstance(d, BaseException)]
    return {"n": tasks * forks, "ok": ok, "wall": wall, "rollouts_per_min": ok / wall * 60,
            "errors": sorted(set(failed))[:5]}


def _cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _qemu_children(pid: int) -> set[int]:
    """The node's QEMUs: children of any of its threads (it spawns them on a thread of its own)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for c in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{c}/comm").read_text().startswith("qemu"):
                        out.add(int(c))
    return out


async def aenv_breakdown(server_pid: int, n: int) -> dict[str, Any]:
    """Where a restored sandbox's CPU goes, one sandbox at a time (no pool): the QEMU's
    CPU until the create answered (its start, the state load, the guest's resume and
    /init), for its first command, for a second one; the node's own CPU per create;
    then the CPU of n idle sandboxes per second (guest timers, the node's metrics
    sampling every 5 s)."""
    from e2b import AsyncSandbox
    rows: dict[str, list[float]] = {"create_ms": [], "qemu_create_ms": [], "node_create_ms": [],
                                    "qemu_first_cmd_ms": [], "qemu_second_cmd_ms": []}
    boxes = []
    for _ in range(n):
        before = _qemu_children(server_pid)
        n0, t0 = _cpu_seconds(server_pid), time.monotonic()
        s = await AsyncSandbox.create(timeout=600)
        t1, n1 = time.monotonic(), _cpu_seconds(server_pid)
        q = next(iter(_qemu_children(server_pid) - before))
        c1 = _cpu_seconds(q)
        await s.commands.run("true")
        c2 = _cpu_seconds(q)
        await s.commands.run("true")
        c3 = _cpu_seconds(q)
        for k, v in (("create_ms", t1 - t0), ("qemu_create_ms", c1), ("node_create_ms", n1 - n0),
                     ("qemu_first_cmd_ms", c2 - c1), ("qemu_second_cmd_ms", c3 - c2)):
            rows[k].append(v * 1000)
        boxes.append((s, q))
    await asyncio.sleep(6)
    q0 = sum(_cpu_seconds(q) for _, q in boxes)
    n0, t0 = _cpu_seconds(server_pid), time.monotonic()
    await asyncio.sleep(30)
    idle = (sum(_cpu_seconds(q) for _, q in boxes) - q0) / (time.monotonic() - t0) / n * 1000
    node_idle = (_cpu_seconds(server_pid) - n0) / (time.monotonic() - t0) * 1000
    await kill_all([s for s, _ in boxes])
    out: dict[str, Any] = {k: percentile(v, 50) for k, v in rows.items()}
    out.update({"n": n, "qemu_idle_ms_per_s": idle, "node_idle_ms_per_s": node_idle})
    return out


@contextlib.contextmanager
def aenv_server(work: Path, slots: int | None, pool: int | None = None) -> Iterator[Any]:
    from tests.aenv_api.server.conftest import start_server
    env = {"AENV_SERVER__MAX_SANDBOXES": "200"}
    if pool is not None:
        env["AENV_VM__POOL_SIZE"] = str(pool)
        env["AENV_SERVER__CODE_INTERPRETER"] = "false"   # no background build skews the figures
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


async def docker_staggered(d: Docker, image: str, n: int, every: float = 0.2) -> dict[str, Any]:
    async def one(i: int) -> tuple[str, float]:
        await asyncio.sleep(i * every)
        return await docker_interactive(d, image, time.monotonic())
    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    good = [r for r in results if not isinstance(r, BaseException)]
    if good:
        await d.acli("rm", "-f", *[c for c, _ in good])
    return stats([t for _, t in good], wall, len(good), n)


async def docker_snapshot_batch(d: Docker, image: str, n: int) -> dict[str, Any]:
    """Docker's nearest: ``docker commit`` of a prepared container, which is then removed,
    and ``n`` ``docker run`` of the image (files only: a container's processes are not
    in a commit, so the sleep is started again)."""
    src = await d.acli("run", "-d", "--network", "none", image, "sleep", "infinity")
    await d.acli("exec", src, "sh", "-c", "echo state > /prepared")
    await d.acli("commit", src, "rl-bench-snap:latest")
    await d.acli("rm", "-f", src)
    t0 = time.monotonic()

    async def child() -> tuple[str, float]:
        cid = await d.acli("run", "-d", "--network", "none", "rl-bench-snap:latest", "sleep", "infinity")
        out = await d.acli("exec", cid, "cat", "/prepared")
        assert out == "state", out
        return cid, time.monotonic() - t0
    results = await asyncio.gather(*(child() for _ in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    good = [r for r in results if not isinstance(r, BaseException)]
    if good:
        await d.acli("rm", "-f", *[c for c, _ in good])
    return stats([t for _, t in good], wall, len(good), n)


async def docker_rollouts(d: Docker, image: str, tasks: int, forks: int, commands: int) -> dict[str, Any]:
    async def task(i: int) -> int:
        src = await d.acli("run", "-d", "--network", "none", image, "sleep", "infinity")
        await d.acli("exec", src, "sh", "-c", f"echo task {i} > /task")
        tag = f"rl-bench-task{i}:latest"
        await d.acli("commit", src, tag)

        async def rollout() -> str:
            cid = await d.acli("run", "-d", "--network", "none", tag, "sleep", "infinity")
            for k in range(commands):
                out = await d.acli("exec", cid, "sh", "-c", f"echo step {k} >> /log; cat /task")
                assert out == f"task {i}", out
            return cid
        done = await asyncio.gather(*(rollout() for _ in range(forks)), return_exceptions=True)
        cids = [c for c in done if isinstance(c, str)]
        await d.acli("rm", "-f", src, *cids)
        return len(cids)
    t0 = time.monotonic()
    done = await asyncio.gather(*(task(i) for i in range(tasks)), return_exceptions=True)
    wall = time.monotonic() - t0
    ok = sum(x for x in done if isinstance(x, int))
    return {"n": tasks * forks, "ok": ok, "wall": wall, "rollouts_per_min": ok / wall * 60,
            "errors": sorted({str(x)[:120] for x in done if isinstance(x, BaseException)})[:5]}


# --------------------------------------------------------------------------------- main

Part = Callable[[], Awaitable[dict[str, Any]]]
Sized = Callable[[int], Awaitable[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Subject:
    """One system's way of doing each part (aenv through the SDK, Docker through its CLI)."""
    burst: Sized
    fork: Sized
    idle: Sized
    sequential: Sized
    staggered: Sized
    snapshot_batch: Sized
    rollouts: Callable[[int, int, int], Awaitable[dict[str, Any]]]


def parts_of(args: argparse.Namespace, sub: Subject) -> list[tuple[str, Part]]:
    out: list[tuple[str, Part]] = []
    if args.sequential:
        out.append((f"sequential x{args.sequential}", functools.partial(sub.sequential, args.sequential)))
    if args.staggered:
        out.append((f"staggered x{args.staggered} (one per 200 ms)", functools.partial(sub.staggered, args.staggered)))
    for n in args.bursts:
        out.append((f"burst {n}", functools.partial(sub.burst, n)))
    for n in args.forks:
        out.append((f"fork {n}", functools.partial(sub.fork, n)))
    for n in args.snapshot_batches:
        out.append((f"{n} from a snapshot", functools.partial(sub.snapshot_batch, n)))
    if args.rollouts:
        t, f, c = args.rollouts
        out.append((f"rollouts {t} tasks x {f} forks x {c} cmds", functools.partial(sub.rollouts, t, f, c)))
    for n in args.idle:
        out.append((f"idle {n}", functools.partial(sub.idle, n)))
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
    ap.add_argument("--idle", type=int, nargs="*", default=[32])
    ap.add_argument("--sequential", type=int, default=10)
    ap.add_argument("--staggered", type=int, default=0, help="creates one every 200 ms (0: none)")
    ap.add_argument("--snapshot-batches", type=int, nargs="*", default=[],
                    help="sandboxes from one snapshot in one call (its sandbox killed first)")
    ap.add_argument("--rollouts", type=int, nargs=3, default=None, metavar=("TASKS", "FORKS", "CMDS"),
                    help="an RL step: TASKS prepared sandboxes, each forked into FORKS rollouts of CMDS commands")
    ap.add_argument("--breakdown", type=int, default=0,
                    help="aenv only: CPU per phase of N sequential creates, then their idle CPU")
    ap.add_argument("--configs", nargs="*", default=["gated", "ungated"],
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
                sub = Subject(functools.partial(aenv_burst, srv.url), aenv_fork, aenv_idle, aenv_sequential,
                              aenv_staggered, aenv_snapshot_batch, aenv_rollouts)
                asyncio.run(run_parts(f"aenv {config}", parts_of(args, sub), results))
        if args.breakdown:
            # its own node without a pool: every create is a restore whose QEMU is the new one
            with aenv_server(work / "breakdown", None, pool=0) as srv:
                asyncio.run(run_parts("aenv (no pool)", [(f"breakdown x{args.breakdown}", functools.partial(
                    aenv_breakdown, srv.proc.pid, args.breakdown))], results))
        if args.peer == "docker":
            from aenv_vm.guest import ensure_guest
            d = Docker(work / "docker")
            d.work.mkdir()
            try:
                d.start()
                d.import_rootfs(ensure_guest(quiet=True).rootfs, "rl-bench-rootfs:latest")
                image = "rl-bench-rootfs:latest"
                sub = Subject(*(functools.partial(f, d, image) for f in (
                    docker_burst, docker_fork, docker_idle, docker_sequential, docker_staggered,
                    docker_snapshot_batch, docker_rollouts)))
                asyncio.run(run_parts("docker", parts_of(args, sub), results))
            finally:
                d.stop()
    rows = []
    for name, r in results.items():
        f = lambda v: "-" if v is None else f"{v:.2f}"
        if "mib_per_sandbox" in r:
            rows.append([name, "", "", "", "", "", f"{r['mib_per_sandbox']:.1f} MiB each", ""])
            continue
        if "rollouts_per_min" in r:
            rows.append([name, f"{r['ok']}/{r['n']}", "", "", "", "", f(r["wall"]),
                         f"{r['rollouts_per_min']:.0f} rollouts/min"])
            continue
        if "qemu_create_ms" in r:
            rows.append([name, "", "", "", "", "", "", " ".join(f"{k}={v:.0f}" for k, v in r.items() if k != "n")])
            continue
        rows.append([name, f"{r['ok']}/{r['n']}", f(r["first"]), f(r["p50"]), f(r["p95"]), f(r["p99"]),
                     f(r["wall"]), f"{r.get('node_429', '')}"])
    print_table(rows, ["part", "ok", "first s", "p50 s", "p95 s", "p99 s", "wall s", "429s / notes"])
    print(json.dumps(machine_info()))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
