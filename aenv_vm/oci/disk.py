"""From an image's layer files to a block image in the store: flatten the layers
into a directory in the workspace, make it an ext4 disk with the directory
import (``mkfs.ext4 -d``; the CAS deduplicates its chunks), and commit the
image's catalog record with the image's identity and runtime config in its
meta (docs/images.md). The record is written last: a failure anywhere leaves
no record, and the temporary tree is always removed."""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from aenv_store.admin.progress import ProgressFactory, human_bytes, no_progress
from aenv_store.errors import AlreadyExists, StoreNotFound
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest

from ..blockimage.importer import import_tree, tree_size
from ..blockimage.layer import IMAGE_KIND, image_top
from ..errors import Conflict
from ..tools import TOOLS_KEY_META, ToolsTree, install_tools
from .config import OciConfig
from .errors import OciError
from .layers import ApplyStats, apply_layers
from .manifest import ImageConfig

if TYPE_CHECKING:
    from aenv_store.store import Store

MiB = 1 << 20
NAME_PREFIX = "oci-"


@dataclass(frozen=True)
class LayerFile:
    path: Path
    label: str
    diff_id: str | None
    size: int


@dataclass(frozen=True)
class ImageIdentity:
    """What names an image independent of the node: its manifest digest (for a
    `docker save` archive without one, its config digest), where it came from."""

    reference: str              # canonical reference, or the archive's tag / file name
    digest: str
    platform: str
    config_digest: str
    index_digest: str | None = None
    source: str = "registry"    # registry or archive


@dataclass(frozen=True)
class DiskImage:
    name: str
    layer_id: Digest
    size: int
    reused: bool
    meta: dict[str, str]
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    chunks_added: int = 0        # new chunks the import stored
    chunks_deduped: int = 0      # chunks the store already had (the CAS at work)

    @property
    def runtime(self) -> dict[str, object]:
        return runtime_of(self.meta)


def default_name(digest: str) -> str:
    """The catalog name of an image by default: deterministic in its digest."""
    return NAME_PREFIX + digest.removeprefix("sha256:")[:24]


