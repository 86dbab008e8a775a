"""A guest floods the node's DNS forwarder and egress proxy (issue 28), as root, while a
neighbour on the same node keeps working and keeps resolving names.

Nothing leaves the machine: both sandboxes' resolver is a DNS server this test runs on
127.0.0.77:53 (``dnsServers``, its /32 allowed explicitly), the offender may reach
nothing else (``denyOut 0.0.0.0/0``), and its proxied connections name a host it may
not reach, so the proxy refuses every one without connecting anywhere.

The offender, for ~15 s: UDP queries to 10.0.2.3:53 as fast as its vCPU sends them;
200 TCP connections to port 80 of an address it may not reach (redirected to the node's
egress proxy) held open without a word; 200 held open to TCP 53; then connections to
the proxy asking for a host it may not reach, one after the other. The bounds
([vm] dns_rate, dns_burst, dns_queue, egress_connections; aenv_vm/net/bounds.py) say
what may reach the upstream server and how many connections the node holds."""
from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from ..conftest import Server
from .watch import watching

pytestmark = [pytest.mark.qemu]

RESOLVER = "127.0.0.77"
ANSWER = "192.0.2.1"
FLOOD_SECONDS = 15
RATE, BURST, CONNECTIONS = 200, 400, 64      # the defaults of [vm] dns_rate, dns_burst, egress_connections

OFFENDER = r"""
import json, socket, struct, threading, time
END = time.time() + %(seconds)d
def query(i, name):
    labels = b"".join(bytes([len(p)]) + p for p in name.split(b"."))
    return struct.pack(">HHHHHH", i & 0xFFFF, 0x0100, 1, 0, 0, 0) + labels + b"\x00\x00\x01\x00\x01"
sent = [0]
def udp_flood():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    packets = [query(i, b"flood.test") for i in range(256)]
    while time.time() < END:
        for p in packets:
            try:
                s.sendto(p, ("10.0.2.3", 53))
                sent[0] += 1
            except (BlockingIOError, OSError):
                pass
        try:
            while True:
                s.recv(512)
        except (BlockingIOError, OSError):
            pass
t = threading.Thread(target=udp_flood)
t.start()
def hold(addr, n):
    conns = []
    for _ in range(n):
        c = socket.socket()
        c.settimeout(5)
        try:
            c.connect(addr)
            conns.append(c)
        except OSError:
            c.close()
    time.sleep(2)
    held = reset = 0
    for c in conns:
        c.setblocking(False)
        try:
            c.recv(1)           # an answer or EOF at once: not held
            reset += 1
        except BlockingIOError:
            held += 1
        except OSError:
            reset += 1
        c.close()
    return {"opened": len(conns), "held": held, "closed": reset}
out = {"proxy": hold(("198.51.100.1", 80), 200),
       "dns_tcp": hold(("10.0.2.3", 53), 200)}
refused = 0
while time.time() < END:
    c = socket.socket()
    c.settimeout(5)
    try:
        c.connect(("198.51.100.1", 80))
        c.sendall(b"GET / HTTP/1.1\r\nHost: denied.test\r\n\r\n")
        if c.recv(1) == b"":
            refused += 1
    except OSError:
        refused += 1
    finally:
        c.close()
t.join()
out["refused"] = refused
out["udp_sent"] = sent[0]
print(json.dumps(out))
"""


