"""SIGKILL of the server process during pause, resume and fork (10 times each, at
random points): the paused sandbox is never lost, the repository verifies clean,
and no QEMU process outlives its server."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import Env

pytestmark = pytest.mark.qemu

REPO = Path(__file__).resolve().parents[3]
KILLS_PER_PHASE = 10
# upper bound of the random delay after a phase starts (the phase's typical length here)
WINDOW = {"pause": 0.4, "resume": 1.5, "fork": 4.0}


def driver(env: Env, run_root: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.aenv_vm.sandboxes.fault_driver", str(env.settings.paths.data_dir),
                             str(run_root), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def our_qemus(run_root: Path) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(run_root).encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                pass
    return [p for p in out if p != os.getpid()]


def run_until_phase_then_kill(env: Env, run_root: Path, args: list[str], phase: str, delay: float) -> list[str]:
    proc = driver(env, run_root, *args)
    assert proc.stdout is not None
    lines: list[str] = []
    killed = False
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == f"phase {phase}":
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    assert killed or proc.returncode == 0, f"driver exited {proc.returncode}: {lines}\n{err[-3000:]}"
    assert lines and lines[0].startswith("state paused"), \
        f"the paused sandbox was not found paused after a restart: {lines}\n{err[-3000:]}"
    return lines


def test_sigkill_during_pause_resume_fork(env: Env, tmp_path: Path) -> None:
    run_root = tmp_path / "node"
    setup = driver(env, run_root, "setup")
    out, err = setup.communicate(timeout=300)
    assert setup.returncode == 0, err[-3000:]
    sid, digest, pid = out.split()[1:4]
    rng = random.Random(int(os.environ.get("AENV_FAULT_SEED", "6")))
    plan = [p for p in WINDOW for _ in range(KILLS_PER_PHASE)]
    rng.shuffle(plan)
    verified = 0
    for phase in plan:
        lines = run_until_phase_then_kill(env, run_root, ["cycle", sid, digest, pid], phase,
                                          rng.uniform(0, WINDOW[phase]))
        verified += any(x.startswith("verified") for x in lines)
        deadline = time.monotonic() + 10
        while our_qemus(run_root) and time.monotonic() < deadline:  # PDEATHSIG is asynchronous
            time.sleep(0.05)
        assert not our_qemus(run_root), "QEMU outlived its killed server"
    assert verified >= KILLS_PER_PHASE   # the guest process and its memory checked after many kills
    # a final undisturbed cycle, then the repository must verify clean
    final = driver(env, run_root, "cycle", sid, digest, pid)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0 and "done" in out, out + err[-3000:]
    check = subprocess.run([sys.executable, "-m", "aenv_cli.main", "repo", "verify", "--data-dir",
                            str(env.settings.paths.data_dir)], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert not our_qemus(run_root)
