"""BlockImage: a stack of committed layers (≤ 255) plus one writable upper
layer, exported over NBD (implements nbd_server.BlockExport).

Reads consult the upper layer's block map, then the flattened extent map of
the committed stack (extent_map.py). Chunk bytes come from a small in-memory
LRU, else from the store's read chain (``Store.map_chunks``: node cache -> peers
-> repository, single flight per chunk; node-cache files come back as mappings
checked against the cache index). Chunks of the image are pinned in the node
cache while it is open. Observers (``ImageObserver``: the read-ahead of
prefetch.py) see every read and every chunk taken from the store.

Writes are 4 KiB-granular: partial blocks are read-modify-written from below.
``commit`` turns the upper layer into a new committed layer (only written
blocks; zeroed blocks become zero runs) and continues on a fresh upper layer.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, Protocol, Sequence

from aenv_store.export import write_file
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest

from .chunk_memory import ChunkMemory
from .extent_map import ExtentMap, StackMaps
from .layer import DISK_LAYER, MAX_LAYERS, ImageError, coalesce, image_record, load_stack
from .nbd_protocol import ExportInfo
from .upper import ABSENT, BLOCK, DATA, ZERO, UpperLayer

if TYPE_CHECKING:
    from aenv_store.store import Store

log = logging.getLogger(__name__)

# Reads touching the upper layer's data file are done on the event loop only
# up to this size (a page-cache pread); larger ones go to the thread pool.
NOWAIT_UPPER_BYTES = 256 * 1024
COMMIT_BATCH = 64   # chunks staged per stage_many call at commit (4 MiB at 64 KiB chunks)
# The flattened maps of the stacks images are opened on, shared by every image of the
# process (a template's sandboxes all open the same stack).
STACK_MAPS = StackMaps()


class MapPins:
    """The chunks of a shared stack map, pinned in a store's node cache once while any
    image opened on that map is open (the hundredth sandbox of a template takes a count,
    not tens of thousands of pins)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (id(store), id(map)) -> (store, map, users): the objects are held, so ids stay theirs
        self._users: dict[tuple[int, int], tuple["Store", ExtentMap, int]] = {}

    def acquire(self, store: "Store", m: ExtentMap) -> None:
        key = (id(store), id(m))
        with self._lock:
            got = self._users.get(key)
            if got is None:
                store.pin_chunks(m.chunks())
                self._users[key] = (store, m, 1)
            else:
                self._users[key] = (store, m, got[2] + 1)

    def release(self, store: "Store", m: ExtentMap) -> None:
        key = (id(store), id(m))
        with self._lock:
            got = self._users.get(key)
            if got is None:
                return
            if got[2] > 1:
                self._users[key] = (store, m, got[2] - 1)
                return
            del self._users[key]
            store.unpin_chunks(m.chunks())

    def users(self, store: "Store", m: ExtentMap) -> int:
        got = self._users.get((id(store), id(m)))
        return 0 if got is None else got[2]


MAP_PINS = MapPins()


class ImageObserver(Protocol):
    """Watches an image's reads (BlockImage.add_observer); called on the reading thread,
    so it must be quick (hand work to a thread of its own)."""

    def on_read(self, extent_map: ExtentMap, offset: int, length: int) -> None:
        """A read of [offset, offset+length) is about to be served (``extent_map``: the
        committed stack it reads through)."""

    def on_chunk(self, cid: Digest) -> None:
        """Chunk ``cid`` was taken from the store (it was not in the image's chunk memory)."""

    def close(self) -> None:
        """The image is closing."""


@dataclass(frozen=True)
class _View:
    """What a read needs, swapped atomically on commit."""

    layers: tuple[Manifest, ...]     # bottom first
    map: ExtentMap
    upper: UpperLayer | None


@dataclass(frozen=True)
class CommitInfo:
    layer: Manifest
    layer_id: Digest
    extents: int
    data_bytes: int
    zero_bytes: int
    seconds: float


