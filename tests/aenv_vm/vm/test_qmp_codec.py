"""QMP framing (sans-IO codec): bytes in, messages out, under any chunking."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.qemu.errors import QmpProtocolError
from aenv_vm.qemu.qmp import ErrorReply, Event, Greeting, QmpCodec, Return, parse_message

json_scalars = st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

returns = st.builds(lambda i, v: ({"return": v, "id": i}, Return(i, v)), st.integers(0, 10**6), json_values)
errors = st.builds(lambda i, c, d: ({"error": {"class": c, "desc": d}, "id": i}, ErrorReply(i, c, d)),
                   st.integers(0, 10**6), st.sampled_from(["GenericError", "CommandNotFound", "DeviceNotFound"]),
                   st.text(max_size=40))
events = st.builds(lambda n, d, s, us: ({"event": n, "data": d, "timestamp": {"seconds": s, "microseconds": us}},
                                        Event(n, d, s + us / 1e6)),
                   st.sampled_from(["STOP", "RESUME", "SHUTDOWN", "MIGRATION"]),
                   st.dictionaries(st.text(max_size=8), json_scalars, max_size=3),
                   st.integers(0, 2**31), st.integers(0, 999_999))
messages = st.lists(returns | errors | events, max_size=12)


def wire(objs: list[dict], crlf: bool = True) -> bytes:
    # QEMU emits one JSON object per line; escaped control chars keep it one line.
    return b"".join(json.dumps(o).encode() + (b"\r\n" if crlf else b"\n") for o in objs)


@settings(max_examples=200, deadline=None)
@given(msgs=messages, cuts=st.lists(st.integers(0, 10_000), max_size=20), crlf=st.booleans())
def test_any_chunking_yields_the_same_messages(msgs: list, cuts: list[int], crlf: bool) -> None:
    data = wire([o for o, _ in msgs], crlf)
    points = sorted({c % (len(data) + 1) for c in cuts})
    codec = QmpCodec()
    out = []
    prev = 0
    for p in points + [len(data)]:
        out += codec.feed(data[prev:p])
        prev = p
    assert out == [m for _, m in msgs]
    assert codec.pending_bytes == 0


@settings(deadline=None)  # a loaded 2-core CI machine makes per-example timing meaningless
@given(st.text(max_size=30), st.dictionaries(st.text(max_size=5), json_values, max_size=3))
def test_encode_produces_one_line_with_increasing_ids(cmd: str, args: dict) -> None:
    codec = QmpCodec()
    id1, b1 = codec.encode(cmd, args)
    id2, b2 = codec.encode("query-status")
    assert id2 > id1
    assert b1.endswith(b"\r\n") and b1.count(b"\n") == 1
    decoded = json.loads(b1)
    assert decoded["execute"] == cmd and decoded["id"] == id1
    assert decoded.get("arguments", {}) == args
    assert "arguments" not in json.loads(b2)


def test_greeting_and_version() -> None:
    g = QmpCodec().feed(b'{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, '
                        b'"package": "Debian"}, "capabilities": ["oob"]}}\r\n')
    assert len(g) == 1 and isinstance(g[0], Greeting)
    assert g[0].qemu_version == (7, 2, 22)
    assert g[0].capabilities == ("oob",)


def test_blank_lines_are_ignored_and_partial_line_waits() -> None:
    codec = QmpCodec()
    assert codec.feed(b"\r\n\r\n") == []
    assert codec.feed(b'{"return": {}, "id"') == []
    assert codec.pending_bytes > 0
    assert codec.feed(b': 3}\r\n') == [Return(3, {})]


@pytest.mark.parametrize("line", [b"not json\n", b"[1, 2]\n", b'{"hello": 1}\n', b'{"error": "x"}\n',
                                  b'{"QMP": 5}\n', b"\xff\xfe\n"])
def test_malformed_lines_raise(line: bytes) -> None:
    with pytest.raises(QmpProtocolError):
        QmpCodec().feed(line)


def test_oversized_message_without_newline_raises() -> None:
    codec = QmpCodec(max_message=1024)
    codec.feed(b"{" + b" " * 1000)
    with pytest.raises(QmpProtocolError, match="longer than"):
        codec.feed(b" " * 100)


def test_event_with_odd_timestamp_still_parses() -> None:
    ev = parse_message({"event": "STOP", "timestamp": {"seconds": "x"}})
    assert ev == Event("STOP", {}, 0.0)


def test_execute_with_fd_passes_the_descriptor_with_the_command(tmp_path) -> None:
    """A fake QMP server receives the command bytes and the fd in one recvmsg (SCM_RIGHTS),
    as QEMU's getfd expects; the client's socket stays non-blocking for asyncio."""
    import asyncio
    import os
    import socket

    from aenv_vm.qemu.qmp import QmpClient

    path = tmp_path / "qmp.sock"
    target = tmp_path / "file"
    target.write_bytes(b"payload")

    async def run() -> tuple[bytes, bytes, bool]:
        loop = asyncio.get_running_loop()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        srv.listen(1)
        srv.setblocking(False)
        got: dict = {}

        async def serve() -> None:
            conn, _ = await loop.sock_accept(srv)
            conn.setblocking(True)
            conn.sendall(b'{"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 0}}, "capabilities": []}}\r\n')
            assert b"qmp_capabilities" in await asyncio.to_thread(conn.recv, 4096)
            conn.sendall(b'{"return": {}, "id": 1}\r\n')
            msg, fds, _flags, _addr = await asyncio.to_thread(socket.recv_fds, conn, 4096, 4)
            got["msg"] = msg
            got["data"] = os.pread(fds[0], 100, 0)
            for fd in fds:
                os.close(fd)
            conn.sendall(b'{"return": {}, "id": 2}\r\n')
            await asyncio.sleep(0.2)
            conn.close()

        task = asyncio.ensure_future(serve())
        client = await QmpClient.connect(path, timeout=5)
        fd = os.open(target, os.O_RDONLY)
        try:
            await client.execute_with_fd("getfd", {"fdname": "x"}, fd, timeout=5)
        finally:
            os.close(fd)
        blocking = os.get_blocking(client._writer.transport.get_extra_info("socket").fileno())
        await client.close()
        await task
        srv.close()
        return got["msg"], got["data"], blocking

    msg, data, blocking = asyncio.run(run())
    assert b'"execute":"getfd"' in msg and b'"fdname":"x"' in msg
    assert data == b"payload"
    assert not blocking