class LoopbackResolver:
    """A DNS server on 127.0.0.77:53 (UDP and TCP): every A query gets ``ANSWER``; what it
    was asked is counted by the query's first label."""

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()
        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._udp.bind((RESOLVER, 53))
        self._tcp = socket.socket()
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind((RESOLVER, 53))
        self._tcp.listen(64)
        self._stop = False
        self._threads = [threading.Thread(target=self._serve_udp, daemon=True),
                         threading.Thread(target=self._serve_tcp, daemon=True)]
        for t in self._threads:
            t.start()

    def _answer(self, q: bytes) -> bytes | None:
        if len(q) < 17:
            return None
        end = q.index(b"\x00", 12) + 5
        self.asked[q[13:13 + q[12]].decode(errors="replace")] += 1
        rr = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(ANSWER)
        return q[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + q[12:end] + rr

    def _serve_udp(self) -> None:
        self._udp.settimeout(0.2)
        while not self._stop:
            try:
                q, addr = self._udp.recvfrom(4096)
            except (TimeoutError, OSError):
                continue
            a = self._answer(q)
            if a:
                self._udp.sendto(a, addr)

    def _serve_tcp(self) -> None:
        self._tcp.settimeout(0.2)
        while not self._stop:
            try:
                c, _ = self._tcp.accept()
            except (TimeoutError, OSError):
                continue
            with c:
                c.settimeout(2)
                try:
                    (n,) = struct.unpack(">H", c.recv(2))
                    a = self._answer(c.recv(n))
                    if a:
                        c.sendall(struct.pack(">H", len(a)) + a)
                except (OSError, struct.error, ValueError):
                    pass

    def close(self) -> None:
        self._stop = True
        for t in self._threads:
            t.join(5)
        self._udp.close()
        self._tcp.close()


@pytest.fixture
def resolver() -> Iterator[LoopbackResolver]:
    r = LoopbackResolver()
    try:
        yield r
    finally:
        r.close()


def _dropped(node: Server) -> dict[tuple[str, str], float]:
    status, _, text = node.request("GET", "/metrics")
    assert status == 200
    body = text.decode() if isinstance(text, bytes) else str(text)
    return {(m[1], m[0]): float(m[2]) for m in
            re.findall(r'aenv_guest_dropped_total\{service="(\w+)",reason="(\w+)"\} (\S+)', body)}


def test_a_dns_and_egress_flood_harms_nobody(node: Server, neighbour: Any, resolver: LoopbackResolver) -> None:
    from e2b import Sandbox

    ours = {"allowOut": [f"{RESOLVER}/32"], "dnsServers": [RESOLVER]}
    status, _, body = node.request("PUT", f"/sandboxes/{neighbour.sandbox_id}/network", ours)
    assert status in (200, 204), (status, body)
    status, _, made = node.request("POST", "/sandboxes", {
        "templateID": "base", "timeout": 300,
        "network": {"allowOut": [f"{RESOLVER}/32", "allowed.test"], "denyOut": ["0.0.0.0/0"],
                    "dnsServers": [RESOLVER]}})
    assert status == 201, (status, made)
    offender = Sandbox.connect(made["sandboxID"])
    before = _dropped(node)
    try:
        offender.files.write("/tmp/flood.py", OFFENDER % {"seconds": FLOOD_SECONDS})
        resolved: list[str] = []
        with watching(node, neighbour) as harm:
            flood = offender.commands.run("python3 /tmp/flood.py", user="root", background=True)
            time.sleep(FLOOD_SECONDS / 3)
            # the neighbour resolves through the same forwarder during the flood (its own bucket)
            for _ in range(3):
                r = neighbour.commands.run(
                    "python3 -c \"import socket; print(socket.gethostbyname('neighbour.test'))\"", timeout=30)
                resolved.append(r.stdout.strip())
            result = flood.wait()
        harm.check("DNS and egress-proxy flood")
        report = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"[hostile] offender: {report}; upstream asked {dict(resolver.asked)}")
        assert resolved == [ANSWER] * 3
        # what reached the upstream server: the bucket's burst and rate, not the flood
        flood_asked = resolver.asked["flood"]
        assert report["udp_sent"] > 5 * (BURST + RATE * (FLOOD_SECONDS + 5)), report
        assert 0 < flood_asked <= BURST + RATE * (FLOOD_SECONDS + 5)
        # connections beyond the cap were closed at once, the rest held (sniffing)
        for kind in ("proxy", "dns_tcp"):
            assert report[kind]["opened"] > CONNECTIONS and report[kind]["held"] <= CONNECTIONS, report
            assert report[kind]["closed"] >= report[kind]["opened"] - CONNECTIONS, report
        assert report["refused"] > 0
        after = _dropped(node)
        assert after[("rate", "dns")] - before.get(("rate", "dns"), 0) > 0
        assert after[("connections", "egress")] - before.get(("connections", "egress"), 0) >= \
            2 * (200 - CONNECTIONS) - 10
        # the node and the neighbour still work
        assert neighbour.commands.run("true").exit_code == 0
        assert offender.commands.run("echo alive").stdout.strip() == "alive"
        assert node.request("GET", "/health")[0] in (200, 204)
    finally:
        offender.kill()