class BlockImage:
    def __init__(self, name: str, store: "Store", layers: Sequence[Manifest], size: int,
                 upper_dir: Path | None = None, memory_bytes: int = 64 << 20,
                 chunk_size: int | None = None, fresh_upper: bool = False, min_free_disk: int = 0) -> None:
        """``min_free_disk``: writes that would leave the upper layer's filesystem with less
        free fail with ENOSPC (the guest sees an I/O error; the node keeps its floor)."""
        if len(layers) > MAX_LAYERS:
            raise ImageError(f"image has {len(layers)} layers (max {MAX_LAYERS})")
        self.name = name
        self.store = store
        self.size = size
        self.chunk_size = chunk_size or (layers[-1].chunk_size if layers else store.chunk_size)
        self.memory = ChunkMemory(memory_bytes)
        self._observers: tuple[ImageObserver, ...] = ()
        self._wlock = threading.RLock()
        self._retired: list[UpperLayer] = []
        self._seeders: list[threading.Thread] = []
        self._pinned: set[Digest] = set()
        flat = STACK_MAPS.get(size, [(m.id, m.extents) for m in layers])
        upper = None
        if upper_dir is not None:
            top = layers[-1].id if layers else None
            upper = UpperLayer(upper_dir, size, top, create=fresh_upper or not (upper_dir / "upper.map").exists(),
                               min_free=min_free_disk)
        self._view = _View(tuple(layers), flat, upper)
        self._base_map: ExtentMap | None = flat
        MAP_PINS.acquire(store, flat)      # the chunks committed since are pinned by _pin
        self._info = ExportInfo(name=name, size=size, read_only=upper is None,
                                # every connection shares this object and flush covers all of it
                                can_multi_conn=True, description=f"aenv image {name}")
        self.closed = False

    # --- opening -------------------------------------------------------
    @classmethod
    def open(cls, store: "Store", top: Digest | None, name: str, upper_dir: Path | None = None,
             size: int | None = None, *, memory_bytes: int = 64 << 20, chunk_size: int | None = None,
             fresh_upper: bool = False, min_free_disk: int = 0) -> "BlockImage":
        """An image whose top committed layer is ``top`` (None: an empty disk of ``size``);
        the rest as ``__init__`` takes them."""
        layers = load_stack(store, top) if top is not None else []
        if size is None:
            if not layers:
                raise ImageError("an image without layers needs a size")
            size = layers[-1].size
        return cls(name, store, layers, size, upper_dir, memory_bytes=memory_bytes, chunk_size=chunk_size,
                   fresh_upper=fresh_upper, min_free_disk=min_free_disk)

    @property
    def info(self) -> ExportInfo:
        return self._info

    @property
    def layers(self) -> tuple[Manifest, ...]:
        return self._view.layers

    @property
    def top(self) -> Digest | None:
        layers = self._view.layers
        return layers[-1].id if layers else None

    @property
    def extent_map(self) -> ExtentMap:
        return self._view.map

    @property
    def upper(self) -> UpperLayer | None:
        return self._view.upper

    def _pin(self, chunks: AbstractSet[Digest]) -> None:
        new = chunks - self._pinned
        if new:
            self.store.pin_chunks(new)
            self._pinned |= new

    def add_observer(self, observer: ImageObserver) -> None:
        """Tell ``observer`` about every read and chunk fetch from now on; it is closed with the image."""
        self._observers = self._observers + (observer,)

    @property
    def observers(self) -> tuple[ImageObserver, ...]:
        return self._observers

    # --- reads -----------------------------------------------------------
    def read_nowait(self, offset: int, length: int) -> bytes | None:
        return self._read(offset, length, nowait=True)

    def read(self, offset: int, length: int) -> bytes:
        data = self._read(offset, length, nowait=False)
        assert data is not None
        return data

    def _read(self, offset: int, length: int, nowait: bool) -> bytes | None:
        view = self._view
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        for observer in self._observers:
            observer.on_read(view.map, offset, end - offset)
        up = view.upper
        if up is not None and up.any_written:
            b0, b1 = offset // BLOCK, (end + BLOCK - 1) // BLOCK
            if (up.states[b0] if b1 - b0 == 1 else up.states[b0:b1].any()):
                if nowait and end - offset > NOWAIT_UPPER_BYTES:
                    return None          # a large local-file read: do it on a pool thread
                parts = []
                for ro, rl, st in up.runs(b0, b1):
                    lo, hi = max(ro, offset), min(ro + rl, end)
                    if st == DATA:
                        parts.append(up.read_data(lo, hi - lo))
                    elif st == ZERO:
                        parts.append(bytes(hi - lo))
                    else:
                        p = self._read_lower(view.map, lo, hi - lo, nowait)
                        if p is None:
                            return None
                        parts.append(p)
                return b"".join(parts)
        return self._read_lower(view.map, offset, end - offset, nowait)

    def _read_lower(self, m: ExtentMap, offset: int, length: int, nowait: bool) -> bytes | None:
        pieces = m.lookup(offset, length)
        out: list[bytes] = []
        got: dict[Digest, bytes | mmap.mmap] = {}
        for _pos, n, cid, coff in pieces:
            if cid is None:
                out.append(bytes(n))
                continue
            data = got.get(cid) or self.memory.get(cid)
            if data is None:
                if nowait:
                    return None
                # Fetch every missing chunk of this request at once (concurrently).
                missing = list(dict.fromkeys(c for _, _, c, _ in pieces
                                             if c is not None and c not in got and c not in self.memory))
                got.update(zip(missing, self.fetch_chunks(missing)))
                data = got.get(cid) or self.fetch_chunk(cid)
            out.append(data if (type(data) is bytes and not coff and n == len(data)) else data[coff:coff + n])
        return out[0] if len(out) == 1 else b"".join(out)

    def fetch_chunk(self, cid: Digest) -> bytes | mmap.mmap:
        """Chunk bytes via the chunk memory, else the store (may block on I/O)."""
        data = self.memory.get(cid)
        if data is None:
            data = self.fetch_chunks([cid])[0]
        return data

    def fetch_chunks(self, cids: list[Digest]) -> list[bytes | mmap.mmap]:
        """Several distinct chunks from the store, fetched together (one batch through
        its read chain): node-cache files mapped, no private copy of those."""
        datas = self.store.map_chunks(cids)
        for cid, data in zip(cids, datas):
            self.memory.put(cid, data)
            for observer in self._observers:
                observer.on_chunk(cid)
        return datas

    # --- writes ----------------------------------------------------------
    def _upper(self) -> UpperLayer:
        up = self._view.upper
        if up is None:
            raise PermissionError(f"image {self.name} is read-only")
        return up

    def _read_block(self, offset: int) -> bytes:
        data = self.read(offset, min(BLOCK, self.size - offset))
        return data + bytes(BLOCK - len(data)) if len(data) < BLOCK else data

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range {offset}+{length} outside image of {self.size} bytes")

    def write(self, offset: int, data: bytes, fua: bool = False) -> None:
        self._check(offset, len(data))
        if not data:
            return
        with self._wlock:
            up = self._upper()
            end = offset + len(data)
            a0 = offset - offset % BLOCK
            a1 = -(-end // BLOCK) * BLOCK
            if a0 == offset and a1 == end:
                up.write_blocks(offset, data)
            else:
                buf = bytearray(a1 - a0)
                if offset != a0:
                    buf[:BLOCK] = self._read_block(a0)
                if end != a1 and not (offset != a0 and a1 - BLOCK == a0):
                    buf[-BLOCK:] = self._read_block(a1 - BLOCK)
                buf[offset - a0:end - a0] = data
                up.write_blocks(a0, buf)
            if fua:
                up.flush()

    def write_zeroes(self, offset: int, length: int, fua: bool = False) -> None:
        self._check(offset, length)
        with self._wlock:
            up = self._upper()
            end = offset + length
            a0 = -(-offset // BLOCK) * BLOCK
            a1 = end - end % BLOCK if end != self.size else -(-end // BLOCK) * BLOCK
            if a1 <= a0:
                self.write(offset, bytes(length))
            else:
                if offset < a0:
                    self.write(offset, bytes(a0 - offset))
                up.zero_blocks(a0, a1 - a0)
                if end > a1:
                    self.write(a1, bytes(end - a1))
            if fua:
                up.flush()

    def trim(self, offset: int, length: int) -> None:
        """Discard: whole 4 KiB blocks inside the range read as zeros afterwards;
        partial blocks at the edges are left as they are (allowed by NBD)."""
        self._check(offset, length)
        with self._wlock:
            up = self._upper()
            end = offset + length
            a0 = -(-offset // BLOCK) * BLOCK
            a1 = end - end % BLOCK if end != self.size else -(-end // BLOCK) * BLOCK
            if a1 > a0:
                up.zero_blocks(a0, a1 - a0)

    def flush(self) -> None:
        up = self._view.upper
        if up is not None:
            up.flush()

    # --- commit ----------------------------------------------------------
    def commit(self, record_name: str | None = None, meta: dict[str, str] | None = None,
               exclusive: bool = False) -> CommitInfo:
        """Seal the upper layer as a new committed layer on top of the stack.

        Only blocks the upper layer holds are read (data) or described (zero
        runs); nothing below is touched. ``record_name`` (kind "image") is
        created/updated to point at the new top, which also keeps it from gc.
        """
        t0 = time.perf_counter()
        with self._wlock:
            view = self._view
            up = self._upper()
            if len(view.layers) >= MAX_LAYERS:
                raise ImageError(f"image {self.name} already has {MAX_LAYERS} layers: flatten it first")
            cs = self.chunk_size
            extents: list[Extent] = []
            fresh: list[tuple[Digest, bytes]] = []
            data_bytes = 0
            with self.store.workspace() as ws:
                batch: list[tuple[int, int]] = []

                def stage_batch() -> None:
                    # stage_many compresses a batch on the store's thread pool
                    nonlocal data_bytes
                    # batches are contiguous: one pread, chunk pieces as views into it
                    first = batch[0][0]
                    buf = memoryview(up.read_data(first, batch[-1][0] + batch[-1][1] - first))
                    datas = [buf[p - first:p - first + n] for p, n in batch]
                    for (p, n), data, cid in zip(batch, datas, ws.stage_many(datas)):
                        if cid is None:              # written zeros: a zero run, nothing stored
                            extents.append(Extent(p, n, None))
                        else:
                            extents.append(Extent(p, n, cid))
                            fresh.append((cid, bytes(data)))
                            data_bytes += n
                    batch.clear()

                for ro, rl, st in up.runs(0, up.nblocks):
                    if st == ABSENT:
                        continue
                    end = min(ro + rl, self.size)
                    if st == ZERO:
                        if batch:
                            stage_batch()
                        extents.append(Extent(ro, end - ro, None))
                        continue
                    if batch and batch[-1][0] + batch[-1][1] != ro:
                        stage_batch()
                    pos = ro
                    while pos < end:
                        n = min(end, (pos // cs + 1) * cs) - pos
                        batch.append((pos, n))
                        if len(batch) >= COMMIT_BATCH:
                            stage_batch()
                        pos += n
                if batch:
                    stage_batch()
                extents.sort(key=lambda e: e.offset)
                parent = view.layers[-1].id if view.layers else None
                meta_t = tuple(sorted((meta or {}).items()))
                layer = Manifest(DISK_LAYER, self.size, tuple(coalesce(extents)), parent=parent,
                                 chunk_size=cs, meta=meta_t)
                mid = ws.add_manifest(layer)
                record = image_record(record_name, mid, meta, time.time()) if record_name else None
                ws.commit(record, exclusive=exclusive)
            # The sealed data is verified plaintext already: keep it in the chunk
            # memory and seed the node cache in the background (off the commit's
            # latency), so reads after the commit do not go back to the repository.
            self._pin({cid for cid, _ in fresh})
            for cid, data in fresh:
                self.memory.put(cid, data)
            if fresh:
                t = threading.Thread(target=self._seed_cache, args=(fresh,), name="blockimage-seed", daemon=True)
                self._seeders.append(t)
                t.start()
            new_map = view.map.with_layer(layer.extents, len(view.layers))
            new_upper = UpperLayer(up.dir, self.size, mid, create=True, min_free=up.min_free)
            new_upper.flush()
            self._retired.append(up)   # readers holding the old view keep a valid fd
            self._view = _View(view.layers + (layer,), new_map, new_upper)
            zero_bytes = sum(e.length for e in layer.extents if e.chunk is None)
            return CommitInfo(layer, mid, len(layer.extents), data_bytes, zero_bytes, time.perf_counter() - t0)

    def _seed_cache(self, chunks: list[tuple[Digest, bytes]]) -> None:
        for cid, data in chunks:
            if self.closed:
                return
            try:
                self.store.keep_chunks([(cid, data)])
            except Exception as e:  # noqa: BLE001 - best effort: reads fall back to the repository
                log.debug("seeding node cache with %s failed: %s", cid.short(), e)
                return

    def wait_seeded(self) -> None:
        for t in self._seeders:
            t.join()
        self._seeders.clear()

    # --- lifecycle -------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.wait_seeded()
        for observer in self._observers:
            observer.close()
        up = self._view.upper
        if up is not None:
            up.flush()
            up.close()
        for old in self._retired:
            old.close()
        if self._pinned:
            self.store.unpin_chunks(self._pinned)
            self._pinned = set()
        if self._base_map is not None:
            MAP_PINS.release(self.store, self._base_map)
            self._base_map = None
        self.memory.clear()

    def __enter__(self) -> "BlockImage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def flatten_to(image: BlockImage, out: Path) -> int:
    """Write the image as a raw file (sparse where it reads zeros); returns bytes written."""
    return write_file(image.read, image.size, out)

