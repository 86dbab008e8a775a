"""Templates: a booted guest frozen once, from which sandboxes are restored.

``build_template`` cold-boots the guest with its root disk on an NBD export of
the guest's base layer, waits until envd answers /health, saves the device
state (``x-ignore-shared``), stops QEMU and commits three artifacts to the
store: the disk layer (the upper layer written during boot, on top of the base
layer), the memory image (the ``share=on`` memory file, zero pages not stored)
and the device-state stream. One catalog record (kind ``template``, name
``tpl-<hex>``) names them; ``template.<alias>`` is an alias record to it.

``materialize`` writes a template's memory image and device state into the
node's local template directory once; every sandbox restored from it maps that
same memory file ``share=off``, so they share its pages in the host page cache.
"""
from __future__ import annotations

import asyncio
import errno
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import NotFound, StoreError
from aenv_store.formats.catalog import ALIAS, CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.store import Store

from .blockimage.image import BlockImage
from .blockimage.importer import import_raw
from .blockimage.layer import DISK_ROLE, image_top
from .blockimage.nbd_server import NbdServer
from .envd_client import run_command
from .guest import GuestImage, kernel_cmdline, wait_http_ok
from .qemu.errors import VmError
from .qemu.launcher import Accel, NbdDisk, QemuProcess, VmSpec, free_port
from .qemu.migration import save_device_state

TEMPLATE_KIND = "template"
MEMORY_IMAGE = "application/vnd.aenv.memory-image"
DEVICE_STATE = "application/vnd.aenv.device-state"
ALIAS_PREFIX = "template."
MAX_DISK_MIB = 1 << 20    # 1 TiB: the upper layer and NBD export are sparse; this bounds typos


class TemplateError(VmError):
    """A template is unknown, corrupt, or does not fit this node."""


@dataclass(frozen=True)
class Template:
    id: str
    disk: Digest
    memory: Digest
    device_state: Digest
    memory_mib: int
    vcpus: int
    accel: str
    guest_key: str
    kernel_cmdline: str
    created: float
    disk_mib: int = 0    # root disk size (0: a record from before sizes were recorded)

    @classmethod
    def from_record(cls, rec: CatalogRecord) -> "Template":
        if rec.kind != TEMPLATE_KIND:
            raise TemplateError(f"{rec.name} is a {rec.kind} record, not a template")
        try:
            meta = rec.meta_dict()
            return cls(id=rec.name, disk=rec.manifest(DISK_ROLE), memory=rec.manifest("memory"),
                       device_state=rec.manifest("state"), memory_mib=int(meta["memory_mib"]),
                       vcpus=int(meta["vcpus"]), accel=meta["accel"], guest_key=meta["guest_key"],
                       kernel_cmdline=meta["kernel_cmdline"], created=rec.created,
                       disk_mib=int(meta.get("disk_mib", "0")))
        except (KeyError, ValueError) as e:
            raise TemplateError(f"template record {rec.name} is incomplete: {e}") from None


def find_template(store: Store, ref: str) -> Template:
    """A template by id (``tpl-…``) or alias."""
    for name in ((ALIAS_PREFIX + ref, ref) if not ref.startswith("tpl-") else (ref,)):
        try:
            return Template.from_record(store.resolve(name))
        except NotFound:
            continue
        except ValueError:  # not a valid catalog name
            break
    raise TemplateError(f"unknown template {ref!r}")


def list_templates(store: Store) -> list[tuple[Template, list[str]]]:
    aliases: dict[str, list[str]] = {}
    for rec in store.list_records(ALIAS):
        if rec.name.startswith(ALIAS_PREFIX) and rec.target:
            aliases.setdefault(rec.target, []).append(rec.name[len(ALIAS_PREFIX):])
    return [(Template.from_record(r), sorted(aliases.get(r.name, [])))
            for r in store.list_records(TEMPLATE_KIND)]


def remove_template(store: Store, ref: str) -> Template:
    tpl = find_template(store, ref)
    for rec in store.list_records(ALIAS):
        if rec.target == tpl.id and rec.name.startswith(ALIAS_PREFIX):
            store.delete_record(rec.name)
    store.delete_record(tpl.id)
    return tpl


def base_layer(store: Store, guest: GuestImage) -> Digest:
    """The guest's root disk as a store layer (imported once per guest build)."""
    name = f"guest-{guest.key}"
    try:
        return image_top(store.get_record(name))
    except NotFound:
        return import_raw(store, guest.rootfs, name, meta={"guest_key": guest.key}, exclusive=False).layer_id


