"""The streamed Connect decoder (aenv_vm/envd_stream.py): every split of a valid stream
decodes as the whole does, and no length a guest writes makes it hold more than one
bounded frame."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.envd_client import decode_envelopes, encode_envelope
from aenv_vm.envd_stream import FRAME_HEADER, MAX_CHUNK_LINE, MAX_FRAME, ConnectStream, StreamError

messages = st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=40) | st.booleans(), max_size=4)


def chunk(body: bytes, sizes: list[int]) -> bytes:
    out, pos = b"", 0
    for n in sizes:
        if pos >= len(body):
            break
        piece = body[pos:pos + n]
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        pos += len(piece)
    if pos < len(body):
        out += f"{len(body) - pos:x};ext=1\r\n".encode() + body[pos:] + b"\r\n"
    return out + b"0\r\nTrailer: x\r\n\r\n"


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    marks = sorted({p % (len(data) + 1) for p in points})
    out, last = [], 0
    for m in marks + [len(data)]:
        out.append(data[last:m])
        last = m
    return [p for p in out if p]


def decode(stream: ConnectStream, pieces: list[bytes]) -> list[tuple[int, dict]]:
    out = []
    for p in pieces:
        out += stream.feed(p)
    if not stream.chunked:
        stream.finish()
    return out


@settings(deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 2]), messages), max_size=8),
       st.lists(st.integers(0, 5000), max_size=10), st.lists(st.integers(1, 300), max_size=8), st.booleans())
def test_any_split_decodes_as_the_whole(frames: list[tuple[int, dict]], points: list[int], sizes: list[int],
                                        chunked: bool) -> None:
    body = b"".join(encode_envelope(m, f) for f, m in frames)
    wire = chunk(body, sizes) if chunked else body
    stream = ConnectStream(chunked)
    assert decode(stream, cuts(wire, points)) == frames == decode_envelopes(body)
    assert stream.done == chunked and stream.buffered == 0
    stream.finish()


@settings(deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(16, 4096), st.binary(max_size=300), st.booleans(),
       st.lists(st.integers(0, 400), max_size=6))
def test_no_length_makes_it_hold_more_than_a_frame(length: int, max_frame: int, junk: bytes, chunked: bool,
                                                   points: list[int]) -> None:
    """Adversarial lengths: a frame header naming any u32 length, then anything. Either
    the frame is within the bound, or the header alone is refused; whatever comes, only
    StreamError is raised and the bytes held stay within one frame and one piece."""
    body = struct.pack(">BI", 0, length) + junk
    wire = (b"%x\r\n" % len(body) + body + b"\r\n") if chunked else body
    stream = ConnectStream(chunked, max_frame=max_frame)
    refused: StreamError | None = None
    try:
        for piece in cuts(wire, points):
            stream.feed(piece)
            assert stream.buffered <= FRAME_HEADER + max_frame + len(piece)
        stream.finish()
    except StreamError as e:
        refused = e
    if length > max_frame:
        assert refused is not None and f"Connect frame of {length} bytes" in str(refused)


def test_an_oversized_frame_is_refused_from_its_header() -> None:
    for chunked in (False, True):
        stream = ConnectStream(chunked)
        header = struct.pack(">BI", 0, MAX_FRAME + 1)
        with pytest.raises(StreamError, match=f"frame of {MAX_FRAME + 1} bytes"):
            stream.feed(b"%x\r\n" % (1 << 60) + header if chunked else header)
    ok = ConnectStream(False)
    assert ok.feed(struct.pack(">BI", 0, MAX_FRAME)) == [] and ok.buffered == FRAME_HEADER


def test_a_huge_chunk_costs_only_what_arrives() -> None:
    """A chunk announcing 2^64-1 bytes: its payload passes through as it comes."""
    stream = ConnectStream(True)
    frame = encode_envelope({"event": {"keepalive": {}}})
    assert stream.feed(b"ffffffffffffffff\r\n" + frame * 3) == [(0, {"event": {"keepalive": {}}})] * 3
    assert stream.buffered == 0 and not stream.done
    with pytest.raises(StreamError, match="inside its chunked framing"):
        stream.finish()


def test_malformed_streams() -> None:
    cases = [(True, b"zz\r\n", "bad chunk size"), (True, b"1" * 17 + b"\r\n", "bad chunk size"),
             (True, b"1" * (MAX_CHUNK_LINE + 1), "line over"), (True, b"1\r\n{xx", "not followed by CRLF"),
             (False, b"\x00\x00\x00\x00\x02{[", "bad JSON"),
             (True, b"5\r\n\x00\x00\x00\x00\x09\r\n0\r\n\r\n", "inside a frame"),
             (True, b"0\r\n\r\nmore", "after the end")]
    for chunked, wire, message in cases:
        with pytest.raises(StreamError, match=message):
            ConnectStream(chunked).feed(wire)
    stream = ConnectStream(False)
    stream.feed(b"\x00\x00\x00")
    with pytest.raises(StreamError, match="inside a frame"):
        stream.finish()
