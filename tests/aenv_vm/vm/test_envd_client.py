"""The host-side envd client: Connect envelope and HTTP framing (pure), and the
client itself against a real envd process."""
from __future__ import annotations

import asyncio
import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.envd_client import (END_STREAM, CommandResult, EnvdClient, EnvdError, NoAnswer, command_result,
                                 decode_chunked, decode_envelopes, encode_envelope, format_request, parse_response)
from aenv_vm.errors import VmError, VmTimeout

messages = st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20) | st.booleans(), max_size=4)


@settings(deadline=None)  # a loaded 2-core CI machine makes per-example timing meaningless
@given(st.lists(st.tuples(st.sampled_from([0, 2]), messages), max_size=8))
def test_frames_round_trip(frames: list[tuple[int, dict]]) -> None:
    data = b"".join(encode_envelope(m, f) for f, m in frames)
    assert decode_envelopes(data) == frames


@settings(deadline=None)  # a loaded 2-core CI machine makes per-example timing meaningless
@given(st.lists(messages, min_size=1, max_size=4), st.data())
def test_truncation_is_detected(msgs: list[dict], data: st.DataObject) -> None:
    wire = b"".join(encode_envelope(m) for m in msgs)
    cut = data.draw(st.integers(1, len(wire) - 1))
    frames_before = 0
    pos = 0
    while pos < len(wire):
        pos += 5 + int.from_bytes(wire[pos + 1:pos + 5], "big")
        if pos <= cut:
            frames_before += 1
    if pos_is_boundary(wire, cut):
        assert len(decode_envelopes(wire[:cut])) == frames_before
    else:
        with pytest.raises(EnvdError, match="truncated"):
            decode_envelopes(wire[:cut])


def pos_is_boundary(wire: bytes, cut: int) -> bool:
    pos = 0
    while pos < cut:
        pos += 5 + int.from_bytes(wire[pos + 1:pos + 5], "big")
    return pos == cut


def test_bad_json_is_an_error() -> None:
    with pytest.raises(EnvdError, match="bad JSON"):
        decode_envelopes(b"\x00\x00\x00\x00\x03{{{")


# -- HTTP framing of the client (pure) ---------------------------------------------------

def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, pos = b"", 0
    for n in sizes:
        if pos >= len(body):
            break
        piece = body[pos:pos + n]
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        pos += len(piece)
    if pos < len(body):
        out += f"{len(body) - pos:x};ext=1\r\n".encode() + body[pos:] + b"\r\n"
    return out + b"0\r\n\r\n"


@settings(deadline=None)
@given(st.binary(max_size=4000), st.lists(st.integers(1, 700), max_size=12))
def test_chunked_bodies_round_trip(body: bytes, sizes: list[int]) -> None:
    assert decode_chunked(chunked(body, sizes)) == body
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Envd-Version: 1.2\r\n\r\n" + chunked(body, sizes)
    answer = parse_response(wire)
    assert (answer.status, answer.body, answer.headers["x-envd-version"]) == (200, body, "1.2")


@settings(deadline=None)
@given(st.binary(min_size=1, max_size=2000), st.data())
def test_truncated_chunked_body_is_an_error(body: bytes, data: st.DataObject) -> None:
    wire = chunked(body, [])
    cut = data.draw(st.integers(0, len(wire) - 6))   # strictly before the last-chunk line ends
    with pytest.raises(EnvdError):
        decode_chunked(wire[:cut])


