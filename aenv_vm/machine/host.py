"""What a node lends the machines it brings up: ``Host``.

A node's ``NodeRuntime`` (aenv_vm/sandboxes/runtime.py) is the host of its
sandboxes and build VMs. The base template is built before (or without) a node:
``standalone_host`` makes the host of that one boot, in the build's work directory.
"""
from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Protocol

from aenv_store.store import Store

from ..blockimage.nbd_server import NbdServer
from ..confine.policy import Confinement
from ..guest import GuestImage
from ..memory.lazyfs import LazyImage
from ..net.networks import NodeNetworks
from ..qemu.console import CONSOLE_BYTES
from .admission import Admission


class Host(Protocol):
    """The parts of a node a machine uses (read only)."""

    @property
    def store(self) -> Store: ...              # the machine's disk layers come from it

    @property
    def guest(self) -> GuestImage: ...         # kernel and initramfs

    @property
    def nbd(self) -> NbdServer: ...            # exports each machine's disk on a socket of its own

    @property
    def networks(self) -> NodeNetworks: ...

    @property
    def confinement(self) -> Confinement: ...  # each machine's QEMU runs in the jail it gives

    @property
    def readahead(self) -> int: ...            # bytes read ahead of a disk's sequential reads (0: off)

    @property
    def min_free_disk(self) -> int: ...        # a guest's disk writes fail rather than leave less free

    @property
    def tcg_tb_mib(self) -> int | None: ...    # TCG translation cache (None: QEMU's, or the jail's)

    @property
    def console_bytes(self) -> int: ...        # the most of each QEMU's serial console kept (qemu/console.py)

    @property
    def merge_memory(self) -> bool: ...        # KSM over a clone's whole QEMU process (aenv_vm/ksm.py)

    @property
    def fixed_layout(self) -> bool: ...        # a clone's QEMU without ASLR, so identical clones merge further

    @property
    def admission(self) -> Admission | None: ...   # the gate every restore passes (None: restores start at once)

    def vm_dir(self, name: str) -> Path:
        """Machine ``name``'s QEMU run dir (QMP socket, console, its disk's NBD socket)."""
        ...

    def lazy_image(self, memory: Path) -> LazyImage | None:
        """The lazy image behind memory file ``memory`` (None: a local file)."""
        ...


async def release_host(host: Host, name: str) -> None:
    """Machine ``name`` has no QEMU on this host any more: its network, its jail's uid
    and its QEMU's run dir go."""
    await host.networks.release(name)
    host.confinement.release(name)
    shutil.rmtree(host.vm_dir(name), ignore_errors=True)


@dataclass(frozen=True)
class StandaloneHost:
    """The host of a machine outside any node (the base template's boot): an NBD server
    of its own, QEMU's user-mode network on the host's 127.0.0.1 without a namespace or
    ``restrict=on`` (the guest reaches the host's loopback, as the template boot always
    has), no read-ahead (its disk is a layer of the local store), no disk floor, QEMU's
    own TCG cache, no KSM, no admission gate (it boots; it restores nothing)."""
    store: Store
    guest: GuestImage
    nbd: NbdServer
    networks: NodeNetworks
    confinement: Confinement
    run_dir: Path
    readahead: int = 0
    min_free_disk: int = 0
    tcg_tb_mib: int | None = None
    console_bytes: int = CONSOLE_BYTES
    merge_memory: bool = False
    fixed_layout: bool = False
    admission: Admission | None = None

    def vm_dir(self, name: str) -> Path:
        return self.run_dir

    def lazy_image(self, memory: Path) -> LazyImage | None:
        return None


@contextlib.asynccontextmanager
async def standalone_host(store: Store, guest: GuestImage, work_dir: Path,
                          confinement: Confinement | None) -> AsyncIterator[StandaloneHost]:
    """A host in ``work_dir`` (its NBD server's socket ``nbd.sock``, its QEMU's run dir
    ``run/``) for one machine, confined by ``confinement`` (None: an ``auto`` policy of
    its own, closed at the end)."""
    own = confinement is None
    conf = Confinement() if confinement is None else confinement
    nbd = NbdServer(work_dir / "nbd.sock")
    networks = NodeNetworks("user", work_dir, "off")    # never started: no namespaces, no filter
    try:
        await asyncio.to_thread(conf.start)
        await nbd.start()
        yield StandaloneHost(store, guest, nbd, networks, conf, work_dir / "run")
    finally:
        await nbd.close()
        await networks.close()
        if own:
            conf.close()
