"""The base template: the guest booted once and frozen.

``build_template`` boots the guest (aenv_vm/machine, ``MachinePlan.build`` on a
host of its own: ``standalone_host``) with its root disk on an NBD export of the
guest's base layer (or of a given disk layer: an image converted with the guest
tools, docs/tools.md, or a layer built on one), waits until envd answers /health
(and records the version it reports), gives envd a secret only the template
record knows (so a clone answers nobody before the node re-keys it), adds the
host's CA certificates to the guest's trust store when given (trust.py), runs
the command path once per user, saves the device state (``x-ignore-shared``),
stops QEMU and commits the disk layer (the upper layer written during boot, on
top of the base layer), the memory image and the device-state stream as one
template record (freeze.py).
"""
from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from aenv_store.errors import StoreNotFound
from aenv_store.formats.ids import Digest
from aenv_store.store import Store

from ..blockimage.importer import import_raw
from ..blockimage.layer import image_top
from ..confine.policy import Confinement
from ..errors import BadRequest, VmError
from ..guest import GuestImage
from ..machine.bringup import bring_up
from ..machine.host import standalone_host
from ..machine.machine import close, halt
from ..machine.plan import Greeting, MachinePlan
from ..qemu.launcher import Accel
from ..tools import TOOLS_KEY_META
from .freeze import freeze
from .meta import TemplateMeta
from .template import MAX_DISK_MIB, Template, find_template
from .trust import CaBundle, install_ca_certificates


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
    """Boot the guest once and commit it as a template (see the module doc).
    ``base_layer``: the root disk's layer (None: the guest's own image); it boots with
    the guest's kernel and initramfs, so it must be bootable by them: the Debian
    guest's image, or an image with the guest tools. ``disk_mib``: root disk size
    (None: the layer's); a larger disk is grown by the guest's init at boot (online
    ``resize2fs``) before the snapshot, so every sandbox of the template starts with
    the space, in its memory and on its disk. The boot VM is confined by
    ``confinement`` (None: an ``auto`` policy of its own). ``ca_bundle``
    (``VmConfig.host_ca()``): certificates the guest is made to trust, with the
    variables tools need for them in envd's environment (trust.py). ``work_dir`` is
    the caller's: the boot's files in it are removed at the end, not the directory."""
    work_dir.mkdir(parents=True, exist_ok=True)
    layer, disk_mib = await _disk(store, guest, base_layer, disk_mib)
    # The frozen guest's envd demands this secret: a clone restored from the template
    # answers nobody until the node, which alone knows it (the template record),
    # re-keys it (aenv_vm/sandboxes/restore.py).
    secret = secrets.token_urlsafe(32)
    plan = MachinePlan.build(f"template-build-{secrets.token_hex(4)}", work_dir, layer, disk_mib=disk_mib,
                             memory_mib=memory_mib, vcpus=vcpus, accel=accel,
                             greeting=Greeting({"accessToken": secret}, None, boot_timeout),
                             failure="template boot failed", keep_work=True)
    tid = f"tpl-{secrets.token_hex(6)}"
    async with standalone_host(store, guest, work_dir, confinement) as host:
        machine, _ = await bring_up(host, plan)
        try:
            envd = machine.envd
            try:
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
                state = await halt(host, machine)
            except VmError as e:
                raise VmError(f"template boot failed: {e}\n{machine.vm.log_tail()}") from None
            shape = plan.shape
            meta = TemplateMeta(memory_mib=shape.memory_mib, vcpus=shape.vcpus, accel=shape.accel,
                                guest_key=guest.key, kernel_cmdline=shape.kernel_cmdline,
                                kernel_release=guest.kernel_release, disk_mib=disk_mib, base_layer=layer,
                                envd_version=machine.envd_version or None, envd_token=secret,
                                host_ca=ca_bundle.fingerprint if ca_bundle is not None else None)
            await asyncio.to_thread(freeze, store, tid, disk=machine.image, memory=machine.memory_file,
                                    device_state=state, meta=meta, alias=alias)
        finally:
            await close(host, machine)
    return find_template(store, tid)


async def _disk(store: Store, guest: GuestImage, layer: Digest | None, disk_mib: int | None) -> tuple[Digest, int]:
    """The layer the template boots from and its disk size in MiB (BadRequest: a size
    smaller than the layer, or beyond MAX_DISK_MIB)."""
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
    return layer, image_mib if disk_mib is None else disk_mib


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
