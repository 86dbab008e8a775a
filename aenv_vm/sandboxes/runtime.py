"""What every part of the sandbox lifecycle works with on one node.

``NodeRuntime`` is handed to restore, pause, resume, fork, the pool and
recovery instead of a back-pointer to the manager: the store, the NBD server
that exports every sandbox's disk, the networks, the guest image, the run
directory and the local template files, plus the few settings a restored VM
needs. It holds no per-sandbox state. It is the ``Host`` of the node's machines
(aenv_vm/machine: sandboxes and build VMs come up and go through it).

Run directory layout (``run_root``)::

    sandboxes/<id>/   a running (or standby) sandbox: its upper disk layer
    builds/<name>/    a template build's VM: its upper disk layer, RAM and device state (aenv_vm/builds)
    vm/<id>/          its QEMU's own dir (QMP socket, console, its disk's NBD socket): the
                      only directory of the node a confined QEMU sees and may write
    paused/<id>/<n>/  pause n of a sandbox: memory.delta + device-state (docs/snapshots.md)
    templates/<id>/   local template files (templates/local.py)
    lazymem/mnt/      the FUSE mount of memory images served lazily (lazymem.py)
    records/          the sandbox records (records.py)
    node-id           this node's identity as a pause holder (handover.py)
    nbd.sock          the NBD server
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import ConfigError
from aenv_store.store import Store

from ..blockimage.nbd_server import NbdServer
from ..confine.policy import Confinement
from ..guest import GuestImage
from ..machine.admission import Admission
from ..machine.cpushare import STARTING_WEIGHT
from ..memory.lazyfs import LazyImage
from ..net.networks import NodeNetworks
from ..qemu.console import CONSOLE_BYTES
from ..templates.local import LocalTemplates

UNIX_PATH_MAX = 107     # sockaddr_un.sun_path holds 108 bytes, the last a NUL
LONGEST_VM_NAME = 24    # sandbox ids (sbx-<16 hex>) and build VM names (build-<12>-<4>) fit


@dataclass(frozen=True)
class NodeRuntime:
    store: Store
    guest: GuestImage
    run_root: Path
    nbd: NbdServer
    networks: NodeNetworks
    templates: LocalTemplates
    confinement: Confinement            # how its QEMUs are confined (aenv_vm/confine)
    ready_timeout: float = 60.0         # seconds a restored sandbox's envd may take to answer
    tcg_tb_mib: int | None = None       # TCG translation cache of every sandbox QEMU (None: QEMU's)
    console_bytes: int = CONSOLE_BYTES  # the most of each QEMU's serial console kept (qemu/console.py)
    merge_memory: bool = False          # KSM over the whole QEMU process (aenv_vm/ksm.py)
    fixed_layout: bool = False          # QEMU without ASLR, so identical clones merge further
    readahead: int = 4 << 20            # bytes read ahead of a sandbox's sequential disk reads (0: off)
    min_free_disk: int = 0              # a guest's disk writes fail rather than leave less free here
    node_id: str = ""                   # this node as the holder of pauses in a shared repository (handover.py)
    admission: Admission | None = None  # the gate every restore passes (None: restores start at once)
    fence_wait: float = 0.0             # a forced adopt waits this long for the holder's self-fence (handover.py)
    fork_starting_weight: float = STARTING_WEIGHT   # a fork's starting children together (machine/cpushare.py)

    def __post_init__(self) -> None:
        # every QEMU's sockets live in its run dir: a run root too long for them would
        # fail each create with "AF_UNIX path too long"; say so once, at start
        longest = self.vm_dir("x" * LONGEST_VM_NAME) / "qmp.sock"
        if len(os.fsencode(longest)) > UNIX_PATH_MAX:
            raise ConfigError(f"the node's run directory {self.run_root} is too long for the Unix sockets "
                              f"of its QEMUs ({longest}: {len(os.fsencode(longest))} bytes, at most "
                              f"{UNIX_PATH_MAX}); choose a shorter data dir")

    @property
    def sandboxes_root(self) -> Path:
        return self.run_root / "sandboxes"

    @property
    def paused_root(self) -> Path:
        return self.run_root / "paused"

    def sandbox_dir(self, sid: str) -> Path:
        return self.sandboxes_root / sid

    def paused_dir(self, sid: str) -> Path:
        return self.paused_root / sid

    @property
    def vm_root(self) -> Path:
        return self.run_root / "vm"

    def vm_dir(self, sid: str) -> Path:
        """The run dir of the sandbox's QEMU (VmSpec.run_dir): apart from the sandbox's
        disk files, and short (Unix socket paths in it must fit 107 bytes)."""
        return self.vm_root / sid

    def lazy_image(self, memory: Path) -> LazyImage | None:
        """The lazy image behind memory file ``memory`` (None: a local file)."""
        return self.templates.lazy_image(memory)
