"""The sans-IO parts of envd, fuzzed with hypothesis: bytes in, values out."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envd import connect, inotify, multipart, pbjson, router
from envd.connect import Code, ConnectError, EnvelopeDecoder
from envd.files import _accepts_gzip
from envd.http11 import ChunkedDecoder, HttpError, encode_chunk, parse_request_head, LAST_CHUNK
from envd.users import basic_auth_user


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points + [len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


payloads = st.lists(st.binary(max_size=300), max_size=8)


@given(payloads, st.lists(st.integers(0, 10_000), max_size=12))
def test_envelopes_roundtrip_any_split(msgs: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(connect.encode_envelope(m) for m in msgs)
    dec = EnvelopeDecoder()
    got = [e.data for piece in splits(wire, cuts) for e in dec.feed(piece)]
    dec.finish()
    assert got == msgs


@given(st.binary(max_size=200))
def test_envelope_decoder_only_raises_connect_errors(data: bytes) -> None:
    try:
        connect.decode_envelopes(data)
    except ConnectError as e:
        assert e.code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED)


def test_envelope_decoder_rejects() -> None:
    for bad, code in [(b"\x01\x00\x00\x00\x00", Code.INVALID_ARGUMENT), (b"\x02\x00\x00\x00\x00", Code.INVALID_ARGUMENT),
                      (struct.pack(">BI", 0, 1 << 31), Code.RESOURCE_EXHAUSTED), (b"\x00\x00", Code.INVALID_ARGUMENT)]:
        with pytest.raises(ConnectError) as ei:
            connect.decode_envelopes(bad)
        assert ei.value.code is code


def test_end_stream_frames() -> None:
    assert connect.encode_end_stream() == b"\x02\x00\x00\x00\x02{}"
    frame = connect.encode_end_stream(ConnectError(Code.NOT_FOUND, "gone"))
    assert frame[0] == 2 and json.loads(frame[5:]) == {"error": {"code": "not_found", "message": "gone"}}
    assert {c.wire for c in Code} >= {"not_found", "unauthenticated", "deadline_exceeded"}
    assert Code.UNAUTHENTICATED.http_status == 401 and Code.DEADLINE_EXCEEDED.http_status == 504


@given(st.text(max_size=12))
def test_timeout_header(value: str) -> None:
    try:
        ms = connect.parse_timeout_ms(value)
    except ConnectError as e:
        assert e.code is Code.INVALID_ARGUMENT
    else:
        assert ms is None if value == "" else ms == int(value)


@given(st.binary(max_size=200))
def test_json_message_decoder(data: bytes) -> None:
    try:
        assert isinstance(connect.decode_json_message(data), dict)
    except ConnectError as e:
        assert e.code is Code.INVALID_ARGUMENT


@given(st.lists(st.binary(min_size=1, max_size=200), max_size=6), st.lists(st.integers(0, 5000), max_size=10))
def test_chunked_roundtrip(chunks: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(encode_chunk(c) for c in chunks) + LAST_CHUNK
    dec = ChunkedDecoder()
    got = b"".join(b"".join(dec.feed(p)) for p in splits(wire, cuts))
    assert dec.done and got == b"".join(chunks)


@given(st.binary(max_size=100))
def test_chunked_decoder_only_raises_http_errors(data: bytes) -> None:
    try:
        ChunkedDecoder().feed(data)
    except HttpError as e:
        assert e.status == 400


@given(st.binary(max_size=300))
def test_request_head_parser_total(data: bytes) -> None:
    try:
        head = parse_request_head(data)
    except HttpError as e:
        assert 400 <= e.status < 600
    else:
        assert head.path.startswith("/")


def test_request_head_fields() -> None:
    head = parse_request_head(b"POST /files?path=%2Ftmp%2Fa%20b&username=u HTTP/1.1\r\nHost: x\r\nX-Access-Token:  t \r\n\r\n")
    assert (head.method, head.path, head.version) == ("POST", "/files", "HTTP/1.1")
    assert head.query_value("path") == "/tmp/a b" and head.query_value("username") == "u"
    assert head.header("x-access-token") == "t" and head.keep_alive
    assert not parse_request_head(b"GET / HTTP/1.1\r\nConnection: close\r\n").keep_alive


part_names = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters='"\\;'), min_size=1, max_size=20)


@given(st.lists(st.tuples(part_names, st.binary(max_size=500)), min_size=1, max_size=4),
       st.lists(st.integers(0, 5000), max_size=15))
def test_multipart_roundtrip_any_split(parts: list[tuple[str, bytes]], cuts: list[int]) -> None:
    boundary = "XbOuNdArYx1234"
    wire = b"".join(
        b"--" + boundary.encode() + b"\r\n"
        + f'Content-Disposition: form-data; name="file"; filename="{name}"\r\n'.encode()
        + b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n"
        for name, data in parts
    ) + b"--" + boundary.encode() + b"--\r\n"
    p = multipart.MultipartParser(boundary)
    got: list[tuple[str, bytes]] = []
    for piece in splits(wire, cuts):
        for ev in p.feed(piece):
            if isinstance(ev, multipart.PartStart):
                got.append((ev.disposition["filename"], b""))
            elif isinstance(ev, multipart.PartData):
                got[-1] = (got[-1][0], got[-1][1] + ev.data)
    p.finish()
    assert got == parts


@given(st.binary(max_size=300))
def test_multipart_parser_only_raises_multipart_errors(data: bytes) -> None:
    p = multipart.MultipartParser("b")
    try:
        p.feed(data)
        p.finish()
    except multipart.MultipartError:
        pass


def test_multipart_headers_and_boundary() -> None:
    assert multipart.boundary_from_content_type('multipart/form-data; boundary="a b"') == "a b"
    with pytest.raises(multipart.MultipartError):
        multipart.boundary_from_content_type("multipart/form-data")
    d = multipart.parse_disposition('form-data; name="file"; filename="/tmp/a \\"q\\".txt"')
    assert d == {"name": "file", "filename": '/tmp/a "q".txt'}


@given(st.lists(st.tuples(st.integers(1, 100), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                          st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=20)),
                max_size=5))
def test_inotify_records_roundtrip(records: list[tuple[int, int, int, str]]) -> None:
    buf = b""
    for wd, mask, cookie, name in records:
        raw = name.encode()
        padded = raw + b"\0" * (-(len(raw) + 1) % 16 + 1) if raw else b""
        buf += struct.pack("iIII", wd, mask, cookie, len(padded)) + padded
    got = inotify.parse_events(buf)
    assert [(e.wd, e.mask, e.cookie, e.name) for e in got] == records


def test_inotify_event_types() -> None:
    assert inotify.event_type(inotify.IN_CREATE | inotify.IN_ISDIR) == "EVENT_TYPE_CREATE"
    assert inotify.event_type(inotify.IN_MOVED_TO) == "EVENT_TYPE_CREATE"
    assert inotify.event_type(inotify.IN_MOVED_FROM) == "EVENT_TYPE_RENAME"
    assert inotify.event_type(inotify.IN_DELETE) == "EVENT_TYPE_REMOVE"
    assert inotify.event_type(inotify.IN_MODIFY) == "EVENT_TYPE_WRITE"
    assert inotify.event_type(inotify.IN_ATTRIB) == "EVENT_TYPE_CHMOD"
    assert inotify.event_type(inotify.IN_IGNORED) is None


@given(st.sampled_from(["GET", "POST", "PUT", "HEAD"]),
       st.one_of(st.sampled_from(list(router.RPC_METHODS) + list(router.HTTP_ROUTES)), st.text(max_size=30).map(lambda s: "/" + s)),
       st.one_of(st.none(), st.sampled_from(["application/json", "application/connect+json", "application/json; charset=utf-8", "text/plain"])))
def test_router_is_total(method: str, path: str, ctype: str | None) -> None:
    r = router.route(method, path, ctype)
    if isinstance(r, router.RouteError):
        assert r.status in (404, 405, 415) and r.message
    else:
        assert r.path == path


def test_router_kinds() -> None:
    assert router.route("POST", "/process.Process/Start", "application/connect+json").kind is router.Kind.SERVER_STREAM  # type: ignore[union-attr]
    assert router.route("POST", "/process.Process/List", "application/json; charset=utf-8").kind is router.Kind.UNARY  # type: ignore[union-attr]
    assert router.route("POST", "/process.Process/Nope", "application/json").status == 404  # type: ignore[union-attr]
    assert router.route("DELETE", "/files", None).status == 405  # type: ignore[union-attr]


def test_basic_auth_and_fields() -> None:
    assert basic_auth_user("Basic " + base64.b64encode(b"user:").decode()) == "user"
    assert basic_auth_user("Basic " + base64.b64encode(b"root:pw").decode()) == "root"
    for bad in (None, "", "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b":").decode()):
        assert basic_auth_user(bad) is None
    msg = {"watcherId": "w", "include_entry": True, "depth": "3", "stdin": "aGk"}
    assert pbjson.get_str(msg, "watcher_id") == "w" and pbjson.get_bool(msg, "include_entry") is True
    assert pbjson.get_uint(msg, "depth") == 3 and pbjson.get_bytes(msg, "stdin") == b"hi"
    with pytest.raises(ConnectError):
        pbjson.get_uint({"depth": -1}, "depth")


def test_accept_encoding() -> None:
    assert _accepts_gzip(None) is False and _accepts_gzip("gzip") is True
    assert _accepts_gzip("gzip;q=0, identity") is False
    assert _accepts_gzip("br, identity;q=0") is None
    assert _accepts_gzip("*") is False  # anything goes: identity
    assert _accepts_gzip("gzip, deflate, br, zstd") is False  # httpx's generic default
    assert _accepts_gzip("gzip, deflate, identity;q=0") is True
    assert _accepts_gzip("GZIP") is True