def _data_ranges(fd: int, size: int, step: int) -> list[tuple[int, int]]:
    """Allocated, chunk-aligned ranges of a sparse file (untouched guest pages are holes)."""
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:
                break
            return [(0, size)]
        end = os.lseek(fd, start, os.SEEK_HOLE)
        start -= start % step
        end = min(-(-end // step) * step, size)
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
        pos = end
    return out


def _put_file(ws, path: Path, media_type: str, meta: dict[str, str]) -> Digest:  # type: ignore[no-untyped-def]
    size = path.stat().st_size
    writer = ws.blob_writer(media_type, size=size, meta=meta)
    cs = writer.chunk_size
    zero = bytes(cs)
    with open(path, "rb", buffering=0) as f:
        for start, end in _data_ranges(f.fileno(), size, cs):
            for off in range(start, end, cs):
                data = os.pread(f.fileno(), min(cs, end - off), off)
                if data != zero[:len(data)]:
                    writer.write(off, data)
    return writer.close()


async def build_template(store: Store, guest: GuestImage, work_dir: Path, *, alias: str | None = None,
                         memory_mib: int = 256, vcpus: int = 1, accel: Accel = "tcg",
                         disk_mib: int | None = None, boot_timeout: float = 180.0) -> Template:
    """Cold-boot the guest once and commit it as a template (see the module doc).
    ``disk_mib``: root disk size (None: the guest image's); a larger disk is grown
    inside the booted guest (online ``resize2fs``) before the snapshot, so every
    sandbox of the template starts with the space, in its memory and on its disk."""
    work_dir.mkdir(parents=True, exist_ok=True)
    layer = await asyncio.to_thread(base_layer, store, guest)
    image_mib = store.load_manifest(layer).size >> 20
    if disk_mib is not None and disk_mib < image_mib:
        raise TemplateError(f"disk_mib {disk_mib} is smaller than the guest image ({image_mib} MiB)")
    if disk_mib is not None and disk_mib > MAX_DISK_MIB:
        raise TemplateError(f"disk_mib {disk_mib} is larger than {MAX_DISK_MIB} MiB")
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
    spec = VmSpec(name="template-build", kernel=guest.kernel, initrd=guest.initrd, kernel_cmdline=cmdline,
                  run_dir=work_dir / "run", memory_mib=memory_mib, vcpus=vcpus, accel=accel,
                  mem_path=work_dir / "memory", disk=NbdDisk(server.socket_path, "template-build"),
                  host_port=free_port())
    try:
        await server.start()
        vm = await QemuProcess.start(spec)
        try:
            await wait_http_ok(spec.host_port, "/health", timeout=boot_timeout, alive=vm.alive)
            # Run the command path once per user before freezing: bash, its libraries and
            # profiles are then in the template's guest page cache, which clones share
            # instead of each reading them over NBD into private (copy-on-write) pages.
            if disk_mib > image_mib:
                grown = await asyncio.to_thread(run_command, spec.host_port, "resize2fs /dev/vda", user="root",
                                                timeout=120.0)
                if grown.exit_code != 0:
                    raise VmError(f"growing the root filesystem to {disk_mib} MiB failed: "
                                  f"{grown.stderr.decode(errors='replace').strip()}")
            for user in ("root", "user"):
                result = await asyncio.to_thread(run_command, spec.host_port, "true", user=user, timeout=60.0)
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
                mem = _put_file(ws, work_dir / "memory", MEMORY_IMAGE, {"template": tid})
                state = _put_file(ws, work_dir / "device-state", DEVICE_STATE, {"template": tid})
                meta = {"memory_mib": str(memory_mib), "vcpus": str(vcpus), "accel": accel, "disk_mib": str(disk_mib),
                        "guest_key": guest.key, "kernel_release": guest.kernel_release,
                        "kernel_cmdline": cmdline}
                ws.commit(CatalogRecord(name=tid, kind=TEMPLATE_KIND,
                                        manifests=((DISK_ROLE, disk.layer_id), ("memory", mem), ("state", state)),
                                        meta=tuple(sorted(meta.items())), created=time.time()))
            if alias:
                store.put_record(CatalogRecord(name=ALIAS_PREFIX + alias, kind=ALIAS, target=tid,
                                               created=time.time()), exclusive=False)
        await asyncio.to_thread(commit)
    finally:
        await server.close()
        image.close()
        for name in ("memory", "device-state", "upper", "run"):
            p = work_dir / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return find_template(store, tid)


def materialize(store: Store, tpl: Template, root: Path) -> tuple[Path, Path]:
    """The template's memory file and device-state file on local disk (written once)."""
    d = root / tpl.id
    mem, state = d / "memory", d / "device-state"
    if mem.is_file() and state.is_file():
        return mem, state
    d.mkdir(parents=True, exist_ok=True)
    try:
        for mid, path, media in ((tpl.memory, mem, MEMORY_IMAGE), (tpl.device_state, state, DEVICE_STATE)):
            reader = store.open_blob(mid)
            if reader.manifest.media_type != media:
                raise TemplateError(f"template {tpl.id}: {path.name} has media type {reader.manifest.media_type}")
            tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                f.truncate(reader.size)
                for e in reader.extents():
                    if e.chunk is not None:
                        os.pwrite(f.fileno(), reader.read(e.offset, e.length), e.offset)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except StoreError as e:
        raise TemplateError(f"template {tpl.id} cannot be read from the store: {e}") from None
    if mem.stat().st_size != tpl.memory_mib << 20:
        raise TemplateError(f"template {tpl.id}: memory image is {mem.stat().st_size} bytes, "
                            f"expected {tpl.memory_mib} MiB")
    return mem, state
