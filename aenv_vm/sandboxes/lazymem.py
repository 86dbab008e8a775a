"""The node's lazy memory mount (aenv_vm/memory/lazyfs.py) in the sandbox lifecycle.

Mounted by ``SandboxManager.start`` at ``<run_root>/lazymem/mnt`` (the parent is
root-only, 0700) after whatever a crashed run left there was aborted and
detached; answered to root and to the uids the node's confinement gives its
QEMUs; detached by ``close`` once every QEMU of the node is gone. Where the host
cannot mount FUSE (no /dev/fuse, not root) the node says so once and restores
fetch memory images whole, as without ``[vm] lazy_memory``.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..memory.lazyfs import LazyMemoryError, MemoryFs
from ..memory.workingset import WorkingSets
from .runtime import NodeRuntime

log = logging.getLogger(__name__)

# KiB a page fault reads around the faulting page (the kernel's mmap read-around; one
# FUSE READ). Larger: fewer round trips to the server, more bytes fetched that the
# guest may never touch (benchmarks/cold_resume_bench.py --readahead-kb measures it).
READAHEAD_KB = 1024


def mount_root(rt: NodeRuntime) -> Path:
    return rt.run_root / "lazymem"


def start_lazy_memory(rt: NodeRuntime, readahead_kb: int | None = None) -> MemoryFs | None:
    """Mount the node's lazy memory filesystem and hand it to the local templates."""
    root = mount_root(rt)
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        log.warning("lazy memory off (%s): memory images not on this node are fetched whole before a restore",
                    "the node is not root" if os.geteuid() != 0 else "no /dev/fuse")
        return None
    uids = rt.confinement.qemu_uids() if rt.confinement.enabled else range(0)
    fs = MemoryFs(rt.store, root / "mnt", lambda uid: uid == 0 or uid in uids, readahead_kb=readahead_kb or READAHEAD_KB)
    try:
        fs.mount()
    except LazyMemoryError as e:
        log.warning("lazy memory off: %s", e)
        return None
    sets = WorkingSets(rt.store, fs)      # record or prefetch each new image
    fs.on_close.append(sets.close)
    rt.templates.lazy = fs
    return fs


def stop_lazy_memory(rt: NodeRuntime) -> None:
    fs, rt.templates.lazy = rt.templates.lazy, None
    if fs is not None:
        fs.close()
