"""NBD protocol state machine (byte strings) and the asyncio server with real
peers: raw sockets for bad input, qemu-img/qemu-io as the real client."""
from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.blockimage import nbd_protocol as P
from aenv_vm.blockimage.nbd_client import NbdClient, NbdError
from aenv_vm.blockimage.nbd_server import BackgroundNbdServer, MemoryExport


def _directory(*infos: P.ExportInfo) -> P.ExportDirectory:
    by = {i.name: i for i in infos}
    return P.ExportDirectory(by.get, lambda: list(by))


def _opt(opt: int, payload: bytes = b"") -> bytes:
    return struct.pack(">QII", P.IHAVEOPT, opt, len(payload)) + payload


def _go_payload(name: str, *infos: int) -> bytes:
    raw = name.encode()
    return struct.pack(">I", len(raw)) + raw + struct.pack(">H", len(infos)) + b"".join(struct.pack(">H", i) for i in infos)


def _parse_opt_replies(data: bytes) -> list[tuple[int, int, bytes]]:
    out = []
    while data:
        magic, opt, rtype, rlen = struct.unpack_from(">QIII", data)
        assert magic == P.REPLY_MAGIC_OPT
        out.append((opt, rtype, data[20:20 + rlen]))
        data = data[20 + rlen:]
    return out


def _handshaken(info: P.ExportInfo) -> P.NbdServerConnection:
    c = P.NbdServerConnection(_directory(info))
    c.data_to_send()
    c.receive_data(struct.pack(">I", 3) + _opt(P.Opt.GO, _go_payload(info.name)))
    ev = c.next_event()
    assert isinstance(ev, P.ExportSelected)
    c.data_to_send()
    return c


def test_greeting_and_go_sends_block_size_and_export_info() -> None:
    info = P.ExportInfo("disk", 1 << 20, can_multi_conn=True)
    c = P.NbdServerConnection(_directory(info))
    greet = c.data_to_send()
    assert struct.unpack(">QQH", greet) == (P.NBDMAGIC, P.IHAVEOPT, 3)
    c.receive_data(struct.pack(">I", 3))
    c.receive_data(_opt(P.Opt.STRUCTURED_REPLY))
    assert c.next_event() is P.NEED_DATA
    assert _parse_opt_replies(c.data_to_send())[0][1] == P.REP_ERR_UNSUP
    c.receive_data(_opt(P.Opt.GO, _go_payload("disk", P.INFO_BLOCK_SIZE)))
    ev = c.next_event()
    assert ev == P.ExportSelected(info)
    replies = _parse_opt_replies(c.data_to_send())
    assert replies[-1][1] == P.REP_ACK
    infos = {struct.unpack_from(">H", d)[0]: d for _, t, d in replies if t == P.REP_INFO}
    assert struct.unpack_from(">III", infos[P.INFO_BLOCK_SIZE], 2) == (1, 4096, 32 << 20)
    size, flags = struct.unpack_from(">QH", infos[P.INFO_EXPORT], 2)
    assert size == 1 << 20
    for f in (P.TF_SEND_FLUSH, P.TF_SEND_FUA, P.TF_SEND_TRIM, P.TF_SEND_WRITE_ZEROES, P.TF_CAN_MULTI_CONN):
        assert flags & f


def test_list_info_unknown_export_and_export_name() -> None:
    a, b = P.ExportInfo("a", 4096), P.ExportInfo("b", 8192, read_only=True)
    c = P.NbdServerConnection(_directory(a, b))
    c.data_to_send()
    c.receive_data(struct.pack(">I", 1) + _opt(P.Opt.LIST) + _opt(P.Opt.LIST, b"x")
                   + _opt(P.Opt.INFO, _go_payload("nope")) + _opt(P.Opt.INFO, _go_payload("b"))
                   + _opt(999) + _opt(P.Opt.EXPORT_NAME, b"b"))
    ev = c.next_event()
    assert isinstance(ev, P.ExportSelected) and ev.export.name == "b"
    out = c.data_to_send()
    # EXPORT_NAME answer: size, flags, 124 zero bytes (client did not set NO_ZEROES)
    assert out[-134:-124] == struct.pack(">QH", 8192, b.transmission_flags)
    assert out[-124:] == bytes(124)
    replies = _parse_opt_replies(out[:-134])
    names = [d[4:].decode() for _, t, d in replies if t == P.REP_SERVER]
    assert names == ["a", "b"]
    types = [t for _, t, _ in replies]
    assert P.REP_ERR_INVALID in types and P.REP_ERR_UNKNOWN in types and P.REP_ERR_UNSUP in types


