"""Pack files: zstd-compressed chunks with a self-describing trailer.

Byte layout: docs/store-format.md ("Pack files"). Pure codec functions
(``encode_trailer``/``decode_footer``/``decode_table``) plus a sequential
``PackWriter`` to a local file and ``read_trailer`` over any range reader, so
verify / rebuild-index work on a backend with range reads only."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import blake3
import zstandard

from ..durable import write_all
from ..errors import CorruptData
from .ids import DIGEST_SIZE, Digest

MAGIC = b"AENVPACK"
END_MAGIC = b"AENVPEND"
VERSION = 1
HEADER = struct.Struct("<8sII")          # magic, version, flags
HEADER_SIZE = HEADER.size                # 16
ENTRY = struct.Struct("<32sQII")         # chunk id, offset, length, raw length
ENTRY_SIZE = ENTRY.size                  # 48
FOOTER_HEAD = struct.Struct("<IIQQ")     # version, flags, count, table offset
FOOTER = struct.Struct("<IIQQ32s8s")
FOOTER_SIZE = FOOTER.size                # 64
MAX_RAW_LENGTH = 4 << 20                 # largest chunk size


@dataclass(frozen=True)
class PackEntry:
    chunk: Digest
    offset: int
    length: int
    raw_length: int

    @property
    def compressed(self) -> bool:
        return self.length < self.raw_length


def encode_header() -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0)


def decode_header(data: bytes) -> None:
    if len(data) < HEADER_SIZE:
        raise CorruptData("pack header truncated")
    magic, version, flags = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptData("not an aenv pack (bad magic)")
    if version != VERSION:
        raise CorruptData(f"unsupported pack version {version}")
    if flags != 0:
        raise CorruptData(f"unknown pack flags {flags:#x}")


def encode_trailer(entries: Iterable[PackEntry], table_offset: int) -> bytes:
    entries = list(entries)
    table = b"".join(ENTRY.pack(e.chunk, e.offset, e.length, e.raw_length) for e in entries)
    head = FOOTER_HEAD.pack(VERSION, 0, len(entries), table_offset)
    checksum = blake3.blake3(table + head).digest()
    return table + head + checksum + END_MAGIC


@dataclass(frozen=True)
class Footer:
    count: int
    table_offset: int
    checksum: bytes
    head: bytes


def decode_footer(data: bytes, pack_size: int) -> Footer:
    """Parse the last FOOTER_SIZE bytes of a pack of ``pack_size`` bytes."""
    if len(data) != FOOTER_SIZE:
        raise CorruptData("pack footer truncated")
    version, flags, count, table_offset, checksum, magic = FOOTER.unpack(data)
    if magic != END_MAGIC:
        raise CorruptData("pack footer: bad magic (truncated or not a pack)")
    if version != VERSION:
        raise CorruptData(f"pack footer: unsupported version {version}")
    if flags != 0:
        raise CorruptData(f"pack footer: unknown flags {flags:#x}")
    if count < 1 or table_offset < HEADER_SIZE or table_offset + count * ENTRY_SIZE + FOOTER_SIZE != pack_size:
        raise CorruptData(f"pack footer: {count} entries at {table_offset} do not fit a pack of {pack_size} bytes")
    return Footer(count, table_offset, checksum, data[:FOOTER_HEAD.size])


def decode_table(table: bytes, footer: Footer) -> list[PackEntry]:
    """Check the trailer checksum and the table's invariants; return its entries."""
    if len(table) != footer.count * ENTRY_SIZE:
        raise CorruptData("pack table truncated")
    if blake3.blake3(table + footer.head).digest() != footer.checksum:
        raise CorruptData("pack trailer checksum mismatch")
    entries: list[PackEntry] = []
    expect = HEADER_SIZE
    seen: set[bytes] = set()
    for raw_id, offset, length, raw_length in ENTRY.iter_unpack(table):
        if offset != expect:
            raise CorruptData(f"pack table: entry at {offset}, expected {expect}")
        if length == 0 or raw_length == 0 or length > raw_length or raw_length > MAX_RAW_LENGTH:
            raise CorruptData(f"pack table: bad lengths {length}/{raw_length} at {offset}")
        if raw_id in seen:
            raise CorruptData("pack table: duplicate chunk id")
        seen.add(raw_id)
        entries.append(PackEntry(Digest(raw_id), offset, length, raw_length))
        expect = offset + length
    if expect != footer.table_offset:
        raise CorruptData(f"pack table: payloads end at {expect}, table starts at {footer.table_offset}")
    return entries


RangeReader = Callable[[int, int], bytes]


def read_trailer(read_range: RangeReader, pack_size: int) -> list[PackEntry]:
    """The chunk table of a pack using two range reads: the footer, then the table."""
    if pack_size < HEADER_SIZE + FOOTER_SIZE:
        raise CorruptData(f"pack too small ({pack_size} bytes)")
    footer = decode_footer(read_range(pack_size - FOOTER_SIZE, FOOTER_SIZE), pack_size)
    table = read_range(footer.table_offset, footer.count * ENTRY_SIZE)
    return decode_table(table, footer)


