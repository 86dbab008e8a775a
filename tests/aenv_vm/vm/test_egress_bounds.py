"""What one sandbox may ask of the node's DNS forwarder (aenv_vm/net/bounds.py, dns.py):
the token bucket never gives more than its burst plus its rate over the time given; a
flood of datagrams beyond the rate, or beyond the queries outstanding at a server that
never answers (a loopback socket the test holds), is dropped and counted, and no task
is made for a dropped one."""
from __future__ import annotations

import asyncio
import socket
import struct

import pytest
from hypothesis import given, settings, strategies as st

from aenv_store.errors import ConfigError
from aenv_vm.net import dns
from aenv_vm.net.bounds import Drops, EgressLimits, TokenBucket


@settings(max_examples=200, deadline=None)
@given(st.floats(0.5, 5000), st.integers(1, 500), st.lists(st.floats(0, 2), max_size=300))
def test_the_bucket_gives_no_more_than_burst_plus_rate_times_time(rate: float, burst: int,
                                                                   gaps: list[float]) -> None:
    bucket = TokenBucket(rate, burst, 100.0)
    now, taken = 100.0, 0
    for gap in gaps:
        now += gap
        taken += bucket.take(now)
        assert taken <= burst + rate * (now - 100.0) + 1e-6
    # and after a quiet spell a whole burst is there again
    now += burst / rate + 1
    assert all(bucket.take(now) for _ in range(burst))


def test_limits_out_of_range_are_config_errors() -> None:
    for bad in ({"dns_rate": 0}, {"dns_burst": 0}, {"dns_queue": 0}, {"connections": 0}, {"buffer": 1024}):
        with pytest.raises(ConfigError):
            EgressLimits(**bad)  # type: ignore[arg-type]


def _query(qid: int) -> bytes:
    question = b"\x04test\x00" + struct.pack(">HH", 1, 1)
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question


def test_a_flood_beyond_the_rate_is_dropped_before_any_task() -> None:
    async def main() -> tuple[int, Drops, int]:
        drops = Drops()
        clock = [0.0]           # time stands still: only the burst is there
        forwarder = dns.Forwarder(lambda: [], EgressLimits(dns_rate=10, dns_burst=20), drops, lambda: clock[0])
        loop = asyncio.get_running_loop()
        transport, server = await loop.create_datagram_endpoint(lambda: dns.UdpServer(forwarder),
                                                                local_addr=("127.0.0.1", 0))
        port = transport.get_extra_info("sockname")[1]
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.setblocking(False)
        answers = 0
        try:
            for i in range(200):
                client.sendto(_query(i), ("127.0.0.1", port))
                await asyncio.sleep(0)
            most_tasks = len(server._tasks)
            await asyncio.sleep(0.2)
            while True:
                try:
                    client.recv(512)
                    answers += 1
                except BlockingIOError:
                    break
        finally:
            client.close()
            server.close()
        return answers, drops, most_tasks

    answers, drops, most_tasks = asyncio.run(main())
    assert answers == 20 and drops.dns_rate == 180 and drops.dns_queue == 0 and most_tasks <= 20


def test_queries_beyond_the_queue_at_a_silent_server_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)      # receives, never answers
    silent.bind(("127.0.0.1", 0))
    monkeypatch.setattr(dns, "DNS_PORT", silent.getsockname()[1])

    async def main() -> tuple[Drops, int, int]:
        drops = Drops()
        forwarder = dns.Forwarder(lambda: ["127.0.0.1"], EgressLimits(dns_queue=8), drops)
        udp = dns.UdpServer(forwarder)
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: udp, local_addr=("127.0.0.1", 0))
        try:
            for i in range(50):
                udp.datagram_received(_query(i), ("127.0.0.1", 9))
                await asyncio.sleep(0)
            await asyncio.sleep(0.1)
            outstanding = forwarder.outstanding
            silent.setblocking(False)
            got = 0
            while True:
                try:
                    silent.recv(512)
                    got += 1
                except BlockingIOError:
                    break
            return drops, outstanding, got
        finally:
            udp.close()
            transport.close()

    try:
        drops, outstanding, got = asyncio.run(main())
    finally:
        silent.close()
    assert outstanding == 8 and got == 8 and drops.dns_queue == 42 and drops.dns_rate == 0
