"""Endless and deflate-bomb WebSocket messages through the node's proxy, both ways (issue
28), with a real guest: a WebSocket server the guest runs as root on port 8080, reached
through the proxy as any guest port is (E2b-Sandbox-Id / E2b-Sandbox-Port).

Client → guest: a frame naming 2^62 bytes; a message fragmented without end; a
compressed message inflating to 1 GiB (1000 × its size). Guest → client: a message one
byte over the cap, an endless frame, a compressed frame on a session the node never
offered compression on. Each ends its session with the close code that says why (1009,
1002 for the last), a message under the cap still passes, and the node's RSS,
``/health`` and a neighbour stay within the harness's bounds (aenv_http/wsbridge.py,
``[server] websocket_max_message``)."""
from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
import time
import urllib.parse
import zlib
from typing import Any

import aiohttp
import pytest

from aenv_http.wsbridge import MAX_MESSAGE

from ..conftest import Server
from .watch import watching

pytestmark = [pytest.mark.qemu]

PORT = 8080

GUEST_WS = r'''
import base64, hashlib, socket, struct, threading
def exact(c, n):
    buf = bytearray()
    while len(buf) < n:
        got = c.recv(min(n - len(buf), 1 << 20))
        if not got:
            raise EOFError
        buf += got
    return bytes(buf)
def frame(opcode, data, rsv1=False):
    b0 = 0x80 | opcode | (0x40 if rsv1 else 0)
    n = len(data)
    head = struct.pack(">BB", b0, n) if n < 126 else struct.pack(">BBH", b0, 126, n) if n < 65536 \
        else struct.pack(">BBQ", b0, 127, n)
    return head + data
def unmask(data, mask):
    n = len(data)
    return (int.from_bytes(data, "big") ^ int.from_bytes((mask * (n // 4 + 1))[:n], "big")).to_bytes(n, "big")
def serve(c):
    try:
        req = b""
        while b"\r\n\r\n" not in req:
            req += c.recv(4096)
        key = [l.split(b":", 1)[1].strip() for l in req.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        while True:
            b0, b1 = exact(c, 2)
            op, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", exact(c, 2))[0]
            elif n == 127:
                n = struct.unpack(">Q", exact(c, 8))[0]
            mask = exact(c, 4) if b1 & 0x80 else b"\0\0\0\0"
            data = exact(c, n)
            if op == 8:
                c.sendall(frame(8, data[:2]))
                return
            if op == 2:
                c.sendall(frame(1, b"got %d" % n))
                continue
            if op != 1:
                continue
            verb, _, arg = unmask(data, mask).decode().partition(":")
            if verb == "send":
                c.sendall(frame(2, b"g" * int(arg)))
            elif verb == "endless":
                c.sendall(struct.pack(">BBQ", 0x82, 127, 1 << 62))
                block = bytes(1 << 16)
                while True:
                    c.sendall(block)
            elif verb == "bomb":
                c.sendall(frame(2, open("/tmp/bomb.deflate", "rb").read(), rsv1=True))
            else:
                c.sendall(frame(1, b"echo:" + verb.encode()))
    except (OSError, EOFError, ValueError):
        pass
    finally:
        c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080))
s.listen(64)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''


def deflate_bomb(inflated: int) -> bytes:
    """A permessage-deflate payload (RFC 7692: raw deflate, the final empty block's
    00 00 ff ff taken off) that inflates to ``inflated`` zero bytes."""
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = bytes(1 << 20)
    out = b"".join(z.compress(block) for _ in range(inflated >> 20)) + z.flush(zlib.Z_SYNC_FLUSH)
    assert out.endswith(b"\x00\x00\xff\xff")
    return out[:-4]


class RawClient:
    """A WebSocket client on a bare socket, through the node's proxy: sends what aiohttp's
    client would refuse to."""

    def __init__(self, node: Server, sid: str, deflate: bool = False) -> None:
        url = urllib.parse.urlsplit(node.url)
        self.sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        ext = "Sec-WebSocket-Extensions: permessage-deflate\r\n" if deflate else ""
        self.sock.sendall((f"GET /ws HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: {PORT}\r\n"
                           f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           f"Sec-WebSocket-Version: 13\r\n{ext}\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            got = self.sock.recv(4096)
            assert got, head
            head += got
        head, _, self.got = head.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        assert (b"permessage-deflate" in head.lower()) == deflate, head

    @staticmethod
    def frame(opcode: int, payload: bytes, *, fin: bool = True, rsv1: bool = False) -> bytes:
        b0 = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
        mask = os.urandom(4)
        n = len(payload)
        head = struct.pack(">BB", b0, 0x80 | n) if n < 126 else struct.pack(">BBH", b0, 0xFE, n) if n < 65536 \
            else struct.pack(">BBQ", b0, 0xFF, n)
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes((mask * (n // 4 + 1))[:n], "big")).to_bytes(n, "big")
        return head + mask + masked

    def offend(self, first: bytes, more: bytes, seconds: float = 60.0) -> tuple[int, int]:
        """Send ``first``, then ``more`` again and again until the node closes the session;
        (the close code it sent, the bytes this client sent)."""
        self.sock.sendall(first)
        sent = len(first)
        self.sock.settimeout(0.02)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(self.got) < 4:
            if more:
                try:
                    self.sock.sendall(more)
                    sent += len(more)
                except (BlockingIOError, socket.timeout):
                    pass
                except OSError:
                    break
            try:
                got = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not got:
                break
            self.got += got
        assert self.got[:1] == b"\x88", ("no close frame from the node", self.got[:20], sent)
        return struct.unpack(">H", self.got[2:4])[0], sent

    def close(self) -> None:
        self.sock.close()


async def guest_says(node: Server, sid: str, command: str) -> tuple[int | None, Any]:
    """Ask the guest's server for ``command`` on a session of aiohttp's client (no bound of
    its own): (the close code the session ended with or None, the last message's data)."""
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(node.url + "/ws", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(PORT)},
                                max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=10)) as ws:
            await ws.send_str(command)
            msg = await ws.receive(timeout=120)
            if msg.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                return None, msg.data
            return ws.close_code, msg.extra


def test_websocket_messages_beyond_the_cap_both_ways(node: Server, neighbour: Any) -> None:
    from e2b import Sandbox

    offender = Sandbox.create(timeout=600)
    sid = offender.sandbox_id
    cap = MAX_MESSAGE
    try:
        offender.files.write("/tmp/ws.py", GUEST_WS)
        offender.files.write("/tmp/bomb.deflate", deflate_bomb(1 << 30))
        offender.commands.run("python3 /tmp/ws.py", background=True, user="root")
        deadline = time.monotonic() + 120
        while True:
            try:
                if asyncio.run(guest_says(node, sid, "hello")) == (None, "echo:hello"):
                    break
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            assert time.monotonic() < deadline, "the guest's WebSocket server never answered"
            time.sleep(1.0)
        bomb = deflate_bomb(1 << 30)
        assert len(bomb) < cap // 8

        with watching(node, neighbour) as harm:
            # client → guest: a frame naming 2^62 bytes, then zeros
            raw = RawClient(node, sid)
            endless = struct.pack(">BBQ", 0x82, 0xFF, 1 << 62) + os.urandom(4)
            code_endless, sent_endless = raw.offend(endless, bytes(1 << 16))
            raw.close()
            # ... a message fragmented without end: 64 KiB frames that never say FIN
            raw = RawClient(node, sid)
            piece = RawClient.frame(0, bytes(1 << 16), fin=False)
            code_fragments, sent_fragments = raw.offend(RawClient.frame(2, bytes(1 << 16), fin=False), piece)
            raw.close()
            # ... a compressed message inflating to 1 GiB
            raw = RawClient(node, sid, deflate=True)
            code_bomb, sent_bomb = raw.offend(RawClient.frame(2, bomb, rsv1=True), b"")
            raw.close()
            # guest → client: one byte over the cap, an endless frame, a compressed frame
            under = asyncio.run(guest_says(node, sid, f"send:{1 << 20}"))
            over = asyncio.run(guest_says(node, sid, f"send:{cap + 1}"))
            guest_endless = asyncio.run(guest_says(node, sid, "endless"))
            guest_bomb = asyncio.run(guest_says(node, sid, "bomb"))
        harm.check("endless and deflate-bomb WebSocket messages, both ways")
        print(f"[hostile] client sent before the close: endless frame {sent_endless} B, fragments "
              f"{sent_fragments >> 20} MiB, bomb {sent_bomb} B (inflating to 1 GiB)")

        assert code_endless == 1009 and sent_endless < (4 << 20), (code_endless, sent_endless)
        assert code_fragments == 1009 and sent_fragments < cap + (8 << 20), (code_fragments, sent_fragments)
        assert code_bomb == 1009 and sent_bomb == len(RawClient.frame(2, bomb, rsv1=True)), (code_bomb, sent_bomb)
        assert under == (None, b"g" * (1 << 20))
        assert over[0] == 1009 and "exceeds limit" in str(over[1]), over
        assert guest_endless[0] == 1009 and "exceeds limit" in str(guest_endless[1]), guest_endless
        assert guest_bomb[0] == 1002, guest_bomb       # compression was never negotiated with the guest
        assert asyncio.run(guest_says(node, sid, "again")) == (None, "echo:again")   # the guest's server lives on
        assert offender.commands.run("echo fine").stdout == "fine\n"
    finally:
        offender.kill()