@pytest.mark.parametrize("bad", [
    struct.pack(">I", 0),                                       # not fixed newstyle
    struct.pack(">I", 1 << 7 | 1),                              # unknown client flag
    struct.pack(">I", 1) + struct.pack(">QII", 0xDEADBEEF, 7, 0),  # bad option magic
    struct.pack(">I", 1) + _opt(P.Opt.EXPORT_NAME, b"missing"),  # EXPORT_NAME of an unknown export
])
def test_malformed_handshake_closes(bad: bytes) -> None:
    c = P.NbdServerConnection(_directory(P.ExportInfo("a", 4096)))
    c.receive_data(bad)
    ev = c.next_event()
    assert isinstance(ev, P.Closed) and ev.error


def test_request_validation_replies_errors_without_reaching_export() -> None:
    info = P.ExportInfo("a", 1 << 20, max_block=1 << 16)
    c = _handshaken(info)

    def req(cmd: int, h: int, off: int, ln: int, payload: bytes = b"", flags: int = 0) -> bytes:
        return struct.pack(">IHHQQI", P.REQUEST_MAGIC, flags, cmd, h, off, ln) + payload

    c.receive_data(req(P.Cmd.READ, 1, (1 << 20) - 10, 20)          # past the end
                   + req(P.Cmd.READ, 2, 0, 1 << 17)                 # oversized
                   + req(P.Cmd.WRITE, 3, (1 << 20) - 2, 4, b"abcd")  # write past end: payload drained
                   + req(P.Cmd.WRITE, 4, 0, 1 << 17, bytes(1 << 17))  # oversized write: drained
                   + req(77, 5, 0, 0)                                # unknown command
                   + req(P.Cmd.FLUSH, 6, 1, 0)                       # flush with offset
                   + req(P.Cmd.WRITE, 7, 10, 3, b"xyz", P.CMD_FLAG_FUA))
    ev = c.next_event()
    assert ev == P.Request(P.Cmd.WRITE, P.CMD_FLAG_FUA, 7, 10, 3, b"xyz")
    out = c.data_to_send()
    errs = [struct.unpack_from(">IIQ", out, i * 16) for i in range(len(out) // 16)]
    assert [(h, e) for _, e, h in errs] == [(1, P.EINVAL), (2, P.EINVAL), (3, P.ENOSPC), (4, P.EINVAL),
                                           (5, P.EINVAL), (6, P.EINVAL)]
    c.receive_data(req(P.Cmd.DISC, 8, 0, 0))
    assert c.next_event() == P.Closed(None)


def test_read_only_export_refuses_writes() -> None:
    c = _handshaken(P.ExportInfo("ro", 4096, read_only=True))
    c.receive_data(struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.Cmd.WRITE, 9, 0, 4) + b"abcd")
    assert c.next_event() is P.NEED_DATA
    assert struct.unpack(">IIQ", c.data_to_send()) == (P.SIMPLE_REPLY_MAGIC, P.EPERM, 9)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 50))
def test_fuzz_arbitrary_bytes_never_raise(data: bytes, step: int) -> None:
    c = P.NbdServerConnection(_directory(P.ExportInfo("a", 4096)))
    for i in range(0, len(data), step):
        c.receive_data(data[i:i + step])
        for _ in range(100):
            ev = c.next_event()
            if ev is P.NEED_DATA or isinstance(ev, P.Closed):
                break
        c.data_to_send()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([P.Cmd.READ, P.Cmd.WRITE, P.Cmd.TRIM]),
                          st.integers(0, 5000), st.integers(0, 5000)), max_size=10), st.integers(1, 64))
