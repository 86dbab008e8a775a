"""Templates as the store holds them: one catalog record (kind ``template``,
name ``tpl-<hex>``) naming three artifacts -- the disk layer, the memory image
(the ``share=on`` memory file of a frozen guest, zero pages not stored) and the
device-state stream -- plus its meta (meta.py: memory size, vCPUs, accelerator,
guest build, kernel command line, the envd version the guest reported, what a
build or a snapshot adds). ``template.<alias>`` is an alias record to it. Named
snapshots and forks' hidden snapshots are template records too
(aenv_vm/sandboxes/snapshots.py).

A paused sandbox's pause named as a snapshot (aenv_vm/sandboxes/pausefork.py) is one
that copies nothing: its record names the pause's manifests, the memory a **delta**
(``memory`` role, a memory-delta manifest whose parent is ``base``) over the full image
``base`` that its clones map; a restore writes the delta's pages into that mapping
before the device state loads, as a resume does. ``Template.memory`` is always the full
image a clone maps (the ``base`` role of such a record), ``Template.delta`` the delta.

How a record is committed: freeze.py (the base template: base.py; template
builds: aenv_vm/builds/; snapshots). How a node keeps its local copy: local.py.
"""
from __future__ import annotations

import errno
import os

import blake3
from dataclasses import dataclass
from pathlib import Path

from aenv_store.formats.catalog import ALIAS, CatalogRecord
from aenv_store.errors import StoreError, StoreNotFound
from aenv_store.formats.ids import Digest
from aenv_store.store import Store
from aenv_store.workspace import Workspace

from ..blockimage.layer import DISK_ROLE
from ..machine.plan import Shape
from ..memory.workingset import record_name as working_set_record
from ..errors import NotFound, VmError
from ..qemu.launcher import Accel
from .meta import HIDDEN_KINDS, NO_SETTINGS, GuestSettings, TemplateMeta

TEMPLATE_KIND = "template"
MEMORY_IMAGE = "application/vnd.aenv.memory-image"
DEVICE_STATE = "application/vnd.aenv.device-state"
ALIAS_PREFIX = "template."
BASE_ROLE = "base"        # a pause's snapshot: the full image its ``memory`` (a delta) is over
MAX_DISK_MIB = 1 << 20    # 1 TiB: the upper layer and NBD export are sparse; this bounds typos
MAX_PARENTS = 8           # records walked for a build's guest settings (``guest_settings``)


class TemplateError(VmError):
    """A template is corrupt, or does not fit this node (unknown ones: ``errors.NotFound``)."""


@dataclass(frozen=True)
class Template:
    """A template record this node can name: its three artifacts and its meta."""
    id: str
    disk: Digest
    memory: Digest                  # the full memory image its clones map
    device_state: Digest
    created: float
    meta: TemplateMeta
    delta: Digest | None = None     # a pause's snapshot: its pages, written over ``memory`` at restore

    @classmethod
    def from_record(cls, rec: CatalogRecord) -> "Template":
        if rec.kind != TEMPLATE_KIND:
            raise TemplateError(f"{rec.name} is a {rec.kind} record, not a template")
        try:
            roles = dict(rec.manifests)
            if BASE_ROLE in roles:      # a pause's snapshot: its memory is a delta over the base image
                memory, delta = roles[BASE_ROLE], roles["memory"]
            else:
                memory, delta = rec.manifest("memory"), None
            return cls(id=rec.name, disk=rec.manifest(DISK_ROLE), memory=memory,
                       device_state=rec.manifest("state"), created=rec.created,
                       meta=TemplateMeta.from_meta(rec.meta_dict()), delta=delta)
        except (KeyError, ValueError) as e:
            raise TemplateError(f"template record {rec.name} is incomplete: {e}") from None

    @property
    def memory_mib(self) -> int:
        return self.meta.memory_mib

    @property
    def vcpus(self) -> int:
        return self.meta.vcpus

    @property
    def accel(self) -> Accel:
        return self.meta.accel

    @property
    def guest_key(self) -> str:
        return self.meta.guest_key

    @property
    def kernel_cmdline(self) -> str:
        return self.meta.kernel_cmdline

    @property
    def shape(self) -> Shape:
        """The machine every clone of it is (aenv_vm/machine)."""
        m = self.meta
        return Shape(m.memory_mib, m.vcpus, m.accel, m.kernel_cmdline)

    @property
    def disk_mib(self) -> int:
        """Root disk size (0: a record from before sizes were recorded)."""
        return self.meta.disk_mib or 0

    @property
    def envd_version(self) -> str | None:
        return self.meta.envd_version

    @property
    def host_ca(self) -> str:
        """Fingerprint of the host CA certificates it trusts ("": none; trust.py)."""
        return self.meta.host_ca or ""

    @property
    def ready_cmd(self) -> str | None:
        """A template build's ready command (the warm pool runs it too)."""
        return self.meta.ready_cmd or None

    @property
    def volume_paths(self) -> tuple[str, ...]:
        """A snapshot's guest has volumes mounted there (no channel)."""
        return self.meta.volume_paths or ()

    @property
    def hidden_fork_node(self) -> str | None:
        """A hidden snapshot (a fork's, or a pause's made for a batch): the node that made it
        ("" before nodes were named); None: not one."""
        return (self.meta.fork_node or "") if self.meta.hidden in HIDDEN_KINDS else None


