"""The writable upper layer of an image: a local sparse data file plus a
4 KiB-granular block map, durable on flush.

Each 4 KiB block of the image is in one of three states:
ABSENT (read from the layers below), DATA (the block at the same offset of
the sparse data file) or ZERO (trimmed / write-zeroes: masks the layers
below). The data file is a 1:1 sparse image of the disk, so no allocation
table is needed; zeroed blocks are punched out of it.

The block map is persisted as run-length records in ``upper.map`` (layout:
docs/block-image.md "Upper layer"), written tmp -> fsync -> rename -> fsync
dir after the data file is fsynced: after a crash the map never names blocks
whose data did not reach the disk (NBD flush/FUA semantics).

The data file never grows past the image size (writes outside it are refused
before they get here), and with ``min_free`` a write that would allocate new
blocks while the filesystem has less than that free fails with ENOSPC: a guest
filling its disk cannot take the node below its free-disk floor.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import threading
from pathlib import Path

import numpy as np

from aenv_store.errors import CorruptData
from aenv_store.formats.ids import DIGEST_SIZE, Digest

BLOCK = 4096
ABSENT, DATA, ZERO = 0, 1, 2

MAP_MAGIC = b"AENVUPM1"
MAP_VERSION = 1
_MAP_HEAD = struct.Struct("<8sHHIQQ32s")   # magic, version, flags(0), block size, image size, runs, base id
_RUN = np.dtype([("start", "<u8"), ("count", "<u8"), ("state", "u1")])

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _punch_hole(fd: int, offset: int, length: int) -> None:
    # Frees the space of zeroed blocks; purely an optimisation (the block map
    # says ZERO), so a filesystem without hole punching is fine.
    _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)


def runs_of(states: np.ndarray) -> list[tuple[int, int, int]]:
    """(first block, block count, state) of each maximal run, ABSENT runs included."""
    if states.size == 0:
        return []
    change = np.flatnonzero(np.diff(states)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [states.size]))
    return [(int(s), int(e - s), int(states[s])) for s, e in zip(starts, ends)]


def upper_base(directory: Path) -> Digest | None:
    """The committed layer the upper layer in ``directory`` says it sits on (its map's
    header; None: on no layer). FileNotFoundError when there is no upper layer there."""
    with open(Path(directory) / "upper.map", "rb") as f:
        raw = f.read(_MAP_HEAD.size)
    try:
        magic, version, _flags, _bs, _size, _nruns, base = _MAP_HEAD.unpack_from(raw)
    except struct.error:
        raise CorruptData(f"{directory}/upper.map: truncated upper map") from None
    if magic != MAP_MAGIC or version != MAP_VERSION:
        raise CorruptData(f"{directory}/upper.map: not an upper map v{MAP_VERSION}")
    return None if base == bytes(DIGEST_SIZE) else Digest(base)


class UpperLayer:
    """Not thread-safe for writers: BlockImage serialises writes; reads may run concurrently."""

    def __init__(self, directory: Path, size: int, base: Digest | None, create: bool = True,
                 min_free: int = 0) -> None:
        self.dir = Path(directory)
        self.size = size
        self.base = base
        self.min_free = min_free        # bytes the filesystem keeps free (0: no floor)
        self.nblocks = (size + BLOCK - 1) // BLOCK
        self.data_path = self.dir / "upper.data"
        self.map_path = self.dir / "upper.map"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.states = np.zeros(self.nblocks, dtype=np.uint8)
        if self.map_path.exists() and not create:
            self._load_map()
        elif create:
            for p in (self.data_path, self.map_path):
                p.unlink(missing_ok=True)
        self.fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, self.nblocks * BLOCK)
        self._dirty = create
        self._lock = threading.Lock()
        # False until a block is written or zeroed: lets reads skip the block map entirely
        self.any_written = bool(self.states.any())

    # --- persistence ---------------------------------------------------
    def _load_map(self) -> None:
        raw = self.map_path.read_bytes()
        try:
            magic, version, _flags, bs, size, nruns, base = _MAP_HEAD.unpack_from(raw)
        except struct.error:
            raise CorruptData(f"{self.map_path}: truncated upper map") from None
        if magic != MAP_MAGIC or version != MAP_VERSION or bs != BLOCK:
            raise CorruptData(f"{self.map_path}: not an upper map v{MAP_VERSION}")
        base_d = None if base == bytes(DIGEST_SIZE) else Digest(base)
        if size != self.size or base_d != self.base:
            raise CorruptData(f"{self.map_path}: belongs to another image (size {size}, base {base_d})")
        runs = np.frombuffer(raw, dtype=_RUN, count=nruns, offset=_MAP_HEAD.size)
        for start, count, state in runs:
            if state not in (DATA, ZERO) or start + count > self.nblocks:
                raise CorruptData(f"{self.map_path}: bad run")
            self.states[start:start + count] = state

    def _save_map(self, states: np.ndarray) -> None:
        runs = [r for r in runs_of(states) if r[2] != ABSENT]
        arr = np.array(runs, dtype=_RUN) if runs else np.zeros(0, dtype=_RUN)
        head = _MAP_HEAD.pack(MAP_MAGIC, MAP_VERSION, 0, BLOCK, self.size, len(runs),
                              bytes(self.base) if self.base is not None else bytes(DIGEST_SIZE))
        tmp = self.map_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(head + arr.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.map_path)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def flush(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            # Cleared before the snapshot: a write landing meanwhile (flush runs
            # outside the image's write lock) marks it dirty again for the next flush.
            self._dirty = False
            # Snapshot the map before the fsync: every block it names has its
            # data written already, so after the fsync the map never runs ahead
            # of the data on disk.
            states = self.states.copy()
            try:
                os.fsync(self.fd)
                self._save_map(states)
            except BaseException:
                self._dirty = True
                raise

    # --- block I/O (block-aligned) -------------------------------------
    def write_blocks(self, offset: int, data: bytes | memoryview) -> None:
        assert offset % BLOCK == 0 and len(data) % BLOCK == 0
        if self.min_free:
            self._check_floor(offset, len(data))
        os.pwrite(self.fd, data, offset)
        self.any_written = True
        b0 = offset // BLOCK
        self.states[b0:b0 + len(data) // BLOCK] = DATA
        self._dirty = True

    def _check_floor(self, offset: int, length: int) -> None:
        b0 = offset // BLOCK
        new = int(np.count_nonzero(self.states[b0:b0 + length // BLOCK] != DATA)) * BLOCK
        if new:
            st = os.fstatvfs(self.fd)
            if st.f_bavail * st.f_frsize - new < self.min_free:
                raise OSError(errno.ENOSPC, f"{self.data_path}: the node keeps {self.min_free >> 20} MiB of its "
                                            "disk free")

    def zero_blocks(self, offset: int, length: int) -> None:
        assert offset % BLOCK == 0 and length % BLOCK == 0
        b0 = offset // BLOCK
        self.any_written = True
        self.states[b0:b0 + length // BLOCK] = ZERO
        _punch_hole(self.fd, offset, length)
        self._dirty = True

    def read_data(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) < length:   # past the end of a file shorter than expected: holes read as zeros
            data += bytes(length - len(data))
        return data

    def runs(self, b0: int, b1: int) -> list[tuple[int, int, int]]:
        """State runs of blocks [b0, b1) as (byte offset, byte length, state)."""
        return [((b0 + s) * BLOCK, n * BLOCK, st) for s, n, st in runs_of(self.states[b0:b1])]

    def touched(self) -> bool:
        return bool(self.states.any())

    def close(self, remove: bool = False) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if remove:
            for p in (self.data_path, self.map_path):
                p.unlink(missing_ok=True)
