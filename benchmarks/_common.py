"""Small helpers shared by the benchmark scripts in this folder: timing,
percentiles, sizes, tables, running external tools, page-cache control and
machine notes. Nothing here knows about any one benchmark.

Benchmarks are run as scripts (``python benchmarks/<name>.py``), so their own
folder is on ``sys.path`` and they import this module as ``_common``."""
from __future__ import annotations

import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence, TextIO

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
MB = 1_000_000  # throughput is reported in decimal MB/s, like the tools we compare against


class BenchError(Exception):
    """A benchmark cannot run (missing tool, no permission, a peer failed): printed
    as one line, no traceback."""


# ---------------------------------------------------------------- timing

@dataclass
class Stopwatch:
    """Wall-clock timing of one phase: ``with Stopwatch() as sw: ...; sw.seconds``."""

    seconds: float = 0.0
    _start: float = field(default=0.0, repr=False)

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in [0, 100]) of a non-empty sample."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """min / p50 / p95 / p99 / max / mean of a sample (e.g. latencies in ms)."""
    return {
        "n": float(len(values)),
        "min": min(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": sum(values) / len(values),
    }


def throughput_mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / MB / seconds if seconds > 0 else float("inf")


# ---------------------------------------------------------------- sizes

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1G', '1GiB', '512M', '64K', '4096' -> bytes (binary multiples)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64K, 512M, 1G)")
    mult = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def human_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def dir_bytes(path: Path) -> int:
    """Apparent size of every regular file under ``path`` (what a repository occupies,
    independent of the filesystem's block rounding)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


# ---------------------------------------------------------------- tables

def format_table(rows: Sequence[Sequence[object]], header: Sequence[str],
                 align: str | None = None) -> str:
    """A plain-text table; ``align`` is one of 'l'/'r' per column (default: first
    column left, the rest right)."""
    align = align or ("l" + "r" * (len(header) - 1))
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(r, widths, align)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def markdown_table(rows: Sequence[Sequence[object]], header: Sequence[str],
                   align: str | None = None) -> str:
    align = align or ("l" + "r" * (len(header) - 1))
    out = ["| " + " | ".join(str(h) for h in header) + " |",
           "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def print_table(rows: Sequence[Sequence[object]], header: Sequence[str],
                align: str | None = None, out: TextIO = sys.stdout) -> None:
    out.write(format_table(rows, header, align) + "\n")
    out.flush()


# ---------------------------------------------------------------- processes

def run(cmd: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
        cwd: Path | None = None, stdout: int | TextIO | None = subprocess.PIPE,
        input_path: Path | None = None, timeout: float | None = None) -> str:
    """Run a tool, raise BenchError naming it with the tail of its stderr on failure.
    Returns its stdout (text) when captured."""
    full_env = {**os.environ, **(env or {})}
    stdin = open(input_path, "rb") if input_path else subprocess.DEVNULL
    try:
        proc = subprocess.run([str(c) for c in cmd], env=full_env, cwd=cwd, stdin=stdin,
                              stdout=stdout, stderr=subprocess.PIPE, timeout=timeout)
    except FileNotFoundError:
        raise BenchError(f"{cmd[0]}: command not found") from None
    except subprocess.TimeoutExpired:
        raise BenchError(f"{' '.join(map(str, cmd[:3]))}: timed out after {timeout} s") from None
    finally:
        if input_path:
            stdin.close()  # type: ignore[union-attr]
    if proc.returncode != 0:
        tail = (proc.stderr or b"").decode(errors="replace").strip().splitlines()[-5:]
        raise BenchError(f"{' '.join(map(str, cmd[:3]))} failed (exit {proc.returncode}): "
                         + " | ".join(tail))
    return proc.stdout.decode(errors="replace") if isinstance(proc.stdout, bytes) else ""


def tool_version(cmd: Sequence[str]) -> str:
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return "unavailable"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else "?"


def is_root() -> bool:
    return os.geteuid() == 0


def ensure_debian_packages(packages: Mapping[str, str]) -> list[str]:
    """``packages`` maps a Debian package to the command it provides. Installs the
    missing ones with apt-get (root only); returns what was installed."""
    missing = [pkg for pkg, cmd in packages.items() if shutil.which(cmd) is None]
    if not missing:
        return []
    if not is_root():
        raise BenchError(f"missing {', '.join(missing)}: run as root or `apt-get install {' '.join(missing)}`")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", *missing], env=env)
    still = [pkg for pkg in missing if shutil.which(packages[pkg]) is None]
    if still:
        raise BenchError(f"apt-get installed {', '.join(still)} but their commands are still missing")
    return missing


# ---------------------------------------------------------------- page cache

def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache, so the next phase reads from
    disk. Needs root; returns False (and the caller should say so) otherwise."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@contextmanager
def temp_env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- machine notes

def machine_info() -> dict[str, str]:
    """What a reader needs to judge the numbers: CPU, cores, memory, kernel, date, load."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = human_bytes(int(line.split()[1]) * KiB)
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "cpus": str(os.cpu_count()),
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