def runtime_of(meta: dict[str, str]) -> dict[str, object]:
    """The image config a template build uses (Env, Entrypoint, Cmd, WorkingDir, User,
    ExposedPorts, ...) from an image record's meta."""
    try:
        value = json.loads(meta.get("oci.config", "{}"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def image_meta(ident: ImageIdentity, config: ImageConfig, layers: int) -> dict[str, str]:
    meta = {"source": ident.reference, "oci.reference": ident.reference, "oci.digest": ident.digest,
            "oci.platform": ident.platform, "oci.config_digest": ident.config_digest,
            "oci.config": config.runtime_json(), "oci.layers": str(layers), "oci.source": ident.source}
    if ident.index_digest:
        meta["oci.index_digest"] = ident.index_digest
    return meta


def image_path_env(config: ImageConfig) -> str | None:
    """PATH of the image config's Env (what its commands expect), if it sets one."""
    env = config.runtime.get("Env")
    for item in env if isinstance(env, list) else []:
        if isinstance(item, str) and item.startswith("PATH="):
            return item[len("PATH="):]
    return None


def tools_current(rec: CatalogRecord, tools: ToolsTree | None) -> bool:
    """Whether image ``rec`` carries ``tools`` (always true when no tools are asked for):
    an image converted with other tools is converted again (the layer cache keeps
    that cheap), so every image a node boots runs the node's envd."""
    return tools is None or dict(rec.meta).get(TOOLS_KEY_META) == tools.key


def find_image(store: "Store", digest: str, platform: str | None = None) -> CatalogRecord | None:
    """An image record pulled from manifest ``digest`` (or from an index of that digest,
    for ``platform``): the default-named one if it is there, else any."""
    try:
        rec = store.get_record(default_name(digest))
        if rec.kind == IMAGE_KIND and dict(rec.meta).get("oci.digest") == digest:
            return rec
    except StoreNotFound:            # not under its default name: look at every image
        pass
    for rec in sorted(store.list_records(IMAGE_KIND), key=lambda r: r.created):
        meta = dict(rec.meta)
        if meta.get("oci.digest") == digest:
            return rec
        if meta.get("oci.index_digest") == digest and (platform is None or meta.get("oci.platform") == platform):
            return rec
    return None


def check_name_free(store: "Store", name: str | None, digest: str) -> None:
    """Fail early (before any download) when ``name`` is taken by another image."""
    if name is None:
        return
    try:
        rec = store.get_record(name)
    except StoreNotFound:
        return
    if dict(rec.meta).get("oci.digest") != digest:
        raise Conflict(f"an image named {name!r} exists (another image): choose another --name, "
                       "or --force to replace it")


def reuse(store: "Store", rec: CatalogRecord, name: str | None, replace: bool) -> DiskImage:
    """An existing image, under ``name`` too if that is another name (a new record
    naming the same layers: nothing is copied)."""
    top = image_top(rec)
    size = store.load_manifest(top).size
    meta = dict(rec.meta)
    if name and name != rec.name:
        if not replace:
            check_name_free(store, name, meta.get("oci.digest", ""))
            try:
                named = store.get_record(name)         # already there under that name too
                return DiskImage(name, image_top(named), store.load_manifest(image_top(named)).size, True,
                                 dict(named.meta))
            except StoreNotFound:
                pass
        store.put_record(CatalogRecord(name=name, kind=IMAGE_KIND, manifests=rec.manifests, meta=rec.meta,
                                       created=time.time()), exclusive=not replace)
        return DiskImage(name, top, size, True, meta)
    return DiskImage(rec.name, top, size, True, meta)


# mkfs.ext4 gives a filesystem of 512 MiB or more one inode per 16 KiB (mke2fs.conf's
# inode_ratio): a tree of many small files (node_modules, site-packages) runs out of
# inodes long before it runs out of blocks unless the disk is sized for its inodes too.
EXT4_BYTES_PER_INODE = 16384


def count_inodes(root: Path) -> int:
    """Files, directories and links under ``root`` (hardlinks counted once each)."""
    seen: set[int] = set()
    n = 1
    for dirpath, dirs, files in os.walk(root):
        n += len(dirs)
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_nlink > 1:
                if st.st_ino in seen:
                    continue
                seen.add(st.st_ino)
            n += 1
    return n


def disk_size(tree_bytes: int, inodes: int, config: OciConfig) -> int:
    """The flattened tree's size plus the configured headroom, and never fewer inodes
    than the tree needs with the same headroom, in whole MiB."""
    factor = 100 + config.disk_headroom_percent
    by_bytes = tree_bytes * factor // 100
    by_inodes = inodes * EXT4_BYTES_PER_INODE * factor // 100
    size = max(by_bytes, by_inodes) + config.disk_headroom_mib * MiB
    return -(-size // MiB) * MiB


def build_disk_image(store: "Store", config: OciConfig, layers: list[LayerFile], ident: ImageIdentity,
                     image_config: ImageConfig, name: str | None = None, size: int | None = None,
                     replace: bool = False, progress: ProgressFactory = no_progress,
                     log_line: Callable[[str], None] | None = None, tools: ToolsTree | None = None) -> DiskImage:
    """Flatten ``layers``, install ``tools`` into the tree (docs/tools.md: what makes any
    image bootable; None: the tree as the image has it), make the ext4 disk, commit."""
    t0 = time.perf_counter()
    say = log_line or (lambda _t: None)
    work_root = store.settings.paths.workspace
    work_root.mkdir(parents=True, exist_ok=True)
    meta = image_meta(ident, image_config, len(layers))
    if tools is not None:
        meta[TOOLS_KEY_META] = tools.key
    record_name = name or default_name(ident.digest)
    with tempfile.TemporaryDirectory(dir=work_root, prefix="oci-rootfs-") as td, \
            open(Path(td) / "lock", "w") as lock:
        # held while the tree is in use, as a workspace's: the store's clean-up of stale
        # workspace dirs (clean_stale_workspaces) skips it while this pull lives
        fcntl.flock(lock, fcntl.LOCK_EX)
        root = Path(td) / "rootfs"
        total = sum(lf.size for lf in layers)
        with progress(f"flatten {len(layers)} layer(s)", total, "bytes") as bar:
            stats: ApplyStats = apply_layers(root, [(lf.path, lf.label, lf.diff_id) for lf in layers],
                                             on_bytes=bar.advance, floor=store.settings.cache.floor)
        notes = list(stats.notes)
        if tools is not None:
            report = install_tools(root, tools, image_path_env(image_config))
            notes += report.notes
            done = [f"guest tools {tools.key} installed"]
            if report.linked:
                done.append(f"linked {', '.join(report.linked)}")
            if report.user_added:
                done.append(f"added user {report.uid}:{report.gid}")
            say("; ".join(done))
        for note in notes:
            say(f"note: {note}")
        content = tree_size(root)
        disk = size if size is not None else disk_size(content, count_inodes(root), config)
        say(f"flattened {stats.entries} entries ({stats.files} files, {human_bytes(stats.bytes)}); "
            f"making a {disk // MiB} MiB ext4 disk")
        # the disk file holds the tree's bytes again (sparse beyond them)
        why = store.settings.cache.floor.shortage(work_root, content, 1)
        if why is not None:
            raise OciError(f"making the image's disk would go below the node's free-disk floor: {why}")
        try:
            res = import_tree(store, root, record_name, size=disk, meta=meta, exclusive=not replace)
        except AlreadyExists:
            # another pull of the same image committed first: use its record (ours
            # left only packs nothing references, which `aenv repo gc` removes)
            check_name_free(store, record_name, ident.digest)
            return reuse(store, store.get_record(record_name), None, False)
        full_meta = dict(store.get_record(record_name).meta)
    return DiskImage(record_name, res.layer_id, res.size, False, full_meta, tuple(notes),
                     time.perf_counter() - t0, res.chunks_added, res.chunks_deduped)
