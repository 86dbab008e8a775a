"""The migration stream reader against a reference encoder, fuzzed with hypothesis."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from aenv_vm.qemu import migration_stream as ms

PAGE = ms.PAGE_SIZE


def _name(s: str) -> bytes:
    return bytes([len(s)]) + s.encode()


def encode(blocks: dict[str, int], records: list[list[tuple[str, int, bytes | None]]], devices: bytes,
           ignore_shared: bool, config: bool = True) -> bytes:
    """A stream as QEMU 7.2 writes it: header, config, ram START (block list), one
    PART per list of records (block, offset, page bytes or None = zero page), END, devices."""
    out = bytearray(struct.pack(">II", ms.MAGIC, ms.VERSION))
    if config:
        out += bytes([ms.CONFIG]) + struct.pack(">I", 7) + b"microvm"
        caps = ["x-ignore-shared"] if ignore_shared else []
        out += bytes([ms.SUBSECTION]) + _name("configuration/capabilities") + struct.pack(">II", 1, len(caps))
        out += b"".join(_name(c) for c in caps)
    sid = 2
    out += bytes([ms.START]) + struct.pack(">I", sid) + _name("ram") + struct.pack(">II", 0, 4)
    out += struct.pack(">Q", sum(blocks.values()) | ms.F_MEM_SIZE)
    for name, size in blocks.items():
        out += _name(name) + struct.pack(">Q", size)
        if ignore_shared:
            out += struct.pack(">Q", 0x1000000)
    out += struct.pack(">Q", ms.F_EOS) + bytes([ms.FOOTER]) + struct.pack(">I", sid)
    prev = None  # as QEMU: CONTINUE refers to the last block sent, across parts
    for i, part in enumerate(records):
        out += bytes([ms.PART if i < len(records) - 1 else ms.END]) + struct.pack(">I", sid)
        for block, off, data in part:
            flags = ms.F_PAGE if data is not None else ms.F_ZERO
            if block == prev:
                flags |= ms.F_CONTINUE
            out += struct.pack(">Q", off | flags)
            if block != prev:
                out += _name(block)
            out += data if data is not None else b"\0"
            prev = block
        out += struct.pack(">Q", ms.F_EOS) + bytes([ms.FOOTER]) + struct.pack(">I", sid)
    return bytes(out + devices)


DEVICES = (bytes([ms.FULL]) + struct.pack(">I", 3) + _name("timer") + struct.pack(">II", 0, 2) + b"\x01\x02"
           + bytes([ms.FOOTER]) + struct.pack(">I", 3) + b"\x00")

blocks_st = st.dictionaries(st.sampled_from(["mem0", "pc.bios", "microvm.rom"]),
                            st.integers(1, 16).map(lambda n: n * PAGE), min_size=1)


@st.composite
def stream_case(draw):  # type: ignore[no-untyped-def]
    blocks = draw(blocks_st)
    names = sorted(blocks)
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        recs = []
        for _ in range(draw(st.integers(0, 20))):
            b = draw(st.sampled_from(names))
            off = draw(st.integers(0, blocks[b] // PAGE - 1)) * PAGE
            if draw(st.booleans()):
                recs.append((b, off, bytes([draw(st.integers(0, 255))]) * PAGE))
            else:
                recs.append((b, off, None))
        parts.append(recs)
    return blocks, parts, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(stream_case())
def test_split_matches_reference(case) -> None:  # type: ignore[no-untyped-def]
    blocks, parts, ignore_shared = case
    data = encode(blocks, parts, DEVICES, ignore_shared)
    got = ms.split(data)
    assert got.ram_sizes == blocks
    assert got.devices == DEVICES
    expect_pages: dict[str, dict[int, bytes]] = {}
    expect_zero: dict[str, set[int]] = {}
    for part in parts:
        for b, off, page in part:
            if page is None:
                expect_zero.setdefault(b, set()).add(off)
            else:
                expect_pages.setdefault(b, {})[off] = page
    for name in blocks:
        bp = got.blocks.get(name, ms.BlockPages(name))
        offs, pages = bp.pages()
        assert dict(zip(offs.tolist(), (p.tobytes() for p in pages))) == expect_pages.get(name, {})
        assert set(bp.zeros().tolist()) == expect_zero.get(name, set())
    # the stripped stream is a valid stream with no pages left and the same devices
    again = ms.split(got.stripped())
    assert all(len(bp.pages()[0]) == 0 and len(bp.zeros()) == 0 for bp in again.blocks.values())
    assert again.devices == DEVICES and again.ram_sizes == blocks


# the first device section's header (type, id, name, instance, version): the reader looks
# at it to see that ram has ended; the rest of the device sections it copies as they are
DEVICE_HEADER = 1 + 4 + 1 + len("timer") + 4 + 4


def payload_spans(blocks: dict[str, int], parts: list[list[tuple[str, int, bytes | None]]],
                  ignore_shared: bool) -> tuple[list[tuple[int, int, str, int]], int]:
    """Where ``encode`` put the bytes a reader passes on without interpreting them: each
    data page's 4096 bytes as ``(start, end, block, offset)``, and where the device
    sections begin (everything after is copied as it is)."""
    pos = len(encode(blocks, [], b"", ignore_shared))     # header, config, the START section
    spans = []
    prev = None
    for part in parts:
        pos += 5                                    # PART/END + section id
        for block, off, data in part:
            pos += 8 + (0 if block == prev else 1 + len(block))
            if data is not None:
                spans.append((pos, pos + PAGE, block, off))
                pos += PAGE
            else:
                pos += 1
            prev = block
        pos += 8 + 5                                # EOS + footer
    return spans, pos


def test_payload_spans_match_the_encoder() -> None:
    """The helper's idea of the layout is the encoder's (else the test below proves nothing)."""
    blocks = {"mem0": 4 * PAGE, "pc.bios": PAGE}
    parts = [[("mem0", 0, b"\x11" * PAGE), ("mem0", PAGE, None), ("pc.bios", 0, b"\x22" * PAGE)],
             [("mem0", 3 * PAGE, b"\x33" * PAGE)]]
    for ignore_shared in (False, True):
        raw = encode(blocks, parts, DEVICES, ignore_shared)
        spans, devices_at = payload_spans(blocks, parts, ignore_shared)
        assert [raw[s:e] for s, e, _, _ in spans] == [b"\x11" * PAGE, b"\x22" * PAGE, b"\x33" * PAGE]
        assert raw[devices_at:] == DEVICES


@settings(max_examples=200, deadline=None)
@given(stream_case(), st.data())
def test_corrupt_streams_raise_stream_error(case, data) -> None:  # type: ignore[no-untyped-def]
    """A damaged stream either fails with StreamError or is read faithfully: a byte
    flipped in a page or in the device sections (bytes the reader passes on) shows up
    in exactly that page or in the devices, and a stream cut inside the device sections
    keeps what is left of them. Anything else (a flip in the structure the reader
    interprets, a cut before the devices) must raise, unless the flip leaves a stream
    that still reads as one (an address moved to another page of its block, a field the
    reader skips): then that stream's pages and devices are what it says, and its
    stripped form reads back."""
    blocks, parts, ignore_shared = case
    raw = bytearray(encode(blocks, parts, DEVICES, ignore_shared))
    spans, devices_at = payload_spans(blocks, parts, ignore_shared)
    cut = data.draw(st.booleans())
    if cut:
        at = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:at]
    else:
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    try:
        got = ms.split(bytes(raw))
    except ms.StreamError:
        assert cut or not (at >= devices_at + DEVICE_HEADER or any(s <= at < e for s, e, _, _ in spans)), \
            f"a flip in bytes the reader passes on (offset {at}) was refused"
        return
    if cut:
        assert at > devices_at, f"a stream cut at {at}, before its devices at {devices_at}, was accepted"
        assert got.devices == DEVICES[:at - devices_at]
        return
    if at >= devices_at + DEVICE_HEADER:
        assert got.devices == bytes(raw[devices_at:]) and got.devices != DEVICES
        return
    hit = [(s, block, off) for s, e, block, off in spans if s <= at < e]
    if hit:
        s, block, off = hit[0]
        offs, pages = got.blocks[block].pages()
        seen = dict(zip(offs.tolist(), (p.tobytes() for p in pages)))
        # the last copy of a page wins: the damaged one must be what the reader kept,
        # unless a later record of the same page replaced it
        later = [x for x in spans if x[2] == block and x[3] == off and x[0] > s]
        assert seen[off] == (bytes(raw[later[-1][0]:later[-1][0] + PAGE]) if later else bytes(raw[s:s + PAGE]))
        assert got.devices == DEVICES
        return
    # a flip in the structure that still parses: what was read is self-consistent
    again = ms.split(got.stripped())
    assert again.devices == got.devices and again.ram_sizes == got.ram_sizes
    for name, bp in got.blocks.items():
        offs, _ = bp.pages()
        assert all(0 <= o < got.ram_sizes[name] for o in offs.tolist())


def test_long_runs_are_vectorised() -> None:
    """64k pages in runs of 50 (data/zero alternating, as a guest's RAM looks) parse
    without a per-page Python loop."""
    import time
    n = 65536
    blocks = {"mem0": n * PAGE}
    page = bytes(range(256)) * 16
    recs = [("mem0", i * PAGE, page if (i // 50) % 2 else None) for i in range(n)]
    data = encode(blocks, [recs], DEVICES, True)
    t0 = time.perf_counter()
    got = ms.split(data)
    took = time.perf_counter() - t0
    offs, pages = got.blocks["mem0"].pages()
    zeros = sum(1 for i in range(n) if not (i // 50) % 2)
    assert len(offs) == n - zeros and len(got.blocks["mem0"].zeros()) == zeros
    assert took < 0.5, f"split took {took:.2f} s for {n} pages"


def test_device_state_stream_inserts_config() -> None:
    cfg = ms.config_section(encode({"mem0": PAGE}, [[]], DEVICES, True))
    xen = struct.pack(">II", ms.MAGIC, ms.VERSION) + DEVICES
    out = ms.device_state_stream(xen, cfg)
    assert out[:8] == xen[:8] and out[8:8 + len(cfg)] == cfg and out.endswith(DEVICES)
    with pytest.raises(ms.StreamError, match="bad magic"):
        ms.split(b"XXXX" + out[4:])
    assert np.array_equal(ms.split(out).blocks.get("mem0", ms.BlockPages("mem0")).zeros(), np.zeros(0))


def test_drop_section_removes_one_device() -> None:
    slirp = (bytes([ms.FULL]) + struct.pack(">I", 9) + _name("slirp") + struct.pack(">II", 0, 4)
             + b"\x2a\x7e\x00\x00\x00\x09\xff" + b"\x00" * 20 + bytes([ms.FOOTER]) + struct.pack(">I", 9))
    with_slirp = encode({"mem0": PAGE}, [[]], slirp + DEVICES, True)
    without = ms.drop_section(with_slirp, "slirp")
    assert without == encode({"mem0": PAGE}, [[]], DEVICES, True)
    assert ms.drop_section(without, "slirp") == without
    assert ms.split(without).devices == DEVICES


def test_a_page_address_past_int64_is_a_stream_error() -> None:
    """A damaged header whose top address bit is set (found by the corruption test: it
    raised OverflowError from numpy instead of StreamError)."""
    blocks = {"mem0": 4 * PAGE}
    raw = bytearray(encode(blocks, [[("mem0", PAGE, b"\x11" * PAGE)]], DEVICES, False))
    spans, _ = payload_spans(blocks, [[("mem0", PAGE, b"\x11" * PAGE)]], False)
    header = spans[0][0] - 8 - 1 - len("mem0")
    raw[header] ^= 0x80
    with pytest.raises(ms.StreamError, match="outside RAM block"):
        ms.split(bytes(raw))
