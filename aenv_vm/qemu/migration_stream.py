"""A sans-IO reader of QEMU 7.2's migration stream that separates RAM from device state.

Layout (QEMU's migration/savevm.c and migration/ram.c; scripts/analyze-migration.py):

    be32 magic "QEVM", be32 version 3
    [0x07 configuration: be32 len, machine name, subsections 0x05 ...]
    sections: u8 type, then
      START 0x01 / FULL 0x04: be32 section id, u8 len + id string, be32 instance, be32 version
      PART 0x02 / END 0x03:   be32 section id
      content, then footer 0x7e + be32 section id
    0x00 EOF, optionally 0x06 + be32 len + JSON description

The ``ram`` section's content is a sequence of ``be64 addr|flags`` records:
MEM_SIZE 0x04 (START only: the RAM block list), ZERO 0x02 + 1 byte, PAGE 0x08 +
4096 bytes, CONTINUE 0x20 (same block as the previous record, else u8 len +
block name follows the header), EOS 0x10 ends the part. Device sections are not
length-prefixed, so everything from the first non-ram section on is copied as
it is (QEMU writes every ram part before any device section).

``split(stream)`` returns the device state without RAM pages (a stream that
loads into a VM whose RAM already holds the pages) and the pages themselves.
Page records are parsed in vectorised runs: a run of CONTINUE|PAGE (or
CONTINUE|ZERO) records has a fixed stride, so numpy checks the headers of a
whole run at once and Python only touches the few records where the pattern
changes. ``device_state_stream`` builds a loadable stream from QEMU's
``xen-save-devices-state`` output (device sections only) by putting a header
and a configuration section in front.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

MAGIC = 0x5145564D
VERSION = 3
EOF, START, PART, END, FULL, SUBSECTION, VMDESC, CONFIG = 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07
FOOTER = 0x7E

F_ZERO, F_MEM_SIZE, F_PAGE, F_EOS, F_CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
PAGE_SIZE = 4096
_FLAG_MASK = PAGE_SIZE - 1
_PAGE_REC = 8 + PAGE_SIZE
_ZERO_REC = 9
# configuration subsections QEMU 7.2 may send, with their fixed-size payload readers
_CONFIG_SUBSECTIONS = ("configuration/capabilities", "configuration/uuid", "configuration/target-page-bits")


class StreamError(ValueError):
    """The bytes are not a QEMU 7.2 migration stream this reader understands."""


@dataclass
class BlockPages:
    """Pages of one RAM block found in a stream: offsets in the block (ascending
    in stream order, may repeat if QEMU resent a page: the last one wins)."""
    name: str
    offsets: list[np.ndarray] = field(default_factory=list)     # int64 byte offsets of data pages
    data: list[np.ndarray] = field(default_factory=list)        # uint8 (n, 4096) views into the stream
    zero_offsets: list[np.ndarray] = field(default_factory=list)

    def pages(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, data) of data pages, deduplicated (last record wins). Copies the
        page bytes once; ``runs()`` gives them without copying."""
        if not self.offsets:
            return np.zeros(0, np.int64), np.zeros((0, PAGE_SIZE), np.uint8)
        off = np.concatenate(self.offsets)
        data = np.concatenate(self.data) if len(self.data) > 1 else self.data[0]
        if len(np.unique(off)) == len(off):   # a stopped VM sends each page once
            return off, data
        _, last = np.unique(off[::-1], return_index=True)
        keep = np.sort(len(off) - 1 - last)
        return off[keep], data[keep]

    def runs(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(offsets, page rows) pieces in stream order, as views into the stream (no copy)."""
        return _flatten_runs(self.offsets, self.data)

    def zeros(self) -> np.ndarray:
        return np.unique(np.concatenate(self.zero_offsets)) if self.zero_offsets else np.zeros(0, np.int64)


def _flatten_runs(offsets: list[np.ndarray], data: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pair each run's offsets with its page rows: a run stored its first page and
    (when longer than one) the rest as two data entries."""
    out = []
    di = 0
    for offs in offsets:
        out.append((offs[:1], data[di]))
        di += 1
        if len(offs) > 1:
            out.append((offs[1:], data[di]))
            di += 1
    return out


@dataclass
class Split:
    header: bytes               # magic + version
    config: bytes               # the configuration section (empty if the stream has none)
    ram_start: bytes            # the ram START section (block list), kept as it is
    ram_end_id: int | None      # section id of ram, for an empty END section
    devices: bytes              # from the first non-ram section to the end
    blocks: dict[str, BlockPages]
    ram_sizes: dict[str, int]

    def stripped(self) -> bytes:
        """The stream without any RAM page: loads into a VM whose RAM already holds them."""
        end = b""
        if self.ram_end_id is not None:
            sid = struct.pack(">I", self.ram_end_id)
            end = bytes([END]) + sid + struct.pack(">Q", F_EOS) + bytes([FOOTER]) + sid
        return self.header + self.config + self.ram_start + end + self.devices


class _Reader:
    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.mv = memoryview(buf).cast("B")
        self.arr = np.frombuffer(self.mv, dtype=np.uint8)
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > len(self.mv):
            raise StreamError(f"truncated stream: need {n} bytes at offset {self.pos}, have {len(self.mv) - self.pos}")

    def u8(self) -> int:
        self.need(1)
        v = self.mv[self.pos]
        self.pos += 1
        return v

    def peek(self) -> int:
        self.need(1)
        return self.mv[self.pos]

    def be32(self) -> int:
        self.need(4)
        v = struct.unpack_from(">I", self.mv, self.pos)[0]
        self.pos += 4
        return int(v)

    def be64(self) -> int:
        self.need(8)
        v = struct.unpack_from(">Q", self.mv, self.pos)[0]
        self.pos += 8
        return int(v)

    def take(self, n: int) -> memoryview:
        self.need(n)
        v = self.mv[self.pos:self.pos + n]
        self.pos += n
        return v

    def name(self) -> str:
        n = self.u8()
        try:
            return bytes(self.take(n)).decode("ascii")
        except UnicodeDecodeError:
            raise StreamError(f"non-ASCII name at offset {self.pos - n}") from None


def _read_header(r: _Reader) -> None:
    if r.be32() != MAGIC:
        raise StreamError("not a QEMU migration stream (bad magic)")
    v = r.be32()
    if v != VERSION:
        raise StreamError(f"migration stream version {v}, expected {VERSION}")


def _read_config(r: _Reader) -> list[str]:
    """Read a configuration section (the reader is on its 0x07 byte); returns the
    migration capabilities it announces."""
    caps: list[str] = []
    r.u8()
    r.take(r.be32())
    while r.pos < len(r.mv) and r.peek() == SUBSECTION:
        r.u8()
        name = r.name()
        r.be32()  # version
        if name == "configuration/capabilities":
            for _ in range(r.be32()):
                caps.append(r.name())
        elif name == "configuration/uuid":
            r.take(16)
        elif name == "configuration/target-page-bits":
            r.be32()
        else:
            raise StreamError(f"unknown configuration subsection {name!r} (known: {', '.join(_CONFIG_SUBSECTIONS)})")
    return caps


def _footer(r: _Reader, sid: int) -> None:
    if r.u8() != FOOTER:
        raise StreamError(f"missing section footer at offset {r.pos - 1}")
    if r.be32() != sid:
        raise StreamError(f"section footer for the wrong section at offset {r.pos - 4}")


def _take_run(r: _Reader, block: BlockPages, sizes: dict[str, int], addr: int, first: np.ndarray | None,
              stride: int, want: int) -> None:
    """Record one page (already consumed) plus every following record of the same
    kind and stride, in one numpy step."""
    # the first address is checked before numpy sees it: one of 2**63 or more (a damaged
    # header) does not fit an int64 and would raise OverflowError, not StreamError
    if addr + PAGE_SIZE > sizes[block.name]:
        raise StreamError(f"page offset outside RAM block {block.name!r} ({sizes[block.name]} bytes)")
    n = _run_length(r, stride, want)
    recs = np.lib.stride_tricks.as_strided(r.arr[r.pos:], shape=(n, stride), strides=(stride, 1))
    offs = np.concatenate((np.array([addr], np.int64), _addrs(recs[:, :8])))
    _check_block(block, sizes, offs)
    if first is None:
        block.zero_offsets.append(offs)
    else:
        block.offsets.append(offs)
        block.data.append(first)
        if n:
            block.data.append(recs[:, 8:])
    r.pos += n * stride


def _run_length(r: _Reader, stride: int, want: int) -> int:
    """How many records of ``stride`` bytes starting at r.pos have flags == ``want``
    (vectorised over the header bytes; the page bytes are never looked at). Windows
    grow 8× so a stream that alternates record kinds stays linear."""
    avail = (len(r.mv) - r.pos) // stride
    done, window = 0, 64
    while done < avail:
        k = min(window, avail - done)
        base = r.pos + done * stride
        heads = np.lib.stride_tricks.as_strided(r.arr[base:], shape=(k, 8), strides=(stride, 1))
        # The flags are the low 12 bits of each big-endian be64 header: bytes 6..7.
        flags = ((heads[:, 6].astype(np.uint16) << 8) | heads[:, 7]) & _FLAG_MASK
        bad = np.flatnonzero(flags != want)
        if len(bad):
            return done + int(bad[0])
        done += k
        window *= 8
    return done


def _ram_records(r: _Reader, blocks: dict[str, BlockPages], sizes: dict[str, int], first: bool,
                 ignore_shared: bool, last: list[BlockPages | None]) -> None:
    """One ram part, up to and including its EOS record. ``last[0]`` is the block
    of the previous page record: CONTINUE refers to it across parts (QEMU's
    loader keeps it per channel, not per section)."""
    block = last[0]
    while True:
        head = r.be64()
        flags, addr = head & _FLAG_MASK, head & ~_FLAG_MASK
        if flags & F_MEM_SIZE:
            if not first:
                raise StreamError("RAM block list outside the ram START section")
            total = addr
            seen = 0
            while seen < total:
                name = r.name()
                used = r.be64()
                sizes[name] = used
                seen += used
                if ignore_shared:  # the source then also sends each block's guest address
                    r.be64()
            if seen != total:
                raise StreamError(f"RAM block list sums to {seen} bytes, header says {total}")
            continue
        if flags & F_EOS:
            if flags != F_EOS:
                raise StreamError(f"EOS record with extra flags {flags:#x}")
            last[0] = block
            return
        if not flags & F_CONTINUE:
            name = r.name()
            if name not in sizes:
                raise StreamError(f"page of unknown RAM block {name!r}")
            block = blocks.setdefault(name, BlockPages(name))
        elif block is None:
            raise StreamError("CONTINUE record before any block was named")
        kind = flags & ~F_CONTINUE
        if kind == F_PAGE:
            r.need(PAGE_SIZE)
            first = r.arr[r.pos:r.pos + PAGE_SIZE].reshape(1, PAGE_SIZE)
            r.pos += PAGE_SIZE
            _take_run(r, block, sizes, addr, first, _PAGE_REC, F_CONTINUE | F_PAGE)
        elif kind == F_ZERO:
            r.u8()
            _take_run(r, block, sizes, addr, None, _ZERO_REC, F_CONTINUE | F_ZERO)
        else:
            raise StreamError(f"unsupported RAM record flags {flags:#x} (compression/xbzrle/RDMA are not used by aenv)")


def _addrs(heads: np.ndarray) -> np.ndarray:
    """be64 record headers (n, 8) → page addresses (flags masked off)."""
    be = np.ascontiguousarray(heads).view(">u8").reshape(-1)
    return (be & np.uint64(~_FLAG_MASK & 0xFFFFFFFFFFFFFFFF)).astype(np.int64)


def _check_block(block: BlockPages, sizes: dict[str, int], offs: np.ndarray) -> None:
    if len(offs) and (int(offs.min()) < 0 or int(offs.max()) + PAGE_SIZE > sizes[block.name]):
        raise StreamError(f"page offset outside RAM block {block.name!r} ({sizes[block.name]} bytes)")


def split(stream: bytes | bytearray | memoryview, ignore_shared: bool | None = None) -> Split:
    """Separate a complete migration stream into device state and RAM pages.

    ``ignore_shared``: whether the source had x-ignore-shared on (the RAM block
    list then carries addresses); None takes it from the configuration section."""
    r = _Reader(stream)
    _read_header(r)
    header = bytes(r.mv[:8])
    config = b""
    caps: list[str] = []
    if r.pos < len(r.mv) and r.peek() == CONFIG:
        c0 = r.pos
        caps = _read_config(r)
        config = bytes(r.mv[c0:r.pos])
    if ignore_shared is None:
        ignore_shared = "x-ignore-shared" in caps
    blocks: dict[str, BlockPages] = {}
    sizes: dict[str, int] = {}
    ram_id: int | None = None
    ram_start = b""
    ram_end_id: int | None = None
    last: list[BlockPages | None] = [None]
    while True:
        s0 = r.pos
        kind = r.u8()
        if kind in (START, FULL):
            sid = r.be32()
            idstr = r.name()
            r.be32()
            r.be32()
            if idstr != "ram":
                r.pos = s0
                break
            if kind == FULL:
                raise StreamError("ram sent as a FULL section")
            ram_id = sid
            _ram_records(r, blocks, sizes, True, ignore_shared, last)
            _footer(r, sid)
            ram_start = bytes(r.mv[s0:r.pos])
        elif kind in (PART, END):
            sid = r.be32()
            if sid != ram_id:
                raise StreamError(f"iterative section {sid} that is not ram (only ram is supported)")
            _ram_records(r, blocks, sizes, False, ignore_shared, last)
            _footer(r, sid)
            if kind == END:
                ram_end_id = sid
        elif kind == EOF:
            r.pos = s0
            break
        else:
            raise StreamError(f"unexpected section type {kind:#x} at offset {s0}")
    return Split(header, config, ram_start, ram_end_id, bytes(r.mv[r.pos:]), blocks, sizes)


def config_section(stream: bytes | bytearray | memoryview) -> bytes:
    """The configuration section of a stream (e.g. a template's device state)."""
    r = _Reader(stream)
    _read_header(r)
    if r.pos >= len(r.mv) or r.peek() != CONFIG:
        raise StreamError("stream has no configuration section")
    c0 = r.pos
    _read_config(r)
    return bytes(r.mv[c0:r.pos])


def device_state_stream(devices_only: bytes, config: bytes) -> bytes:
    """A loadable stream from ``xen-save-devices-state`` output (header + device
    sections + EOF, no configuration section, no RAM) and a configuration section."""
    r = _Reader(devices_only)
    _read_header(r)
    if r.pos < len(r.mv) and r.peek() == CONFIG:
        return bytes(devices_only)
    return bytes(devices_only[:8]) + config + bytes(devices_only[8:])


def _plausible_section_start(mv: memoryview, pos: int) -> bool:
    """Whether a device section header (or EOF) starts at ``pos``."""
    if pos >= len(mv):
        return False
    kind = mv[pos]
    if kind == EOF:
        return True
    if kind not in (FULL, START) or pos + 6 > len(mv):
        return False
    n = mv[pos + 5]
    name = bytes(mv[pos + 6:pos + 6 + n])
    return 0 < n == len(name) and all(0x20 < c < 0x7F for c in name) and pos + 6 + n + 8 <= len(mv)


def drop_section(stream: bytes | bytearray | memoryview, idstr: str) -> bytes:
    """The stream without the FULL device section named ``idstr`` (e.g. ``slirp``,
    the user-mode network backend's state, which a VM on a tap device has no
    place for). Device sections are not length-prefixed: the section ends at its
    footer (0x7e + be32 section id) that is followed by another section header
    or EOF. Returns the stream unchanged if there is no such section."""
    mv = memoryview(stream).cast("B")
    raw = bytes(mv)
    name = idstr.encode()
    head_tail = bytes([len(name)]) + name
    pos = 0
    while True:
        pos = raw.find(head_tail, pos)
        if pos < 0:
            return raw
        start = pos - 5
        if start >= 0 and raw[start] == FULL:
            break
        pos += 1
    sid = raw[start + 1:start + 5]
    footer = bytes([FOOTER]) + sid
    search = start + 5 + len(head_tail) + 8
    while True:
        end = raw.find(footer, search)
        if end < 0:
            raise StreamError(f"no footer found for section {idstr!r}")
        if _plausible_section_start(mv, end + 5):
            return raw[:start] + raw[end + 5:]
        search = end + 1
