"""One keep-alive HTTP/1.1 connection to a test's server whose answers are timed by the
kernel's arrival stamp: the tests that bound how fast the node answers under load
(test_rl_load.py, hostile/) time the server, not this client's threads."""
from __future__ import annotations

import json
import socket
import statistics
import struct
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .conftest import Server


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]     # names in lower case
    body: Any
    seconds: float              # from the request's write to its answer's arrival (kernel time)


# Linux's SO_TIMESTAMPNS (= its control message's type): the kernel stamps each segment
# as it arrives, so a reply is timed by when the server's answer came in, not by when
# this client's thread (one of 33, on a busy machine) got round to reading it.
SO_TIMESTAMPNS = 35


class Conn:
    """One keep-alive HTTP/1.1 connection to the server, opened before anything is timed.
    A request goes out in one write (http.client writes a body apart from its head, and
    that second small write may wait for the server's delayed ACK: the client's delay,
    tens of milliseconds)."""

    def __init__(self, srv: Server, timeout: float = 600.0) -> None:
        url = urlsplit(srv.url)
        self.key = srv.api_key
        self.host = f"{url.hostname}:{url.port}"
        self.sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.buf = b""
        self.arrived = 0            # ns (CLOCK_REALTIME) the last segment read arrived

    def _fill(self) -> None:
        data, ancillary, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(16))
        if not data:
            raise ConnectionError("the server closed the connection")
        for level, kind, value in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = struct.unpack("qq", value[:16])
                self.arrived = max(self.arrived, sec * 1_000_000_000 + nsec)
        self.buf += data

    def call(self, method: str, path: str, body: Any = None, auth: bool = True) -> Answer:
        data = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}", f"Content-Length: {len(data)}"]
        if auth:
            head.append(f"X-API-Key: {self.key}")
        if body is not None:
            head.append("Content-Type: application/json")
        self.arrived = 0
        t0 = time.time_ns()
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        raw_head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        status_line, *lines = raw_head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        assert "transfer-encoding" not in headers, headers     # every answer here has a length
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._fill()
        payload, self.buf = self.buf[:length], self.buf[length:]
        if not self.arrived:    # a segment the kernel did not stamp (rare): when it was read
            self.arrived = time.time_ns()
        parsed = json.loads(payload) if payload and "json" in headers.get("content-type", "") else payload
        return Answer(int(status_line.split()[1]), headers, parsed, (self.arrived - t0) / 1e9)

    def close(self) -> None:
        self.sock.close()


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]
