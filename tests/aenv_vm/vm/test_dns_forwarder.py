"""The node's DNS forwarder (aenv_vm/net/dns.py) on a real datagram endpoint of the
event loop, on loopback: what a guest's resolver sees when its sandbox may ask no
server (REFUSED, the same id and question), and that junk gets no answer."""
from __future__ import annotations

import asyncio
import socket
import struct

from aenv_vm.net import dns


def _query(qid: int) -> bytes:
    question = b"".join(bytes([len(p)]) + p for p in (b"allowed", b"test")) + b"\x00" + struct.pack(">HH", 1, 1)
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question


def test_a_sandbox_without_servers_gets_refused_over_udp() -> None:
    async def main() -> tuple[bytes, bool]:
        loop = asyncio.get_running_loop()
        forwarder = dns.Forwarder(lambda: [])
        transport, server = await loop.create_datagram_endpoint(lambda: dns.UdpServer(forwarder),
                                                                local_addr=("127.0.0.1", 0))
        port = transport.get_extra_info("sockname")[1]
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.setblocking(False)
        try:
            client.sendto(b"\x00\x01junk", ("127.0.0.1", port))            # too short: no answer
            client.sendto(_query(0x4242), ("127.0.0.1", port))
            answer = await asyncio.wait_for(loop.sock_recv(client, 512), 5)
            await asyncio.sleep(0.1)
            try:
                client.recv(512)
                extra = True
            except BlockingIOError:
                extra = False
            return answer, extra
        finally:
            client.close()
            server.close()

    answer, extra = asyncio.run(main())
    qid, flags, qd, an = struct.unpack_from(">HHHH", answer)
    assert qid == 0x4242 and flags & 0x8000 and flags & 0x000F == 5 and qd == 1 and an == 0
    assert answer[12:] == _query(0x4242)[12:]          # the question, echoed
    assert not extra                                    # the junk got nothing