def test_fuzz_requests_split_anywhere(reqs: list[tuple[int, int, int]], step: int) -> None:
    """However the byte stream is split, the same requests come out."""
    info = P.ExportInfo("a", 4096)
    stream = b""
    for h, (cmd, off, ln) in enumerate(reqs):
        stream += struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, cmd, h, off, ln)
        if cmd == P.Cmd.WRITE:
            stream += bytes([h % 256]) * ln
    whole, split = _handshaken(info), _handshaken(info)
    whole.receive_data(stream)
    evs_a = _drain(whole)
    evs_b = []
    for i in range(0, len(stream), step):
        split.receive_data(stream[i:i + step])
        evs_b += _drain(split)
    assert evs_a == evs_b
    assert whole.data_to_send() == split.data_to_send()


def _drain(c: P.NbdServerConnection) -> list[object]:
    out = []
    while (ev := c.next_event()) is not P.NEED_DATA:
        out.append(ev)
    return out


# --- the asyncio server with real sockets ----------------------------------
@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    a = MemoryExport("a", os.urandom(1 << 20))
    b = MemoryExport("b", os.urandom(256 << 10))
    sock = tmp_path / "nbd.sock"
    with BackgroundNbdServer(sock, [a, b]) as srv:
        yield srv, str(sock), a, b


def _raw(sock: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(sock)
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _is_closed(s: socket.socket) -> bool:
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, socket.timeout):
        return False


async def _roundtrip(sock: str, name: str, want: bytes) -> None:
    c = await NbdClient.connect(sock, name)
    try:
        assert c.size == len(want)
        # 16 requests in flight on one connection, answered out of order is fine.
        offs = [i * 4096 * 3 % (len(want) - 4096) for i in range(16)]
        got = await asyncio.gather(*(c.read(o, 4096) for o in offs))
        assert got == [want[o:o + 4096] for o in offs]
    finally:
        await c.close()


def test_bad_clients_do_not_disturb_others(served) -> None:  # type: ignore[no-untyped-def]
    srv, sock, a, b = served
    bad_inputs = [
        struct.pack(">I", 0),
        struct.pack(">I", 1) + b"garbage-garbage-garbage!",
        struct.pack(">I", 1) + _opt(P.Opt.EXPORT_NAME, b"nope"),
    ]
    for bad in bad_inputs:
        s = _raw(sock)
        _recv_exact(s, 18)
        s.sendall(bad)
        assert _is_closed(s)
        s.close()
    # unknown options and out-of-range/oversized requests: errors, connection stays usable
    s = _raw(sock)
    _recv_exact(s, 18)
    s.sendall(struct.pack(">I", 3) + _opt(4242) + _opt(P.Opt.GO, _go_payload("b")))
    head = _recv_exact(s, 20)
    assert struct.unpack(">QIII", head)[2] == P.REP_ERR_UNSUP
    _recv_exact(s, struct.unpack(">QIII", head)[3])
    while True:
        _m, _o, rtype, rlen = struct.unpack(">QIII", _recv_exact(s, 20))
        _recv_exact(s, rlen)
        if rtype == P.REP_ACK:
            break
    size = 256 << 10
    s.sendall(struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.Cmd.READ, 1, size, 1)
              + struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.Cmd.READ, 2, 0, 64 << 20)
              + struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.Cmd.READ, 3, 100, 10))
    assert struct.unpack(">IIQ", _recv_exact(s, 16))[1:] == (P.EINVAL, 1)
    assert struct.unpack(">IIQ", _recv_exact(s, 16))[1:] == (P.EINVAL, 2)
    assert struct.unpack(">IIQ", _recv_exact(s, 16))[1:] == (0, 3)
    assert _recv_exact(s, 10) == b.data[100:110]
    # abrupt disconnect with a half-sent write payload in flight
    s.sendall(struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.Cmd.WRITE, 4, 0, 4096) + b"x" * 100)
    s.close()
    # both exports still serve, concurrently
    async def both() -> None:
        await asyncio.gather(_roundtrip(sock, "a", a.data), _roundtrip(sock, "b", b.data))
    asyncio.run(both())
    assert b.data[:100] != b"x" * 100   # the torn write was never applied


