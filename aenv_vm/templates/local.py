"""A node's local side of templates: the memory image and device state of each
template its sandboxes use, written once into ``<run_root>/templates/<id>/``
(``materialize``); every sandbox restored from a template maps that same memory
file ``share=off``, so they share its pages in the host page cache.

``LocalTemplates`` is what the sandbox layer asks: resolve a reference to a
template this node can run (its guest build must be the node's), the local
files (one writer at a time), the configuration section of its device state (a
capture needs it), and the envd access token its frozen guest still holds.

A pause's snapshot (``Template.delta`` set: template.py) keeps only its device state
and its delta (``memory.delta``) in its own directory; the memory file its clones map
is the one of the template it was paused over (its ``parent_template`` chain), so no
image is written twice and its clones share that template's page cache.
"""
from __future__ import annotations

import asyncio
import os
import threading
import shutil
from pathlib import Path

from aenv_store.errors import StoreError
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Manifest
from aenv_store.store import Store

from ..errors import VmError
from ..memory.device_state import template_config
from ..memory.lazyfs import LazyImage, MemoryFs
from ..memory.memory_image import Delta, fetch_delta, read_delta, write_delta
from .template import DEVICE_STATE, MEMORY_IMAGE, Template, TemplateError, find_template

DELTA_FILE = "memory.delta"     # a pause's snapshot: its pages (aenv_vm/memory/memory_image.py, version 1)
MAX_DONORS = 8                  # templates walked for the memory file of a pause's snapshot


def _write_blob(store: Store, mid: Digest, path: Path, media: str, tid: str) -> None:
    """Artifact ``mid`` assembled into ``path`` (tmp → fsync → rename)."""
    reader = store.open_blob(mid)
    if reader.manifest.media_type != media:
        raise TemplateError(f"template {tid}: {path.name} has media type {reader.manifest.media_type}")
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.truncate(reader.size)
        for e in reader.extents():
            if e.chunk is not None:
                os.pwrite(f.fileno(), reader.read(e.offset, e.length), e.offset)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def materialize(store: Store, tpl: Template, root: Path) -> tuple[Path, Path]:
    """The template's memory file and device-state file on local disk (written once)."""
    d = root / tpl.id
    mem, state = d / "memory", d / "device-state"
    if mem.is_file() and state.is_file():
        return mem, state
    d.mkdir(parents=True, exist_ok=True)
    try:
        for mid, path, media in ((tpl.memory, mem, MEMORY_IMAGE), (tpl.device_state, state, DEVICE_STATE)):
            if not path.is_file():
                _write_blob(store, mid, path, media, tpl.id)
    except StoreError as e:
        raise TemplateError(f"template {tpl.id} cannot be read from the store: {e}") from None
    if mem.stat().st_size != tpl.memory_mib << 20:
        raise TemplateError(f"template {tpl.id}: memory image is {mem.stat().st_size} bytes, "
                            f"expected {tpl.memory_mib} MiB")
    return mem, state


def cached_whole(store: Store, manifest: Manifest) -> bool:
    """Every data chunk of ``manifest`` is in the node cache (stops at the first miss)."""
    cache = store.cache
    return cache is not None and all(cache.contains(c) for c in dict.fromkeys(manifest.chunks))


def lazy_files(store: Store, tpl: Template, root: Path, lazy: MemoryFs) -> tuple[Path, Path] | None:
    """(lazy memory file, local device-state file) when the memory image is to be served
    page by page: already exposed, or not wholly in the node cache. None: materialize."""
    d = root / tpl.id
    try:
        exposed = lazy.image(tpl.memory)
        if exposed is None:
            if (d / "memory").is_file():
                return None
            manifest = store.load_manifest(tpl.memory)
            if manifest.media_type != MEMORY_IMAGE:
                raise TemplateError(f"template {tpl.id}: memory has media type {manifest.media_type}")
            if manifest.size != tpl.memory_mib << 20:
                raise TemplateError(f"template {tpl.id}: memory image is {manifest.size} bytes, "
                                    f"expected {tpl.memory_mib} MiB")
            if cached_whole(store, manifest):
                return None          # a warm node: assembled from the node cache as before
        else:
            manifest = exposed.manifest
        state = d / "device-state"
        if not state.is_file():
            d.mkdir(parents=True, exist_ok=True)
            _write_blob(store, tpl.device_state, state, DEVICE_STATE, tpl.id)
    except StoreError as e:
        raise TemplateError(f"template {tpl.id} cannot be read from the store: {e}") from None
    return lazy.expose(manifest), state