def test_response_shapes() -> None:
    assert parse_response(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n").body == b""
    assert parse_response(b"HTTP/1.0 200 OK\r\n\r\nuntil close").body == b"until close"
    fixed = parse_response(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\nA: b\r\n\r\nabcdef")
    assert (fixed.status, fixed.body, fixed.headers["a"]) == (404, b"abc", "b")
    with pytest.raises(EnvdError, match="truncated body"):
        parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort")
    for nothing in (b"", b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nno end of head"):
        with pytest.raises(NoAnswer):   # what QEMU's user-mode network does while nothing listens
            parse_response(nothing)


@settings(deadline=None)
@given(st.sampled_from(["GET", "POST", "PUT"]), st.from_regex(r"/[a-z0-9/._-]{0,30}", fullmatch=True),
       st.dictionaries(st.from_regex(r"X-[A-Za-z]{1,10}", fullmatch=True), st.from_regex(r"[a-z0-9]{0,12}",
                                                                                         fullmatch=True),
                       max_size=4), st.binary(max_size=100))
def test_requests_parse_in_envds_own_parser(method: str, path: str, headers: dict[str, str], body: bytes) -> None:
    from envd.http11 import parse_request_head

    wire = format_request(method, "127.0.0.1", path, headers, body)
    head_bytes, _, rest = wire.partition(b"\r\n\r\n")
    head = parse_request_head(head_bytes)
    assert (head.method, head.path, rest) == (method, path, body)
    assert head.header("connection") == "close" and not head.keep_alive
    for k, v in headers.items():
        assert head.header(k.lower()) == v
    if body or method != "GET":
        assert head.header("content-length") == str(len(body))


def test_command_result_from_frames() -> None:
    frames = (encode_envelope({"event": {"start": {"pid": 1}}})
              + encode_envelope({"event": {"data": {"stdout": base64.b64encode(b"out").decode()}}})
              + encode_envelope({"event": {"data": {"stderr": base64.b64encode(b"err").decode()}}})
              + encode_envelope({"event": {"end": {"exitCode": 3}}}) + encode_envelope({}, END_STREAM))
    assert command_result(frames) == CommandResult(3, b"out", b"err")
    with pytest.raises(EnvdError, match="without an end event"):
        command_result(encode_envelope({"event": {"start": {"pid": 1}}}))
    with pytest.raises(EnvdError, match="start failed"):
        command_result(encode_envelope({"error": {"code": "not_found"}}, END_STREAM))


# -- against a real envd (the guest's daemon, run on the host) ---------------------------

def test_client_against_a_real_envd(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from envd import ENVD_VERSION

    from tests.envd.conftest import start_envd, stop_envd

    e = start_envd("--user", "root")
    try:
        async def go() -> None:
            client = EnvdClient("127.0.0.1", e.port)
            assert await client.wait_healthy(timeout=10) == ENVD_VERSION   # the version header of /health
            await client.init({"envVars": {"K": "v"}, "accessToken": "secret"})
            with pytest.raises(EnvdError, match="401"):
                await client.run("true")                                  # the token is in force now
            secured = client.with_token("secret")
            path = str(tmp_path / "f")
            await secured.write_file(path, b"\x00bytes\xff" * 1000)
            assert await secured.read_file(path) == b"\x00bytes\xff" * 1000
            r = await secured.run("echo $K; echo oops >&2; exit 7")
            assert (r.exit_code, r.stdout, r.stderr) == (7, b"v\n", b"oops\n")
            # a retried /init carrying the token in force still authenticates (init_when_ready)
            assert await secured.init_when_ready({"accessToken": "secret"}, timeout=5) >= 0
        asyncio.run(go())
    finally:
        stop_envd(e)


def test_waiting_on_a_port_nothing_answers_times_out() -> None:
    import socket

    with socket.socket() as s:      # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(VmTimeout, match="did not answer"):
            asyncio.run(EnvdClient("127.0.0.1", port).wait_healthy(timeout=0.3))
        with pytest.raises(VmError, match="VM exited"):
            asyncio.run(EnvdClient("127.0.0.1", port).init_when_ready({}, timeout=5, alive=lambda: False))


def test_an_answer_beyond_max_bytes_is_refused() -> None:
    """A guest decides how much it sends: a bounded read stops at the bound."""
    body = b"x" * (1 << 20)

    async def run() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            client = EnvdClient("127.0.0.1", port)
            assert await client.read_file("/big", max_bytes=len(body)) == body
            with pytest.raises(EnvdError, match="larger than 1000 bytes"):
                await client.read_file("/big", max_bytes=1000)
        finally:
            server.close()
            await server.wait_closed()
    asyncio.run(run())


# -- a guest that replaced its envd: answers without end, or a byte at a time -------------

class EndlessEnvd:
    """A loopback server answering every request with ``head`` then ``piece`` forever (or
    ``every`` seconds apart), as a guest that replaced its envd would."""

    def __init__(self, head: bytes, piece: bytes, every: float = 0.0) -> None:
        self.head, self.piece, self.every = head, piece, every
        self.sent = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(self.head)
            while True:
                writer.write(self.piece)
                self.sent += len(self.piece)
                await writer.drain()
                if self.every:
                    await asyncio.sleep(self.every)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


def test_endless_answers_fail_at_their_bound() -> None:
    """/health, /init and a command answered with an endless body (close-delimited and
    chunked): each call stops at its bound with EnvdError, at once, holding no more than
    the bound (tracemalloc's peak), instead of reading until its deadline."""
    import time
    import tracemalloc

    from aenv_vm.envd_client import MAX_ANSWER, MAX_COMMAND_ANSWER

    heads = [b"HTTP/1.1 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffff\r\n"]

    async def run() -> None:
        for head in heads:
            envd = EndlessEnvd(head, b"x" * 65536)
            async with envd as port:
                client = EnvdClient("127.0.0.1", port, "token")
                calls = [(client.wait_healthy(timeout=30), MAX_ANSWER),
                         (client.init_when_ready({}, timeout=30), MAX_ANSWER),
                         (client.init({}), MAX_ANSWER), (client.read_file("/x"), MAX_ANSWER),
                         (client.run("true"), MAX_COMMAND_ANSWER)]
                for call, bound in calls:
                    t0 = time.monotonic()
                    tracemalloc.start()
                    try:
                        with pytest.raises(EnvdError, match=f"larger than {bound} bytes"):
                            await call
                        _, peak = tracemalloc.get_traced_memory()
                    finally:
                        tracemalloc.stop()
                    assert time.monotonic() - t0 < 10
                    assert peak < 3 * bound + (1 << 20), peak
    asyncio.run(run())


def test_an_endless_stream_frame_fails_at_its_bound() -> None:
    """A process stream whose frame header names 4 GiB, and one that sends a valid frame
    header of 2 MiB over 4 MiB's bound: refused from the header, whatever follows."""
    from aenv_vm.envd_client import ProcessRequest, stream_process
    from aenv_vm.envd_stream import MAX_FRAME

    async def run() -> None:
        for head in (b"HTTP/1.1 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"):
            for length in (2**32 - 1, MAX_FRAME + 1):
                frame = encode_envelope({"event": {"start": {"pid": 1}}}) + bytes([0]) + length.to_bytes(4, "big")
                if b"chunked" in head:   # one chunk without end, the frame header in it
                    frame = b"fffffffffff\r\n" + frame
                envd = EndlessEnvd(head + frame, b"x" * 4096)
                async with envd as port:
                    with pytest.raises(EnvdError, match=f"Connect frame of {length} bytes"):
                        await stream_process(EnvdClient("127.0.0.1", port), ProcessRequest("true"), timeout=30,
                                             on_output=lambda _k, _d: None)
    asyncio.run(run())


def test_an_envd_answering_a_byte_at_a_time_is_given_up_at_the_deadline() -> None:
    """An answer that trickles (a byte every 50 ms) never completes: the call ends at its
    deadline, the greeting's wait (init_when_ready) with VmTimeout."""
    import time

    async def run() -> None:
        envd = EndlessEnvd(b"HTTP/1.1 200 OK\r\n", b"X", every=0.05)
        async with envd as port:
            client = EnvdClient("127.0.0.1", port)
            t0 = time.monotonic()
            with pytest.raises(EnvdError, match="no whole answer within 1.0 s"):
                await client.init({}, timeout=1.0)
            with pytest.raises(VmTimeout, match="did not answer within 1.5 s"):
                await client.init_when_ready({}, timeout=1.5)
            assert time.monotonic() - t0 < 6
    asyncio.run(run())
