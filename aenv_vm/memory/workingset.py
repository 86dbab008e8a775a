"""Recorded working sets of memory images (REAP's idea over the lazy memory mount).

The first lazy restore of an image (on any node) records which parts of it the
kernel asked for in its first ``RECORD_SECONDS`` (lazyfs's READs: the pages the
restore, envd's first answers and the first commands touched, plus the read-around),
in first-touch order, and stores that list in the repository. A later cold restore
of the image, on any node sharing the repository, finds the list when it exposes the
image and fetches those parts in large batches (neighbouring chunks of a pack in one
range read, in parallel) and puts them into the image's page cache
(FUSE_NOTIFY_STORE) while QEMU starts: the faults that would each have waited for one
round trip to the store find their pages there.

Format (``application/vnd.aenv.memory-workingset``, a blob; little endian)::

    8   magic "AENVMWS1"
    4   version = 1
    4   unit: bytes per entry (a power of two, 4 KiB .. 16 MiB)
    8   memory size (bytes)
    32  memory image manifest id
    8   n
    4n  unit indexes (u32, first-touch order, distinct, < ceil(memory size / unit))

Store form: the blob plus a catalog record ``mws-<memory manifest id hex>`` of kind
``memory-workingset`` (role ``workingset``, meta ``memory``): a GC root, replaced by
no one (the first recording wins; it describes the image, which never changes).
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from aenv_store.errors import StoreNotFound, StoreError
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.store import Store

from ..errors import VmError
from .lazyfs import UNIT, LazyImage, MemoryFs

log = logging.getLogger(__name__)

MEDIA_TYPE = "application/vnd.aenv.memory-workingset"
KIND = "memory-workingset"
MAGIC = b"AENVMWS1"
VERSION = 1
_HEAD = struct.Struct("<8sIIQ32sQ")
RECORD_SECONDS = 20.0


class WorkingSetError(VmError):
    """A working-set blob that is not one."""


@dataclass(frozen=True)
class WorkingSet:
    memory: Digest
    memory_size: int
    unit: int
    units: tuple[int, ...]      # first-touch order

    def encode(self) -> bytes:
        check(self)
        return _HEAD.pack(MAGIC, VERSION, self.unit, self.memory_size, bytes(self.memory), len(self.units)) + \
            np.asarray(self.units, dtype="<u4").tobytes()


def check(ws: WorkingSet) -> None:
    if ws.unit < 4096 or ws.unit > 16 << 20 or ws.unit & (ws.unit - 1):
        raise WorkingSetError(f"working-set unit {ws.unit} is not a power of two in 4 KiB..16 MiB")
    limit = -(-ws.memory_size // ws.unit)
    if limit >= 2**32:
        raise WorkingSetError("memory too large for a working set of this unit")
    if len(set(ws.units)) != len(ws.units) or any(not 0 <= u < limit for u in ws.units):
        raise WorkingSetError("working-set units repeat or lie beyond the memory size")


def decode(raw: bytes) -> WorkingSet:
    if len(raw) < _HEAD.size:
        raise WorkingSetError("truncated working-set header")
    magic, version, unit, size, memory, n = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION:
        raise WorkingSetError(f"not a version-{VERSION} memory working set")
    if len(raw) != _HEAD.size + 4 * n:
        raise WorkingSetError(f"working set of {len(raw)} bytes does not hold {n} units")
    units = tuple(np.frombuffer(raw, dtype="<u4", offset=_HEAD.size, count=n).tolist())
    ws = WorkingSet(Digest(memory), size, unit, units)
    check(ws)
    return ws


def record_name(memory: Digest) -> str:
    return "mws-" + bytes(memory).hex()


def load(store: Store, memory: Digest) -> WorkingSet | None:
    """The recorded working set of image ``memory`` (None: none yet, or unreadable)."""
    try:
        rec = store.get_record(record_name(memory))
        reader = store.open_blob(rec.manifest("workingset"))
        if reader.manifest.media_type != MEDIA_TYPE:
            raise WorkingSetError(f"{rec.name} is a {reader.manifest.media_type}")
        ws = decode(reader.read(0, reader.size))
    except StoreNotFound:
        return None
    except (StoreError, WorkingSetError, KeyError) as e:
        log.warning("working set of memory image %s ignored: %s", memory.short(), e)
        return None
    return ws if ws.memory == memory else None


def save(store: Store, ws: WorkingSet) -> bool:
    """Commit ``ws`` unless the image has one already; False if it had."""
    raw = ws.encode()
    try:
        with store.workspace() as w:
            writer = w.blob_writer(MEDIA_TYPE, size=len(raw), meta={"memory": bytes(ws.memory).hex()})
            writer.write(0, raw)
            mid = writer.close()
            w.commit(CatalogRecord(name=record_name(ws.memory), kind=KIND, manifests=(("workingset", mid),),
                                   meta=(("memory", bytes(ws.memory).hex()),), created=time.time()))
    except StoreError as e:   # another node recorded it first (exclusive record), or the store failed
        log.info("working set of %s not stored: %s", ws.memory.short(), e)
        return False
    return True


class Recorder:
    """Records the first seconds of one lazily exposed image, then saves them (a thread)."""

    def __init__(self, store: Store, memory: Digest, memory_size: int, unit: int,
                 touched: Callable[[], Iterable[int]], seconds: float = RECORD_SECONDS) -> None:
        self.store = store
        self.memory = memory
        self.memory_size = memory_size
        self.unit = unit
        self.touched = touched          # () -> list of unit indexes in first-touch order
        self.seconds = seconds
        self.saved: WorkingSet | None = None
        self._timer = threading.Timer(seconds, self._save)
        self._timer.daemon = True
        self._lock = threading.Lock()
        self._done = False

    def start(self) -> None:
        self._timer.start()

    def flush(self) -> None:
        """Save now what was recorded so far (a node closing before the timer)."""
        self._timer.cancel()
        self._save()

    def _save(self) -> None:
        with self._lock:        # held while saving: a flush at close waits for the timer's save
            if self._done:
                return
            self._done = True
            units = tuple(self.touched())
            if not units:
                return
            ws = WorkingSet(self.memory, self.memory_size, self.unit, units)
            if not save(self.store, ws):
                return
            self.saved = ws
            log.info("working set of memory image %s recorded: %d MiB in %d units", self.memory.short(),
                     len(units) * self.unit >> 20, len(units))


class WorkingSets:
    """What a node's lazy mount does with each newly exposed image: fill it from its
    recorded working set if the repository has one, else record one."""

    def __init__(self, store: Store, fs: MemoryFs, seconds: float = RECORD_SECONDS) -> None:
        self.store = store
        self.fs = fs
        self.seconds = seconds
        self.recorders: list[Recorder] = []
        self.fills: list[threading.Thread] = []
        fs.on_new_image = self.exposed

    def exposed(self, img: LazyImage) -> None:
        ws = load(self.store, img.manifest.id)
        if ws is not None and ws.unit == UNIT and ws.memory_size == img.size:
            t = threading.Thread(target=self.fs.fill, args=(img, ws.units), name="aenv-lazymem-fill", daemon=True)
            t.start()
            self.fills.append(t)
            return
        rec = Recorder(self.store, img.manifest.id, img.size, UNIT, img.touched_units, self.seconds)
        rec.start()
        self.recorders.append(rec)

    def close(self) -> None:
        for r in self.recorders:
            r.flush()
        for t in self.fills:
            t.join(timeout=5.0)