class LocalTemplates:
    """The templates of one node's sandboxes. Use within one event loop."""

    def __init__(self, store: Store, guest_key: str, root: Path) -> None:
        self.store = store
        self.guest_key = guest_key
        self.root = root
        self._lock = asyncio.Lock()            # one writer of the local template files
        self._configs: dict[str, bytes] = {}
        # memory images not on this node are served page by page from the store
        # (aenv_vm/memory/lazyfs.py); None: fetched whole before the first restore
        self.lazy: MemoryFs | None = None

    def resolve(self, ref: str) -> Template:
        """A template (id, alias, snapshot id or name) this node can restore from.
        ``errors.NotFound`` if unknown; TemplateError if built from another guest."""
        tpl = find_template(self.store, ref)
        if tpl.guest_key != self.guest_key:
            raise TemplateError(f"template {tpl.id} was built from guest {tpl.guest_key}, this node runs guest "
                                f"{self.guest_key}: rebuild the template")
        return tpl

    def dir(self, tid: str) -> Path:
        return self.root / tid

    async def files(self, tpl: Template) -> tuple[Path, Path]:
        """(memory file, device-state file) of ``tpl`` on this node: the local memory file
        if the node has it or its whole image is in the node cache, else (with ``lazy``)
        a file of the lazy memory mount that fetches pages as the guest touches them."""
        async with self._lock:
            return await asyncio.to_thread(self._files, tpl, False)

    def _files(self, tpl: Template, local: bool) -> tuple[Path, Path]:
        if tpl.delta is not None:
            donor = self._donor(tpl)
            if donor is not None:      # its memory file is that template's; the device state its own
                return self._files(donor, local)[0], self._state(tpl)
        if not local and self.lazy is not None and self.lazy.mounted:
            got = lazy_files(self.store, tpl, self.root, self.lazy)
            if got is not None:
                return got
        return materialize(self.store, tpl, self.root)

    def _donor(self, tpl: Template) -> Template | None:
        """The template a pause's snapshot was paused over (up its ``parent_template``
        chain) whose memory image is the one ``tpl`` maps; None: none is left (the image is
        then fetched into ``tpl``'s own directory)."""
        ref = tpl.meta.parent_template
        for _ in range(MAX_DONORS):
            if ref is None:
                return None
            try:
                parent = find_template(self.store, ref)
            except (VmError, StoreError):   # gone: the walk ends here
                return None
            if parent.memory != tpl.memory:
                return None
            if parent.delta is None:
                return parent
            ref = parent.meta.parent_template
        return None

    def _state(self, tpl: Template) -> Path:
        d = self.root / tpl.id
        state = d / "device-state"
        if not state.is_file():
            d.mkdir(parents=True, exist_ok=True)
            try:
                _write_blob(self.store, tpl.device_state, state, DEVICE_STATE, tpl.id)
            except StoreError as e:
                raise TemplateError(f"template {tpl.id} cannot be read from the store: {e}") from None
        return state

    async def full_files(self, tpl: Template) -> tuple[Path, Path]:
        """Like ``files``, but the memory file is always local (what a consolidation reads
        whole anyway)."""
        async with self._lock:
            return await asyncio.to_thread(self._files, tpl, True)

    async def delta(self, tpl: Template) -> Delta:
        """The pages of a pause's snapshot (``tpl.delta``), from its local ``memory.delta``,
        fetched from the store the first time (node cache → peers → repository). Version 1,
        memory-mapped: its clones read one page cache."""
        assert tpl.delta is not None, f"template {tpl.id} is not a pause's snapshot"
        async with self._lock:
            return await asyncio.to_thread(self._delta, tpl)

    def _delta(self, tpl: Template) -> Delta:
        path = self.root / tpl.id / DELTA_FILE
        if not path.is_file():
            assert tpl.delta is not None
            fetched, _ = fetch_delta(self.store, tpl.delta)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_delta(path, fetched)
        delta = read_delta(path)
        if delta.base != tpl.memory:
            raise TemplateError(f"template {tpl.id}: its memory delta is over {delta.base.short()}, "
                                f"not its memory image {tpl.memory.short()}")
        return delta

    def lazy_image(self, memory: Path) -> LazyImage | None:
        """The lazy image behind memory file ``memory`` (None: a local file)."""
        if self.lazy is None:
            return None
        for img in self.lazy.images():
            if self.lazy.mountpoint / img.name == memory:
                return img
        return None

    async def state_config(self, tpl: Template) -> bytes:
        """The configuration section of the template's device-state stream (what a
        capture of one of its sandboxes puts in front of the devices' state)."""
        cfg = self._configs.get(tpl.id)
        if cfg is None:
            _, state = await self.files(tpl)
            cfg = self._configs[tpl.id] = template_config(state)
        return cfg

    @staticmethod
    def envd_token(tpl: Template) -> str | None:
        """The envd access token the template's frozen guest still holds (its record's:
        a built template's secret, a snapshot's sandbox token; None: none)."""
        return tpl.meta.envd_token

    def forget(self, tid: str) -> None:
        """Drop what this node keeps of ``tid`` (its files and cached facts)."""
        shutil.rmtree(self.root / tid, ignore_errors=True)
        self._configs.pop(tid, None)
