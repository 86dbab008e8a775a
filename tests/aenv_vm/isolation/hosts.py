"""The test's own hosts, each run inside a network namespace the test made:

    python -m tests.aenv_vm.isolation.hosts inet LOG     an "internet" host: HTTP on 80 (answers
                                                 the Host it got), a TLS-ish peer on 443
                                                 (answers once it got a ClientHello), TCP
                                                 8080, and DNS on 53 (UDP and TCP) with
                                                 the names of NAMES, a UDP echo on 9053
    python -m tests.aenv_vm.isolation.hosts lan LOG      a "private" host: TCP 7777 and HTTP 80 on
                                                 every address

Every accepted connection is logged to LOG as ``<port> <peer address>`` (the test
asserts on who reached what), and ``ready`` is printed once everything listens.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import sys

INET_IP = "203.0.113.10"       # documentation ranges only (RFC 5737)
OTHER_INET_IP = "198.51.100.10"
LAN_PORT = 7777
UDP_ECHO_PORT = 9053
NAMES = {
    "inet.test": INET_IP,
    "allowed.test": INET_IP,
    "www.allowed.test": INET_IP,
    "other.test": INET_IP,          # another name on the same address as allowed.test
    "far.test": OTHER_INET_IP,
    "rebind.test": "10.99.0.10",    # a public name resolving into a private range
    "secret.test": "192.0.2.10",    # the secrets test's own host (secrethost.py): a ruled name
    "unruled.test": "192.0.2.10",   # ... and a name on it without a rule
}
# a name only the resolver on OTHER_INET_IP knows (who asked which resolver)
OTHER_NAMES = {**NAMES, "only-other.test": OTHER_INET_IP}


def dns_answer(query: bytes, names: dict[str, str] = NAMES) -> bytes | None:
    if len(query) < 12:
        return None
    qid, _flags, qd = struct.unpack_from(">HHH", query)
    pos, labels = 12, []
    while pos < len(query) and query[pos]:
        n = query[pos]
        labels.append(query[pos + 1:pos + 1 + n].decode(errors="replace"))
        pos += 1 + n
    question = query[12:pos + 5]
    qtype = struct.unpack_from(">H", query, pos + 1)[0] if pos + 3 <= len(query) else 0
    ip = names.get(".".join(labels).lower())
    if ip is None or qtype != 1:
        rcode = 3 if ip is None else 0
        return struct.pack(">HHHHHH", qid, 0x8400 | rcode, 1, 0, 0, 0) + question
    answer = struct.pack(">HHHLH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip)
    return struct.pack(">HHHHHH", qid, 0x8400, 1, 1, 0, 0) + question + answer


def main(role: str, log_path: str) -> None:
    log = open(log_path, "a", buffering=1)

    def logged(port: int, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        log.write(f"{port} {peer[0] if peer else '?'}\n")

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        logged(80, writer)
        head = await reader.readuntil(b"\r\n\r\n")
        host = next((line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                     if line.lower().startswith(b"host:")), b"?")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\ninet " + host + b"\n")
        await writer.drain()
        writer.close()

    async def tls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        logged(443, writer)
        first = await reader.read(4096)
        writer.write(b"tls-peer-ok\n" if first[:1] == b"\x16" else b"not-tls\n")
        await writer.drain()
        writer.close()

    def plain(port: int, reply: bytes):  # type: ignore[no-untyped-def]
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            logged(port, writer)
            writer.write(reply)
            await writer.drain()
            writer.close()
        return handle

    def dns_tcp(names: dict[str, str]):  # type: ignore[no-untyped-def]
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            (n,) = struct.unpack(">H", await reader.readexactly(2))
            answer = dns_answer(await reader.readexactly(n), names)
            if answer:
                writer.write(struct.pack(">H", len(answer)) + answer)
                await writer.drain()
            writer.close()
        return handle

    class Echo(asyncio.DatagramProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            log.write(f"{UDP_ECHO_PORT}/udp {addr[0]}\n")
            self.transport.sendto(b"echo " + data, addr)  # type: ignore[attr-defined]

    class DnsUdp(asyncio.DatagramProtocol):
        def __init__(self, names: dict[str, str]) -> None:
            self.names = names

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            answer = dns_answer(data, self.names)
            if answer:
                self.transport.sendto(answer, addr)  # type: ignore[attr-defined]

    async def run() -> None:
        servers = []
        if role == "inet":
            for ip in (INET_IP, OTHER_INET_IP):     # 192.0.2.10's 80 and 443 are secrethost.py's
                servers.append(await asyncio.start_server(http, ip, 80))
                servers.append(await asyncio.start_server(tls, ip, 443))
            servers.append(await asyncio.start_server(plain(8080, b"inet-8080\n"), "0.0.0.0", 8080))
            for ip, names in ((INET_IP, NAMES), (OTHER_INET_IP, OTHER_NAMES)):
                servers.append(await asyncio.start_server(dns_tcp(names), ip, 53))
                await asyncio.get_running_loop().create_datagram_endpoint(lambda n=names: DnsUdp(n),
                                                                          local_addr=(ip, 53))
            await asyncio.get_running_loop().create_datagram_endpoint(Echo, local_addr=("0.0.0.0", UDP_ECHO_PORT))
        else:
            servers.append(await asyncio.start_server(plain(LAN_PORT, b"lan\n"), "0.0.0.0", LAN_PORT))
            servers.append(await asyncio.start_server(http, "0.0.0.0", 80))
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