def test_client_sees_errors(served) -> None:  # type: ignore[no-untyped-def]
    _srv, sock, a, _b = served

    async def go() -> None:
        c = await NbdClient.connect(sock, "a")
        with pytest.raises(NbdError) as ei:
            await c.read(c.size - 1, 2)
        assert ei.value.errno == P.EINVAL
        with pytest.raises(NbdError) as ei:
            await c.write(c.size, b"z")
        assert ei.value.errno == P.ENOSPC
        await c.write(5, b"hello", fua=True)
        await c.write_zeroes(4096, 8192)
        await c.flush()
        assert await c.read(0, 16) == a.data[:5] + b"hello" + a.data[10:16]
        assert await c.read(4096, 8192) == bytes(8192)
        await c.close()
        with pytest.raises(NbdError):
            await NbdClient.connect(sock, "missing")
    asyncio.run(go())


def test_qemu_img_convert_and_qemu_io(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _srv, sock, a, _b = served
    src = tmp_path / "src.raw"
    src.write_bytes(a.data)
    out = tmp_path / "out.raw"
    url = f"nbd+unix:///a?socket={sock}"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", url, str(out)], check=True, timeout=60)
    assert out.read_bytes() == src.read_bytes()
    subprocess.run(["qemu-io", "-f", "raw", "-c", "write -P 0xab 1000 5000", "-c", "flush", url],
                   check=True, timeout=60, capture_output=True)
    expected = bytearray(src.read_bytes())
    expected[1000:6000] = b"\xab" * 5000
    assert a.data == bytes(expected)


class _HeldExport(MemoryExport):
    """Reads go to the worker threads and wait there until released; counts how many
    are held at once."""

    def __init__(self, name: str, data: bytes) -> None:
        super().__init__(name, data)
        import threading
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.held = 0
        self.most_held = 0

    def read_nowait(self, offset: int, length: int) -> bytes | None:
        return None

    def read(self, offset: int, length: int) -> bytes:
        with self.lock:
            self.held += 1
            self.most_held = max(self.most_held, self.held)
        self.release.wait(30)
        with self.lock:
            self.held -= 1
        return super().read(offset, length)


def test_requests_in_flight_are_bounded_by_bytes(tmp_path: Path) -> None:
    """A client asking for many large reads at once (a guest's disk reads, or an escaped
    QEMU) gets at most MAX_INFLIGHT_BYTES of them worked on at a time: the node's memory
    for one connection's reads is bounded, not 64 requests × 32 MiB. All are answered."""
    import time

    from aenv_vm.blockimage.nbd_server import MAX_INFLIGHT_BYTES

    size = 8 << 20
    export = _HeldExport("held", bytes(range(256)) * (12 * size // 256))
    sock = tmp_path / "nbd.sock"
    with BackgroundNbdServer(sock, [export]):
        async def go() -> None:
            c = await NbdClient.connect(str(sock), "held")
            try:
                reads = [asyncio.ensure_future(c.read((i % 12) * size, size)) for i in range(12)]
                deadline = time.monotonic() + 10
                while export.held < MAX_INFLIGHT_BYTES // size and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)    # the server had time to take more, if it would
                assert export.held == MAX_INFLIGHT_BYTES // size, export.held
                export.release.set()
                got = await asyncio.gather(*reads)
                assert [len(g) for g in got] == [size] * 12
                assert got[3] == export.data[3 * size:4 * size]
            finally:
                await c.close()
        asyncio.run(go())
    assert export.most_held == MAX_INFLIGHT_BYTES // size
