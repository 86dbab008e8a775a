"""The node's DNS forwarder for one sandbox.

Every DNS packet a guest sends (UDP or TCP port 53, to any address: QEMU's
built-in resolver 10.0.2.3 in user mode, the tap side's 10.0.2.3 in tap mode,
or anything else) is redirected by the sandbox namespace's nftables table to a
listener of this forwarder inside that namespace (rules.py). It relays the
query, from the node's own namespace, to the sandbox's ``dns_servers`` or the
node's upstream resolvers, and the answer back. So a sandbox denied private
ranges still resolves names without reaching the host's (often private)
resolver itself, and ``dns_servers: []`` means no DNS at all (REFUSED).

The message handling is pure (``refused``, ``well_formed``); the asyncio
parts only move bytes, on the node's guest-facing loop (aenv_vm/guestio.py). A
guest cannot make the node do or hold much (bounds.py): a datagram over its
sandbox's query rate or beyond its outstanding queries is dropped before any task
or socket is made for it (counted in ``Drops``), and every upstream exchange times out.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from pathlib import Path
from typing import Callable, Sequence, cast

from .bounds import Drops, EgressLimits, TokenBucket

log = logging.getLogger(__name__)

DNS_PORT = 53
UPSTREAM_TIMEOUT = 2.0      # seconds per upstream server and query
TCP_IDLE = 10.0             # seconds a DNS-over-TCP connection may wait for its next query
MAX_MESSAGE = 65535


def well_formed(msg: bytes) -> bool:
    """A query worth forwarding: a header, QR clear (a question, not an answer)."""
    return 12 <= len(msg) <= MAX_MESSAGE and not msg[2] & 0x80


def refused(query: bytes) -> bytes:
    """A REFUSED answer to ``query``: same id and question, QR and RA set, RCODE 5."""
    qid, flags = struct.unpack_from(">HH", query)
    flags = (flags | 0x8080) & ~0x000F | 5      # QR, RA, RCODE=REFUSED
    qdcount = struct.unpack_from(">H", query, 4)[0]
    return struct.pack(">HHHHHH", qid, flags, qdcount, 0, 0, 0) + query[12:]


def nameservers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The node's IPv4 resolvers (from its own namespace's view: a loopback one such as
    systemd-resolved's 127.0.0.53 is fine, the forwarder runs on the node)."""
    out: list[str] = []
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver" and parts[1].count(".") == 3:
            out.append(parts[1])
    return out


async def ask_udp(server: str, query: bytes, timeout: float = UPSTREAM_TIMEOUT) -> bytes:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[bytes] = loop.create_future()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            if not answer.done() and data[:2] == query[:2]:
                answer.set_result(data)

        def error_received(self, exc: Exception) -> None:
            if not answer.done():
                answer.set_exception(exc)

    transport, _ = await loop.create_datagram_endpoint(Client, remote_addr=(server, DNS_PORT))
    try:
        transport.sendto(query)
        return await asyncio.wait_for(answer, timeout)
    finally:
        transport.close()


async def ask_tcp(server: str, query: bytes, timeout: float = UPSTREAM_TIMEOUT) -> bytes:
    async def go() -> bytes:
        reader, writer = await asyncio.open_connection(server, DNS_PORT)
        try:
            writer.write(struct.pack(">H", len(query)) + query)
            await writer.drain()
            (n,) = struct.unpack(">H", await reader.readexactly(2))
            return await reader.readexactly(n)
        finally:
            writer.close()
    return await asyncio.wait_for(go(), timeout)


class Forwarder:
    """One sandbox's forwarder: ``servers()`` says where its queries go now. ``admit``
    first: a query it refuses is dropped (and counted in ``drops``)."""

    def __init__(self, servers: Callable[[], Sequence[str]], limits: EgressLimits = EgressLimits(),
                 drops: Drops | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.servers = servers
        self.limits = limits
        self.drops = drops if drops is not None else Drops()
        self.clock = clock
        self._bucket = TokenBucket(limits.dns_rate, limits.dns_burst, clock())
        self.outstanding = 0        # queries admitted and not answered (or given up) yet

    def admit(self) -> bool:
        """Whether one more query may be worked on now (its rate, then its queue)."""
        if self.outstanding >= self.limits.dns_queue:
            self.drops.count("dns_queue")
            return False
        if not self._bucket.take(self.clock()):
            self.drops.count("dns_rate")
            return False
        return True

    async def answer(self, query: bytes, tcp: bool) -> bytes | None:
        """The answer to an admitted ``query`` (None: none, as for a lost packet)."""
        if not well_formed(query):
            return None
        servers = list(self.servers())
        if not servers:
            return refused(query)
        self.outstanding += 1
        try:
            for server in servers:
                try:
                    return await (ask_tcp if tcp else ask_udp)(server, query)
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                    log.debug("dns: %s did not answer: %s", server, e)
        finally:
            self.outstanding -= 1
        return None     # the guest's resolver retries or gives up, as with a lost packet


class UdpServer(asyncio.DatagramProtocol):
    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder
        self.transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a datagram endpoint's transport (CPython 3.11's selector transport is not a
        # DatagramTransport subclass, so no isinstance narrowing here)
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        # checked before anything is made for the datagram: a flood costs a counter each
        if not well_formed(data) or not self.forwarder.admit():
            return
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, query: bytes, addr: tuple[str, int]) -> None:
        answer = await self.forwarder.answer(query, tcp=False)
        if answer is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(answer, addr)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        for task in self._tasks:
            task.cancel()


async def serve_tcp(forwarder: Forwarder, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """DNS over TCP: length-prefixed messages until the client closes (or is idle 10 s).
    A query the forwarder does not admit closes the connection."""
    try:
        while True:
            (n,) = struct.unpack(">H", await asyncio.wait_for(reader.readexactly(2), TCP_IDLE))
            query = await asyncio.wait_for(reader.readexactly(n), TCP_IDLE)
            if not well_formed(query) or not forwarder.admit():
                break
            answer = await forwarder.answer(query, tcp=True)
            if answer is None:
                break
            writer.write(struct.pack(">H", len(answer)) + answer)
            await writer.drain()
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