def tag_alias_name(name: str, tag: str) -> str:
    """The alias record of E2B's ``name:tag`` (aenv_vm/builds/records.py writes them)."""
    return "ttag-" + blake3.blake3(f"{name}:{tag}".encode()).hexdigest()[:40]


def find_template(store: Store, ref: str) -> Template:
    """A template by id (``tpl-…``), alias, or E2B ``name:tag``."""
    if ":" in ref:
        name, _, tag = ref.partition(":")
        names: tuple[str, ...] = (tag_alias_name(name.lower(), tag),)
    elif ref.startswith("tpl-"):
        names = (ref,)
    else:
        names = (ALIAS_PREFIX + ref, ref)
    for name in names:
        try:
            return Template.from_record(store.resolve(name))
        except StoreNotFound:
            continue
        except ValueError:  # not a valid catalog name
            break
    raise NotFound(f"unknown template {ref!r}")


def template_record(tid: str, disk: Digest, memory: Digest, state: Digest, meta: TemplateMeta,
                    created: float, delta: Digest | None = None) -> CatalogRecord:
    """The catalog record of a template (or snapshot) whose three artifacts are staged;
    ``delta``: a pause's snapshot, its memory role that delta over full image ``memory``."""
    mem: tuple[tuple[str, Digest], ...] = (("memory", memory),) if delta is None else (
        ("memory", delta), (BASE_ROLE, memory))
    return CatalogRecord(name=tid, kind=TEMPLATE_KIND, manifests=((DISK_ROLE, disk), *mem, ("state", state)),
                         meta=tuple(sorted(meta.to_meta().items())), created=created)


def guest_settings(store: Store, tpl: Template) -> GuestSettings:
    """What ``tpl``'s build told its envd, and its start command (a cold boot tells a
    booted guest again); none for a template built without them. A snapshot's record
    carries its parent's (snapshots copy their parent's meta); for records that do not,
    the parents are asked, up to MAX_PARENTS of them."""
    meta: TemplateMeta | None = tpl.meta
    for _ in range(MAX_PARENTS):
        if meta is None:
            break
        found = GuestSettings.of(meta)
        if found is not None:
            return found
        meta = _meta_of(store, meta.parent_template) if meta.parent_template else None
    return NO_SETTINGS


def _meta_of(store: Store, name: str) -> TemplateMeta | None:
    try:
        return TemplateMeta.from_meta(store.resolve(name).meta_dict())
    except (StoreError, ValueError):   # gone, or not a template's: the walk ends there
        return None


def put_alias(store: Store, alias: str, tid: str, created: float, exclusive: bool) -> None:
    """``template.<alias>`` → ``tid`` (``exclusive``: fail if the alias exists)."""
    store.put_record(CatalogRecord(name=ALIAS_PREFIX + alias, kind=ALIAS, target=tid, created=created),
                     exclusive=exclusive)


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
    if tpl.delta is not None:   # a pause's snapshot: its memory image is its source template's
        return tpl
    try:   # the working set recorded for its memory image (aenv_vm/memory/workingset.py), if any
        store.delete_record(working_set_record(tpl.memory))
    except StoreNotFound:
        pass
    return tpl


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


def stage_file(ws: Workspace, path: Path, media_type: str, meta: dict[str, str]) -> Digest:
    """Stage a memory image or device-state file as a blob: only its allocated,
    non-zero chunks are written (a sparse memory file stays small in the store)."""
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


