"""Manifests: content-addressed descriptions of artifacts (extents -> chunks).

Byte layout: docs/store-format.md ("Manifests"). The encoding is canonical,
so ``Manifest.id`` (BLAKE3 of ``encode()``) is a stable identity and
``decode`` rejects anything ``encode`` would not produce."""
from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import CorruptData
from .ids import DIGEST_SIZE, Digest

MAGIC = b"AENVMANI"
VERSION = 1
FLAG_PARENT = 1
MIN_CHUNK_SIZE = 4 * 1024
MAX_CHUNK_SIZE = 4 * 1024 * 1024
MAX_TEXT = 255

_HEAD = struct.Struct("<8sHHIQ")       # magic, version, flags, chunk size, size
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_EXT = struct.Struct("<BQQ")           # kind, offset, length
KIND_ZERO = 0
KIND_DATA = 1

BLOB = "application/vnd.aenv.blob"


def check_chunk_size(chunk_size: int) -> int:
    if (not isinstance(chunk_size, int) or chunk_size < MIN_CHUNK_SIZE or chunk_size > MAX_CHUNK_SIZE
            or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk size must be a power of two between 4 KiB and 4 MiB, got {chunk_size}")
    return chunk_size


@dataclass(frozen=True)
class Extent:
    offset: int            # byte offset in the artifact
    length: int            # bytes (> 0)
    chunk: Digest | None   # None = a run of zeros

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Manifest:
    media_type: str
    size: int
    extents: tuple[Extent, ...]
    parent: Digest | None = None
    chunk_size: int = 65536
    meta: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    @cached_property
    def _offsets(self) -> list[int]:
        return [e.offset for e in self.extents]

    def validate(self) -> None:
        """Raise ValueError if the manifest breaks a rule of the format."""
        self._validate_header()
        self._validate_extents()

    def _validate_header(self) -> None:
        check_chunk_size(self.chunk_size)
        if not isinstance(self.size, int) or self.size < 0 or self.size >= 1 << 63:
            raise ValueError(f"bad manifest size {self.size!r}")
        mt = self.media_type.encode("utf-8") if isinstance(self.media_type, str) else b""
        if not 0 < len(mt) <= MAX_TEXT:
            raise ValueError(f"media type must be 1..{MAX_TEXT} UTF-8 bytes, got {self.media_type!r}")
        if self.parent is not None and (not isinstance(self.parent, bytes) or len(self.parent) != DIGEST_SIZE):
            raise ValueError("parent must be a Digest")
        prev_key: str | None = None
        for item in self.meta:
            if not (isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item)):
                raise ValueError(f"meta items must be (str, str) pairs, got {item!r}")
            k, v = item
            if not 0 < len(k.encode("utf-8")) <= MAX_TEXT:
                raise ValueError(f"meta key must be 1..{MAX_TEXT} UTF-8 bytes: {k!r}")
            v.encode("utf-8")
            if prev_key is not None and k <= prev_key:
                raise ValueError("meta keys must be unique and sorted")
            prev_key = k

    def _validate_extents(self) -> None:
        end = 0
        cs = self.chunk_size
        for e in self.extents:
            if not isinstance(e, Extent) or not isinstance(e.offset, int) or not isinstance(e.length, int):
                raise ValueError(f"bad extent {e!r}")
            if e.length <= 0 or e.offset < end:
                raise ValueError(f"extents must be sorted, non-overlapping and non-empty (at {e.offset})")
            end = e.offset + e.length
            if end > self.size:
                raise ValueError(f"extent [{e.offset}, {end}) beyond size {self.size}")
            if e.chunk is not None:
                if not isinstance(e.chunk, bytes) or len(e.chunk) != DIGEST_SIZE:
                    raise ValueError(f"bad chunk id in extent at {e.offset}")
                if e.length > cs or e.offset // cs != (end - 1) // cs:
                    raise ValueError(f"data extent [{e.offset}, {end}) crosses a {cs}-byte chunk boundary")

    # -- codec -------------------------------------------------------------------

    def encode(self) -> bytes:
        out = bytearray(_HEAD.pack(MAGIC, VERSION, FLAG_PARENT if self.parent is not None else 0,
                                   self.chunk_size, self.size))
        mt = self.media_type.encode("utf-8")
        out += _U16.pack(len(mt)) + mt
        if self.parent is not None:
            out += self.parent
        out += _U32.pack(len(self.meta))
        for k, v in self.meta:
            kb, vb = k.encode("utf-8"), v.encode("utf-8")
            out += _U16.pack(len(kb)) + kb + _U32.pack(len(vb)) + vb
        out += _U64.pack(len(self.extents))
        pack = _EXT.pack
        for e in self.extents:
            if e.chunk is None:
                out += pack(KIND_ZERO, e.offset, e.length)
            else:
                out += pack(KIND_DATA, e.offset, e.length)
                out += e.chunk
        return bytes(out)

    @classmethod
    def decode(cls, data: bytes, stored_as: Digest | None = None) -> "Manifest":
        """``stored_as``: the id the caller found ``data`` under and checked against it
        (the repository does), so ``id`` need not encode and hash the manifest again."""
        try:
            m = _decode(memoryview(data))
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise CorruptData(f"bad manifest: {e}") from None
        if stored_as is not None:
            m.__dict__["id"] = stored_as     # what the cached_property would hold
        return m

    @cached_property
    def id(self) -> Digest:
        return Digest.of(self.encode())

    # -- queries -----------------------------------------------------------------

    def meta_dict(self) -> dict[str, str]:
        return dict(self.meta)

    @property
    def chunks(self) -> list[Digest]:
        """Chunk ids of the data extents, in order (repeats kept)."""
        return [e.chunk for e in self.extents if e.chunk is not None]

    def stored_bytes(self) -> int:
        return sum(e.length for e in self.extents if e.chunk is not None)

    def extents_in(self, offset: int, length: int) -> list[Extent]:
        """Extents overlapping [offset, offset+length), in order."""
        end = offset + length
        i = max(bisect.bisect_right(self._offsets, offset) - 1, 0)
        out: list[Extent] = []
        ext = self.extents
        while i < len(ext) and ext[i].offset < end:
            if ext[i].end > offset:
                out.append(ext[i])
            i += 1
        return out


