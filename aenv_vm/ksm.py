"""Kernel samepage merging (KSM) for a node's QEMU processes.

Why: under TCG every QEMU holds ~50 MiB of its own memory beside the guest's
(translated code, TCG tables, heap), and clones of one template fill much of
it with the same bytes. QEMU by itself only marks guest RAM mergeable. With
``PR_SET_MEMORY_MERGE`` (Linux >= 6.4; kept across exec since 6.7) set
between fork and exec, *every* anonymous mapping of the QEMU is a merge
candidate, and with a fixed address layout (``ADDR_NO_RANDOMIZE``) identical
QEMUs put their heap, relocated tables and guest RAM at the same addresses, so
the pointers inside those pages agree and the pages merge too. Measured in
``docs/benchmarks.md`` (MicroVMs): 10 idle clones went from 51 % to 40 % of
10 × one clone's PSS; ASLR alone off changes nothing, KSM without it gives 46 %.

Costs, documented in ``docs/config.md``: ``ksmd`` CPU (proportional to
``pages_to_scan`` / ``sleep_ms``), a copy on the first write to a merged page,
the cross-VM timing side channel every KSM user accepts, and QEMU without ASLR
when ``fixed_layout`` is on.

The ``/sys/kernel/mm/ksm`` knobs are host-wide; aenv only turns KSM on and
sets the scan rate when asked to (``[vm] ksm``), and reports the rest.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

KSM_SYSFS = Path("/sys/kernel/mm/ksm")
PAGE = os.sysconf("SC_PAGE_SIZE")
PR_SET_MEMORY_MERGE = 67
PR_GET_MEMORY_MERGE = 68
ADDR_NO_RANDOMIZE = 0x0040000


@dataclass(frozen=True)
class KsmSettings:
    """How a node uses KSM (each QEMU gets PR_SET_MEMORY_MERGE). ``pages_to_scan``
    per ``sleep_ms`` is ksmd's rate: 200 / 20 ms scans ~40 MiB/s (a few % of one
    core with 10 clones here)."""
    fixed_layout: bool = True           # ADDR_NO_RANDOMIZE on each QEMU
    pages_to_scan: int = 200
    sleep_ms: int = 20


@dataclass(frozen=True)
class KsmStats:
    run: int                 # 0 stopped, 1 running, 2 unmerging
    pages_shared: int        # KSM pages in use
    pages_sharing: int       # mappings of them beyond the first: the pages saved
    pages_unshared: int
    pages_volatile: int
    full_scans: int
    zero_pages: int

    @property
    def saved_bytes(self) -> int:
        return (self.pages_sharing + self.zero_pages) * PAGE


def _read_int(name: str) -> int:
    try:
        return int((KSM_SYSFS / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def available() -> bool:
    return (KSM_SYSFS / "run").exists()


def read_stats() -> KsmStats | None:
    if not available():
        return None
    return KsmStats(_read_int("run"), _read_int("pages_shared"), _read_int("pages_sharing"),
                    _read_int("pages_unshared"), _read_int("pages_volatile"), _read_int("full_scans"),
                    _read_int("ksm_zero_pages"))


def enable(settings: KsmSettings) -> str | None:
    """Start ksmd at the configured rate. None on success, else why not (the node
    still runs, without merging): no KSM in this kernel, or sysfs not writable."""
    if not available():
        return "this kernel has no KSM (/sys/kernel/mm/ksm missing)"
    try:
        (KSM_SYSFS / "pages_to_scan").write_text(str(settings.pages_to_scan))
        (KSM_SYSFS / "sleep_millisecs").write_text(str(settings.sleep_ms))
        (KSM_SYSFS / "run").write_text("1")
    except OSError as e:
        return f"cannot configure KSM ({e.strerror or e}): run as root or set [vm] ksm = false"
    return None


def unmerge_all() -> None:
    """Stop ksmd and split every merged page (returns when done): QEMU's defaults again."""
    (KSM_SYSFS / "run").write_text("2")


_KNOBS = ("pages_to_scan", "sleep_millisecs", "run")


@contextlib.contextmanager
def knobs_restored() -> Iterator[None]:
    """For tests and benchmarks that change the host-wide knobs: put them back after."""
    before = {k: (KSM_SYSFS / k).read_text().strip() for k in _KNOBS} if available() else {}
    try:
        yield
    finally:
        for k, v in before.items():   # run last: the rate is in place when ksmd restarts
            (KSM_SYSFS / k).write_text(v)


def process_merge_supported() -> bool:
    """Whether this kernel knows PR_SET_MEMORY_MERGE (asking does not change anything)."""
    import ctypes
    return ctypes.CDLL(None, use_errno=True).prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0) >= 0


def ksmd_cpu_seconds() -> float | None:
    """CPU time ksmd has used since boot (None if it cannot be found)."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if (p / "comm").read_text().strip() != "ksmd":
                continue
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


async def wait_full_scans(count: int, timeout: float) -> int:
    """Wait until ksmd finished ``count`` more full scans (pages merge on the second
    scan that sees them unchanged). Returns the scans seen; fewer on timeout."""
    start = _read_int("full_scans")
    deadline = time.monotonic() + timeout
    while (seen := _read_int("full_scans") - start) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return seen
