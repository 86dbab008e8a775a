"""Process helpers shared by the VM-backed test packages (vm, snapshot, api)."""
from __future__ import annotations

import os
from pathlib import Path


def qemu_children(parent: int | None = None) -> list[int]:
    """PIDs of QEMU processes whose parent is ``parent`` (default: this test process)."""
    me = os.getpid() if parent is None else parent
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ..."; comm may contain spaces, so split after the last ')'.
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == me and comm.startswith("qemu-system"):
            found.append(int(entry.name))
    return found
