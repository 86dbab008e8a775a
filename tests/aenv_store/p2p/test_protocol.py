"""The chunk protocol's framing, as plain bytes (no sockets)."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_store.formats.ids import Digest
from aenv_store.p2p.protocol import (MAX_IDS, BadData, GetResponseParser, Op, ProtocolError, Request, Status,
                                     decode_have, decode_request, encode_frame, encode_have, encode_request)

digests = st.binary(min_size=32, max_size=32).map(Digest)


@given(op=st.sampled_from(Op), ids=st.lists(digests, min_size=1, max_size=50))
def test_request_round_trip(op: Op, ids: list[Digest]) -> None:
    assert decode_request(encode_request(op, ids)) == Request(op, tuple(ids))


@given(data=st.binary(max_size=200))
def test_garbage_requests_are_protocol_errors(data: bytes) -> None:
    try:
        req = decode_request(data)
    except ProtocolError:
        return
    assert encode_request(req.op, req.ids) == data  # only well-formed requests decode


def test_request_limits() -> None:
    with pytest.raises(ValueError):
        encode_request(Op.GET, [])
    with pytest.raises(ValueError):
        encode_request(Op.GET, [Digest(bytes(32))] * (MAX_IDS + 1))
    good = encode_request(Op.GET, [Digest(bytes(32))])
    for bad in (b"XXXX" + good[4:], good[:4] + b"\x09" + good[5:], good[:-1], good + b"\x00",
                good[:5] + b"\x01" + good[6:]):
        with pytest.raises(ProtocolError):
            decode_request(bad)


@settings(max_examples=60)
@given(chunks=st.lists(st.one_of(st.none(), st.binary(min_size=0, max_size=3000)), min_size=1, max_size=12),
       cuts=st.lists(st.integers(1, 4000), max_size=20))
def test_response_parser_any_split(chunks: list[bytes | None], cuts: list[int]) -> None:
    ids = [Digest.of(c) if c is not None else Digest.of(os.urandom(8)) for c in chunks]
    wire = b"".join(encode_frame(Status.OK, c) if c is not None else encode_frame(Status.MISSING) for c in chunks)
    parser = GetResponseParser(ids)
    frames = []
    pos = 0
    for cut in cuts:
        frames += parser.feed(wire[pos:pos + cut])
        pos += cut
    frames += parser.feed(wire[pos:])
    parser.finish()
    assert [f.chunk for f in frames] == ids
    for f, c in zip(frames, chunks):
        assert (f.status, f.data) == ((Status.OK, c) if c is not None else (Status.MISSING, b""))


def test_response_with_wrong_bytes_is_bad_data() -> None:
    good, evil = b"a" * 100, b"b" * 100
    parser = GetResponseParser([Digest.of(good)])
    with pytest.raises(BadData):
        parser.feed(encode_frame(Status.OK, evil))


def test_truncated_or_overlong_responses() -> None:
    data = os.urandom(500)
    wire = encode_frame(Status.OK, data)
    p = GetResponseParser([Digest.of(data)])
    p.feed(wire[:-1])
    with pytest.raises(ProtocolError):
        p.finish()
    with pytest.raises(ProtocolError):
        GetResponseParser([Digest.of(data)]).feed(wire + b"\x00")
    with pytest.raises(ProtocolError):
        GetResponseParser([Digest.of(data)]).feed(b"\x07\x00\x00\x00\x00")  # unknown status
    with pytest.raises(ProtocolError):
        GetResponseParser([Digest.of(data)]).feed(b"\x01\x00\x00\x00\x05")  # MISSING with a length
    with pytest.raises(ProtocolError):
        GetResponseParser([Digest.of(data)]).feed(b"\x00\x7f\x00\x00\x00")  # over MAX_CHUNK


@given(flags=st.lists(st.booleans(), min_size=1, max_size=100))
def test_have_round_trip(flags: list[bool]) -> None:
    assert decode_have(encode_have(flags), len(flags)) == flags