class PackReader:
    """A pack behind a range reader (local file, posix_fs or S3 object): the
    trailer costs two range reads; each chunk one more."""

    def __init__(self, read_range: RangeReader, size: int, name: str = "pack") -> None:
        self.read_range = read_range
        self.size = size
        self.name = name
        self._entries: list[PackEntry] | None = None

    def entries(self) -> list[PackEntry]:
        if self._entries is None:
            try:
                self._entries = read_trailer(self.read_range, self.size)
            except CorruptData as e:
                raise CorruptData(f"{self.name}: {e}") from None
        return self._entries

    def read_header(self) -> None:
        try:
            decode_header(self.read_range(0, HEADER_SIZE))
        except CorruptData as e:
            raise CorruptData(f"{self.name}: {e}") from None

    def read_chunk(self, entry: PackEntry, dctx: zstandard.ZstdDecompressor | None = None) -> bytes:
        """Plaintext of one entry, checked against its BLAKE3 id."""
        data = decode_payload(self.read_range(entry.offset, entry.length), entry, dctx)
        if blake3.blake3(data).digest() != entry.chunk:
            raise CorruptData(f"chunk {entry.chunk.hex()} in {self.name} at offset {entry.offset}: "
                              "content does not match its id")
        return data


def parse_pack(data: bytes) -> list[PackEntry]:
    """Check a whole pack held in memory: header, trailer (not payloads)."""
    decode_header(data[:HEADER_SIZE])
    return read_trailer(lambda off, n: data[off:off + n], len(data))


def decode_payload(payload: bytes | memoryview, entry: PackEntry,
                   dctx: zstandard.ZstdDecompressor | None = None) -> bytes:
    """Plaintext of one chunk's payload (a slice of a larger range read may come as a
    memoryview: only a stored-as-is payload is copied out of it). Raises CorruptData on
    a bad frame or wrong length; the caller checks the BLAKE3 id."""
    if len(payload) != entry.length:
        raise CorruptData(f"chunk {entry.chunk.hex()}: payload has {len(payload)} bytes, expected {entry.length}")
    if entry.length == entry.raw_length:
        return bytes(payload)
    try:
        # The frame header declares its content size and zstandard allocates that much:
        # check it first, or a damaged header could ask for exabytes.
        declared = zstandard.frame_content_size(payload)
        if declared not in (-1, entry.raw_length):
            raise CorruptData(f"chunk {entry.chunk.hex()}: zstd frame declares {declared} bytes, "
                              f"expected {entry.raw_length}")
        out = (dctx or zstandard.ZstdDecompressor()).decompress(payload, max_output_size=entry.raw_length)
    except zstandard.ZstdError as e:
        raise CorruptData(f"chunk {entry.chunk.hex()}: bad zstd frame: {e}") from None
    if len(out) != entry.raw_length:
        raise CorruptData(f"chunk {entry.chunk.hex()}: decompressed to {len(out)} bytes, expected {entry.raw_length}")
    return out


def encode_payload(data: bytes | memoryview, cctx: zstandard.ZstdCompressor) -> bytes | memoryview:
    """zstd frame, or the plaintext itself when compression does not shrink it."""
    frame = cctx.compress(data)
    return frame if len(frame) < len(data) else data


class PackWriter:
    """Writes one pack sequentially to a local file, hashing as it goes.

    Payloads are written unbuffered (os.write) so a chunk added earlier can be
    read back with ``read_payload`` while the pack is still open."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._hasher = blake3.blake3()
        self.entries: list[PackEntry] = []
        self.size = 0
        self._ids: set[bytes] = set()
        self._write(encode_header())
        self.closed = False

    def _write(self, data: bytes | memoryview) -> None:
        write_all(self._fd, data)
        self._hasher.update(data)
        self.size += len(data)

    @property
    def payload_bytes(self) -> int:
        return self.size - HEADER_SIZE

    def __contains__(self, chunk: bytes) -> bool:
        return chunk in self._ids

    def add(self, chunk: Digest, payload: bytes | memoryview, raw_length: int) -> PackEntry:
        if self.closed:
            raise ValueError("pack is closed")
        if chunk in self._ids:
            raise ValueError(f"chunk {chunk.hex()} already in this pack")
        length = len(payload)
        if not 0 < length <= raw_length <= MAX_RAW_LENGTH:
            raise ValueError(f"bad payload lengths {length}/{raw_length}")
        entry = PackEntry(chunk, self.size, length, raw_length)
        self._write(payload)
        self.entries.append(entry)
        self._ids.add(chunk)
        return entry

    def read_payload(self, entry: PackEntry) -> bytes:
        return os.pread(self._fd, entry.length, entry.offset)

    def finish(self) -> Digest:
        """Write the trailer, close the file; return the pack id. Needs >= 1 entry."""
        if not self.entries:
            raise ValueError("empty pack")
        self._write(encode_trailer(self.entries, self.size))
        os.close(self._fd)
        self.closed = True
        return Digest(self._hasher.digest())

    def discard(self) -> None:
        if not self.closed:
            os.close(self._fd)
            self.closed = True
        self.path.unlink(missing_ok=True)


__all__ = ["PackEntry", "PackWriter", "PackReader", "read_trailer", "parse_pack", "decode_payload", "encode_payload",
           "encode_trailer", "decode_footer", "decode_table", "DIGEST_SIZE"]