def _decode(mv: memoryview) -> Manifest:
    magic, version, flags, chunk_size, size = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ValueError("bad magic")
    if version != VERSION:
        raise ValueError(f"unsupported version {version}")
    if flags & ~FLAG_PARENT:
        raise ValueError(f"unknown flags {flags:#x}")
    pos = _HEAD.size
    (n,) = _U16.unpack_from(mv, pos)
    pos += 2
    media_type = _text(mv, pos, n)
    pos += n
    parent = None
    if flags & FLAG_PARENT:
        parent = Digest(_take(mv, pos, DIGEST_SIZE))
        pos += DIGEST_SIZE
    (nmeta,) = _U32.unpack_from(mv, pos)
    pos += 4
    if nmeta > len(mv):
        raise ValueError("meta count too large")
    meta = []
    for _ in range(nmeta):
        (kl,) = _U16.unpack_from(mv, pos)
        k = _text(mv, pos + 2, kl)
        pos += 2 + kl
        (vl,) = _U32.unpack_from(mv, pos)
        v = _text(mv, pos + 4, vl)
        pos += 4 + vl
        meta.append((k, v))
    (next_,) = _U64.unpack_from(mv, pos)
    pos += 8
    if next_ > len(mv):
        raise ValueError("extent count too large")
    extents: list[Extent] = []
    unpack = _EXT.unpack_from
    raw = mv.obj if isinstance(mv.obj, bytes) else bytes(mv)
    mk_digest = bytes.__new__  # ids sliced from the buffer are 32 bytes by construction
    offs: list[int] = []
    lens: list[int] = []
    data_at: list[int] = []
    for i in range(next_):
        kind, off, ln = unpack(mv, pos)
        pos += _EXT.size
        offs.append(off)
        lens.append(ln)
        if kind == KIND_ZERO:
            extents.append(Extent(off, ln, None))
        elif kind == KIND_DATA:
            if pos + DIGEST_SIZE > len(raw):
                raise ValueError("truncated extent")
            extents.append(Extent(off, ln, mk_digest(Digest, raw[pos:pos + DIGEST_SIZE])))
            data_at.append(i)
            pos += DIGEST_SIZE
        else:
            raise ValueError(f"unknown extent kind {kind}")
    if pos != len(mv):
        raise ValueError(f"{len(mv) - pos} trailing bytes")
    m = object.__new__(Manifest)
    for name, value in (("media_type", media_type), ("size", size), ("extents", tuple(extents)),
                        ("parent", parent), ("chunk_size", chunk_size), ("meta", tuple(meta))):
        object.__setattr__(m, name, value)
    m._validate_header()
    _check_extent_arrays(offs, lens, data_at, size, chunk_size)
    return m


def _check_extent_arrays(offs: list[int], lens: list[int], data_at: list[int], size: int, cs: int) -> None:
    """The extent rules of Manifest._validate_extents, vectorised (decoding a
    manifest of an 8 GiB memory image checks 131k extents)."""
    if not offs:
        return
    o = np.array(offs, dtype=np.uint64)
    n = np.array(lens, dtype=np.uint64)
    # size < 2**63, so once offset and length are each <= size their sum cannot wrap
    if (n == 0).any() or (o > size).any() or (n > size).any():
        raise ValueError("extents must be non-empty and inside the artifact")
    ends = o + n
    if (ends > size).any():
        raise ValueError(f"extent beyond size {size}")
    if (o[1:] < ends[:-1]).any():
        raise ValueError("extents must be sorted and non-overlapping")
    if data_at:
        d = np.array(data_at, dtype=np.intp)
        do, de, dn = o[d], ends[d], n[d]
        if (dn > cs).any() or (do // np.uint64(cs) != (de - np.uint64(1)) // np.uint64(cs)).any():
            raise ValueError(f"a data extent crosses a {cs}-byte chunk boundary")


def _take(mv: memoryview, pos: int, n: int) -> bytes:
    if pos + n > len(mv):
        raise ValueError("truncated")
    return bytes(mv[pos:pos + n])


def _text(mv: memoryview, pos: int, n: int) -> str:
    return _take(mv, pos, n).decode("utf-8")
