"""What every part of the sandbox lifecycle works with on one node.

``NodeRuntime`` is handed to restore, pause, resume, fork, the pool and
recovery instead of a back-pointer to the manager: the store, the NBD server
that exports every sandbox's disk, the networks, the guest image, the run
directory and the local template files, plus the few settings a restored VM
needs. It holds no per-sandbox state.

Run directory layout (``run_root``)::

    sandboxes/<id>/   a running (or standby) sandbox: its upper disk layer
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
import shutil
from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import ConfigError
from aenv_store.store import Store

from ..blockimage.nbd_server import NbdServer
from ..confine.jail import Jail
from ..confine.policy import Confinement
from ..guest import GuestImage
from ..net.networks import NodeNetworks
from ..qemu.launcher import NbdDisk, VmSpec
from ..templates.local import LocalTemplates
from ..templates.template import Template

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
    merge_memory: bool = False          # KSM over the whole QEMU process (aenv_vm/ksm.py)
    fixed_layout: bool = False          # QEMU without ASLR, so identical clones merge further
    readahead: int = 4 << 20            # bytes read ahead of a sandbox's sequential disk reads (0: off)
    min_free_disk: int = 0              # a guest's disk writes fail rather than leave less free here
    node_id: str = ""                   # this node as the holder of pauses in a shared repository (handover.py)

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

    def clone_spec(self, sid: str, tpl: Template, memory: Path, network: dict[str, object],
                   jail: Jail | None) -> VmSpec:
        """The QEMU of a clone of ``tpl``: its memory file mapped copy-on-write, its disk
        the sandbox's NBD export (on the export's own socket), waiting for its device
        state (``-incoming defer``), confined by ``jail``."""
        return VmSpec(name=sid, kernel=self.guest.kernel, initrd=self.guest.initrd,
                      kernel_cmdline=tpl.kernel_cmdline, run_dir=self.vm_dir(sid), memory_mib=tpl.memory_mib,
                      vcpus=tpl.vcpus, accel=tpl.accel,  # type: ignore[arg-type]
                      mem_path=memory, mem_share=False, disk=NbdDisk(self.nbd.socket_of(sid), sid),
                      incoming_defer=True, tcg_tb_mib=self.tcg_tb_mib, merge_memory=self.merge_memory,
                      fixed_layout=self.fixed_layout, jail=jail, **network)  # type: ignore[arg-type]

    async def release_host(self, sid: str) -> None:
        """The sandbox has no QEMU on this node any more: its network, its uid and its
        QEMU's run dir go."""
        await self.networks.release(sid)
        self.confinement.release(sid)
        shutil.rmtree(self.vm_dir(sid), ignore_errors=True)
