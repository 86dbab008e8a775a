"""Building a template: a booted guest frozen once.

``build_template`` cold-boots the guest with its root disk on an NBD export of
the guest's base layer (or of a given disk layer: an image converted with the
guest tools, docs/tools.md, or a layer built on one), waits until envd answers /health (and records the
version it reports), gives envd a secret only the template record knows (so a
clone answers nobody before the node re-keys it), adds the host's CA
certificates to the guest's trust store when given (trust.py), saves the device state
(``x-ignore-shared``), stops QEMU
and commits the disk layer (the upper layer written during boot, on top of
the base layer), the memory image and the device-state stream as one template
record (template.py).
"""
from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from pathlib import Path

from aenv_store.errors import StoreNotFound
from aenv_store.formats.ids import Digest
from aenv_store.store import Store

from ..blockimage.image import BlockImage
from ..blockimage.importer import import_raw
from ..blockimage.layer import image_top
from ..blockimage.nbd_server import NbdServer
from ..confine.policy import Confinement, jail_for
from ..envd_client import EnvdClient
from ..errors import BadRequest, VmError
from ..guest import GuestImage, kernel_cmdline
from ..tools import TOOLS_KEY_META
from ..confine.jail import Jail
from ..qemu.launcher import Accel, NbdDisk, QemuProcess, VmSpec, free_port
from ..qemu.migration import save_device_state
from .trust import CaBundle, install_ca_certificates
from .template import (DEVICE_STATE, MAX_DISK_MIB, MEMORY_IMAGE, Template, find_template, put_alias, stage_file,
                       template_record)


def base_layer(store: Store, guest: GuestImage) -> Digest:
    """The guest's root disk as a store layer (imported once per guest build)."""
    name = f"guest-{guest.key}"
    try:
        return image_top(store.get_record(name))
    except StoreNotFound:
        return import_raw(store, guest.rootfs, name, meta={"guest_key": guest.key}, exclusive=False).layer_id


async def build_template(store: Store, guest: GuestImage, work_dir: Path, *, alias: str | None = None,
                         memory_mib: int = 256, vcpus: int = 1, accel: Accel = "tcg",
                         disk_mib: int | None = None, boot_timeout: float = 180.0,
                         confinement: Confinement | None = None, base_layer: Digest | None = None,
                         ca_bundle: CaBundle | None = None) -> Template:
    """Cold-boot the guest once and commit it as a template (see the module doc).
    ``base_layer``: the root disk's layer (None: the guest's own image); it boots with
    the guest's kernel and initramfs, so it must be bootable by them: the Debian
    guest's image, or an image with the guest tools. ``disk_mib``: root disk size
    (None: the layer's); a larger disk is grown by the guest's init at boot (online
    ``resize2fs``) before the snapshot, so every sandbox of the template starts with
    the space, in its memory and on its disk. The build VM is confined by
    ``confinement`` (None: an ``auto`` policy of its own). ``ca_bundle``
    (``VmConfig.host_ca()``): certificates the guest is made to trust, with the
    variables tools need for them in envd's environment (trust.py)."""
    async with jail_for(confinement, f"template-build-{secrets.token_hex(4)}") as jail:
        return await _build(store, guest, work_dir, alias, memory_mib, vcpus, accel, disk_mib, boot_timeout, jail,
                            base_layer, ca_bundle)


def check_bootable(store: Store, guest: GuestImage, layer: Digest) -> None:
    """Refuse a layer converted with other guest tools than this guest's (its envd and
    init would be another build's): the image must be pulled or loaded again."""
    try:
        meta = dict(store.load_manifest(layer).meta)
    except StoreNotFound:
        raise BadRequest(f"no disk layer {layer.hex()} in the store") from None
    tools_key = meta.get(TOOLS_KEY_META)
    if tools_key is not None and guest.tools_key is not None and tools_key != guest.tools_key:
        raise BadRequest(f"the image {meta.get('source', layer.short())} carries guest tools {tools_key}, this "
                         f"node has {guest.tools_key}: pull or load it again")


