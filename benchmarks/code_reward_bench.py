"""A GRPO code-reward batch (issue 30): N concurrent short sandboxes, aenv beside Docker.

    sudo .venv/bin/python benchmarks/code_reward_bench.py [--n 64] [--rounds 2] [--peer docker|none]
        [--data-dir DIR] [--json out.json]

What open-r1 / TRL style reward functions do with E2B: for every completion of a
training step, at once, ``AsyncSandbox.create(timeout=30)`` of the code interpreter,
``run_code(candidate + tests, timeout=30)``, read the reward from the output, ``kill``.
Each cycle is timed from the batch's start (what the trainer waits for) and on its own;
reported as p50/p95/max, the wall time of the batch and the failures (a cycle that
raised, or a wrong reward). Half of the candidates are right, half wrong: a reward of
1.0 or 0.0 is checked for each.

aenv: ``aenv server`` on its default config but ``max_sandboxes`` 200 and no pool, with
``code-interpreter-v1`` as the node makes it (built at the server's first start when the
data dir does not hold it yet: ``--data-dir`` keeps one between runs). Through the real
``e2b-code-interpreter`` SDK, env vars only; a create refused with 429 is retried after
its Retry-After, as RL harnesses do (counted).

Peer: Debian's Docker engine (its own dockerd), the guest's root filesystem as an image,
one ``docker run --rm --network none IMAGE python3 -c SCRIPT`` per completion (what a
reward function without a sandbox service runs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info, percentile, print_table, temp_env
from _docker import Docker

RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
TESTS = ("cases = [(1, 2, 3), (5, 7, 12), (-1, 1, 0)]\n"
         "passed = sum(1 for a, b, want in cases if add(a, b) == want)\n"
         "print('reward', passed / len(cases) if passed == len(cases) else 0.0)\n")
HARNESS_RETRIES = 30


def script(i: int) -> tuple[str, float]:
    """Completion ``i``'s program (its candidate and the tests) and the reward it earns."""
    return (RIGHT if i % 2 == 0 else WRONG) + TESTS, (1.0 if i % 2 == 0 else 0.0)


def reward_of(stdout: str) -> float | None:
    for line in stdout.splitlines():
        if line.startswith("reward "):
            return float(line.split()[1])
    return None


def summary(name: str, starts: list[float], cycles: list[float], wall: float, n: int, failures: list[str],
            retries: int = 0) -> dict[str, Any]:
    ok = len(cycles)
    return {"system": name, "n": n, "ok": ok, "failures": len(failures), "retries_429": retries,
            "cycle_p50_ms": percentile(cycles, 50) * 1000 if ok else None,
            "cycle_p95_ms": percentile(cycles, 95) * 1000 if ok else None,
            "done_p50_ms": percentile(starts, 50) * 1000 if ok else None,
            "done_p95_ms": percentile(starts, 95) * 1000 if ok else None,
            "wall_ms": wall * 1000, "errors": sorted(set(failures))[:5]}


async def batch(name: str, cycle: Callable[[int, float], Awaitable[tuple[float, float]]], n: int,
                retries: Callable[[], int]) -> dict[str, Any]:
    """``n`` cycles at once, each timed from the batch's start and on its own; the summary."""
    t0 = time.monotonic()
    results = await asyncio.gather(*(cycle(i, t0) for i in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    good = [r for r in results if not isinstance(r, BaseException)]
    failures = [f"{type(r).__name__}: {str(r)[:120]}" for r in results if isinstance(r, BaseException)]
    return summary(name, [a for a, _ in good], [b for _, b in good], wall, n, failures, retries())


async def aenv_batch(n: int) -> dict[str, Any]:
    from e2b import RateLimitException
    from e2b_code_interpreter import AsyncSandbox

    retries = 0

    async def cycle(i: int, t0: float) -> tuple[float, float]:
        nonlocal retries
        code, want = script(i)
        c0 = time.monotonic()
        for attempt in range(HARNESS_RETRIES):
            try:
                sbx = await AsyncSandbox.create(timeout=30)
                break
            except RateLimitException:
                retries += 1
                if attempt == HARNESS_RETRIES - 1:
                    raise
                await asyncio.sleep(1)
        try:
            ex = await sbx.run_code(code, timeout=30)
            got = reward_of("".join(ex.logs.stdout))
            if ex.error is not None or got != want:
                raise RuntimeError(f"reward {got} for completion {i} (want {want}; error {ex.error})")
        finally:
            await sbx.kill()
        now = time.monotonic()
        return now - t0, now - c0

    return await batch("aenv", cycle, n, lambda: retries)


async def docker_batch(d: Docker, image: str, n: int) -> dict[str, Any]:
    async def cycle(i: int, t0: float) -> tuple[float, float]:
        code, want = script(i)
        c0 = time.monotonic()
        out = await d.acli("run", "--rm", "--network", "none", image, "python3", "-c", code)
        got = reward_of(out)
        if got != want:
            raise RuntimeError(f"reward {got} for completion {i} (want {want})")
        now = time.monotonic()
        return now - t0, now - c0

    return await batch("docker", cycle, n, lambda: 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="completions per batch (concurrent sandboxes)")
    ap.add_argument("--rounds", type=int, default=2, help="batches per system, one after another")
    ap.add_argument("--peer", choices=("docker", "none"), default="docker")
    ap.add_argument("--data-dir", type=Path, help="the node's data dir, kept (its code-interpreter-v1 is reused)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from tests.aenv_api.server.conftest import start_server
    from tests.codeint.conftest import wait_built

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aenv-reward-") as tmp:
        work = Path(tmp)
        data = args.data_dir or work / "node"
        srv = start_server(data, work / "logs", env={"AENV_SERVER__MAX_SANDBOXES": "200", "AENV_VM__POOL_SIZE": "0",
                                                     "AENV_SERVER__CODE_INTERPRETER": "true"})
        try:
            built = wait_built(srv, timeout=1800)
            print(f"code-interpreter-v1 ready after {built:.0f} s", file=sys.stderr)
            with temp_env(**srv.sdk_env()):
                for r in range(args.rounds):
                    rows.append({**asyncio.run(aenv_batch(args.n)), "round": r + 1})
                    print(rows[-1], file=sys.stderr)
        finally:
            srv.kill_all()
            srv.stop()
        if args.peer == "docker":
            from aenv_vm.guest import ensure_guest
            d = Docker(work / "docker")
            (work / "docker").mkdir()
            d.start()
            try:
                d.import_rootfs(ensure_guest(quiet=True).rootfs, "reward-bench-rootfs:latest")
                for r in range(args.rounds):
                    rows.append({**asyncio.run(docker_batch(d, "reward-bench-rootfs:latest", args.n)),
                                 "round": r + 1})
                    print(rows[-1], file=sys.stderr)
            finally:
                d.stop()
    cols = ["system", "round", "n", "ok", "failures", "retries_429", "cycle_p50_ms", "cycle_p95_ms",
            "done_p50_ms", "done_p95_ms", "wall_ms"]
    print_table([[("-" if r[c] is None else (f"{r[c]:.0f}" if isinstance(r[c], float) else r[c])) for c in cols]
                 for r in rows], cols)
    aenv = [r for r in rows if r["system"] == "aenv"]
    peer = [r for r in rows if r["system"] == "docker"]
    if aenv and peer and aenv[-1]["wall_ms"] and peer[-1]["wall_ms"]:
        print(f"batch wall time, aenv / docker (last round): {aenv[-1]['wall_ms'] / peer[-1]['wall_ms']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=2))
    return 0 if all(r["failures"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
