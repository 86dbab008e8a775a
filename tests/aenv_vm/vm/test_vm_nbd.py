"""Boot the guest with its root disk served by aenv's own NBD server from a
store layer (aenv_vm.blockimage), the production disk path."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_store.store import Store
from aenv_vm.blockimage.image import BlockImage
from aenv_vm.blockimage.importer import import_raw
from aenv_vm.blockimage.nbd_server import NbdServer
from aenv_vm.envd_client import wait_http_ok
from aenv_vm.guest import GuestImage, kernel_cmdline
from aenv_vm.qemu.launcher import NbdDisk, QemuProcess, VmSpec, free_port
from aenv_vm.qemu.migration import status

pytestmark = pytest.mark.qemu


def test_boot_from_store_layer_over_nbd(guest: GuestImage, data_dir: Path, tmp_path: Path) -> None:
    settings = StoreSettings(paths=StorePaths(data_dir), repository=RepositoryConfig(),
                             store=StoreConfig(), cache=CacheConfig(capacity=4 << 30, min_free_disk=0))
    store = Store.open(settings, create=True)
    try:
        t0 = time.monotonic()
        layer = import_raw(store, guest.rootfs, "guest-base")
        imported = time.monotonic() - t0
        image = BlockImage.open(store, layer.layer_id, "root", upper_dir=tmp_path / "upper")

        async def run() -> tuple[float, str]:
            server = NbdServer(tmp_path / "nbd.sock")
            server.add_export(image)
            await server.start()
            spec = VmSpec(name="nbd-boot", kernel=guest.kernel, initrd=guest.initrd, kernel_cmdline=kernel_cmdline(),
                          run_dir=tmp_path / "run", memory_mib=256, disk=NbdDisk(server.socket_path, "root"),
                          host_port=free_port())
            try:
                start = time.monotonic()
                vm = await QemuProcess.start(spec)
                try:
                    await wait_http_ok("127.0.0.1", spec.host_port, "/health", timeout=180, alive=vm.alive)
                    return time.monotonic() - start, await status(vm)
                finally:
                    await vm.stop()
            finally:
                await server.close()

        boot, state = asyncio.run(run())
        image.close()
        print(f"\n[vm] import rootfs {imported:.1f} s ({layer.data_bytes >> 20} MiB data); "
              f"NBD boot to /health {boot:.2f} s")
        assert state == "running"
        assert layer.data_bytes < layer.size  # sparse image: holes are not stored
    finally:
        store.close()