async def _build(store: Store, guest: GuestImage, work_dir: Path, alias: str | None, memory_mib: int, vcpus: int,
                 accel: Accel, disk_mib: int | None, boot_timeout: float, jail: Jail | None,
                 layer: Digest | None, ca_bundle: CaBundle | None) -> Template:
    work_dir.mkdir(parents=True, exist_ok=True)
    what = "guest image" if layer is None else "image"
    if layer is None:
        layer = await asyncio.to_thread(base_layer, store, guest)
    else:
        await asyncio.to_thread(check_bootable, store, guest, layer)
    image_mib = store.load_manifest(layer).size >> 20
    if disk_mib is not None and disk_mib < image_mib:
        raise BadRequest(f"disk_mib {disk_mib} is smaller than the {what} ({image_mib} MiB)")
    if disk_mib is not None and disk_mib > MAX_DISK_MIB:
        raise BadRequest(f"disk_mib {disk_mib} is larger than {MAX_DISK_MIB} MiB")
    disk_mib = image_mib if disk_mib is None else disk_mib
    image = BlockImage.open(store, layer, "template-build", upper_dir=work_dir / "upper", size=disk_mib << 20)
    server = NbdServer(work_dir / "nbd.sock")
    server.add_export(image)
    # Under TCG, guest ASLR makes every new process map bash and its libraries at
    # new addresses, and TCG (QEMU 7.2 keys translations by virtual address) then
    # translates them afresh: 0.5-1 s per command. Without it the translations
    # made by a pooled clone's warm-up serve the user's commands. The sandbox VM is
    # the isolation boundary (its user may be root inside), so ASLR within the
    # guest buys little. KVM translates nothing: ASLR stays on there.
    cmdline = kernel_cmdline(extra="norandmaps" if accel == "tcg" else "")
    run_dir = work_dir / "run"
    spec = VmSpec(name="template-build", kernel=guest.kernel, initrd=guest.initrd, kernel_cmdline=cmdline,
                  run_dir=run_dir, memory_mib=memory_mib, vcpus=vcpus, accel=accel,
                  mem_path=work_dir / "memory", disk=NbdDisk(run_dir / "nbd.sock", "template-build"),
                  host_port=free_port(), jail=jail)
    assert spec.host_port is not None
    envd = EnvdClient("127.0.0.1", spec.host_port)
    try:
        await server.start()
        run_dir.mkdir(parents=True, exist_ok=True)
        await server.listen("template-build", run_dir / "nbd.sock", owner=jail.uid if jail is not None else None)
        vm = await QemuProcess.start(spec)
        try:
            envd_version = await envd.wait_healthy(timeout=boot_timeout, alive=vm.alive)
            # The frozen guest's envd demands this secret: a clone restored from the
            # template answers nobody until the node, which alone knows it (the template
            # record), re-keys it (restore.py).
            secret = secrets.token_urlsafe(32)
            await envd.init({"accessToken": secret})
            envd = envd.with_token(secret)
            # (A disk larger than the layer's filesystem was grown by the init before envd
            # started: fixtures/guest/aenv-init, grow_root.)
            if ca_bundle is not None:
                # envd's environment is part of the frozen memory: every process any
                # sandbox of the template starts has these (a /init merges, never drops them).
                trusted = await install_ca_certificates(envd, ca_bundle)
                if trusted.env:
                    await envd.init({"envVars": trusted.env})
            # Run the command path once per user before freezing: bash, its libraries and
            # profiles are then in the template's guest page cache, which clones share
            # instead of each reading them over NBD into private (copy-on-write) pages.
            for user in ("root", "user"):
                result = await envd.run("true", user=user, timeout=60.0)
                if result.exit_code != 0:
                    raise VmError(f"warm-up command as {user} exited {result.exit_code}")
            await save_device_state(vm, work_dir / "device-state")
        except VmError as e:
            raise VmError(f"template boot failed: {e}\n{vm.log_tail()}") from None
        finally:
            await vm.stop()
        await server.close()
        tid = f"tpl-{secrets.token_hex(6)}"

        def commit() -> None:
            disk = image.commit(meta={"template": tid})
            with store.workspace() as ws:
                mem = stage_file(ws, work_dir / "memory", MEMORY_IMAGE, {"template": tid})
                state = stage_file(ws, work_dir / "device-state", DEVICE_STATE, {"template": tid})
                meta = {"memory_mib": str(memory_mib), "vcpus": str(vcpus), "accel": accel, "disk_mib": str(disk_mib),
                        "guest_key": guest.key, "kernel_release": guest.kernel_release,
                        "kernel_cmdline": cmdline, "base_layer": layer.hex()}
                if envd_version:
                    meta["envd_version"] = envd_version
                meta["envd_token"] = secret
                if ca_bundle is not None:
                    meta["host_ca"] = ca_bundle.fingerprint
                ws.commit(template_record(tid, disk.layer_id, mem, state, meta, time.time()))
            if alias:
                put_alias(store, alias, tid, time.time(), exclusive=False)
        await asyncio.to_thread(commit)
    finally:
        await server.close()
        image.close()
        for name in ("memory", "device-state", "upper", "run"):
            p = work_dir / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return find_template(store, tid)
