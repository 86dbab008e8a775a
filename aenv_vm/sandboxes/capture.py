"""Capture: stop a sandbox's VM and take what a restore needs of it.

With the vCPUs stopped and block I/O drained (QMP ``stop``), the device state
is saved without RAM (``xen-save-devices-state``, memory/device_state.py) and
the guest pages the QEMU holds privately are read (memory/pagemap.py: exactly
the pages that differ from the template's memory file it maps ``share=off``).
The VM stays stopped; pause kills it, a snapshot lets it continue.

The page buffer of one capture is kept for the next (up to RETAINED_BUFFER):
reading 26 MiB took 25 ms into a fresh buffer, 11 ms into a reused one.
"""
from __future__ import annotations

import asyncio
import mmap
import time
from dataclasses import dataclass
from pathlib import Path

from ..memory.device_state import save_devices
from ..memory.memory_image import Delta
from ..memory.pagemap import PageBuffer, private_pages, ram_mapping, read_and_hash
from ..templates.local import LocalTemplates
from .sandbox import Sandbox

RETAINED_BUFFER = 160 << 20


@dataclass
class Capture:
    delta: Delta            # the private pages (over the template's memory image)
    stop: float             # seconds: QMP stop
    device_state: float     # device state saved
    pages: float            # pagemap + read of the private pages + xxh3


class Capturer:
    def __init__(self, templates: LocalTemplates) -> None:
        self.templates = templates
        self._buffers: list[PageBuffer] = []     # at most one, see give_back

    async def capture(self, sbx: Sandbox, state_path: Path, sync: bool = True,
                      flush: list[asyncio.Future] | None = None) -> Capture:
        """Stop the VM and take its device state and private pages (the VM stays stopped).
        ``flush``: also start the disk flush right after the stop (it overlaps the rest).
        The caller gives the delta's buffer back (``give_back``) when done with it."""
        vm = sbx.vm
        assert vm.qmp is not None and vm.spec.mem_path is not None
        mem_path = vm.spec.mem_path
        cfg = await self.templates.state_config(sbx.template)
        t0 = time.monotonic()
        await vm.qmp.execute("stop")   # returns with the vCPUs stopped and block I/O drained
        if flush is not None:
            flush.append(asyncio.ensure_future(asyncio.to_thread(sbx.image.flush)))
        t1 = time.monotonic()
        await save_devices(vm, state_path, cfg, sync)
        t2 = time.monotonic()
        buffer = self._buffers.pop() if self._buffers else None

        def pages() -> Delta:
            mapping = ram_mapping(vm.pid, mem_path)
            idx = private_pages(vm.pid, mapping)
            data, hashes = read_and_hash(vm.pid, mapping, idx, buffer)
            return Delta(sbx.template.memory, sbx.template.memory_mib << 20, idx, hashes, data)
        try:
            delta = await asyncio.to_thread(pages)
        except BaseException:
            self.give_back(buffer)
            raise
        return Capture(delta, t1 - t0, t2 - t1, time.monotonic() - t2)

    def give_back(self, buffer: PageBuffer | memoryview | None) -> None:
        """Keep one page buffer for the next capture (up to RETAINED_BUFFER bytes)."""
        if isinstance(buffer, memoryview):   # a view of the delta: the buffer it was read into
            buffer = buffer.obj if isinstance(buffer.obj, (bytearray, mmap.mmap)) else None
        if isinstance(buffer, (bytearray, mmap.mmap)) and len(buffer) <= RETAINED_BUFFER and (
                not self._buffers or len(self._buffers[0]) < len(buffer)):
            self._buffers[:] = [buffer]
