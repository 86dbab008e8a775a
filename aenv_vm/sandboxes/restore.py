"""One envd ``/init`` as the first request to a freshly restored clone.

A clone restored from a snapshot of a running guest has envd listening from its
first instruction on, so a separate ``GET /health`` before ``/init`` only costs
a request: under TCG every request early in a clone's life is paid mostly in
code translation (the kernel's network path, envd's Python), and a fork of 16
pays it 16 times on two cores. This posts ``/init`` (identity, clock and, for a
fork child, the new access token: one body) until envd answers, from the event
loop (no worker thread per child: the default pool's 6 threads queued 16
children's requests).

Retrying is safe: ``/init`` is idempotent, and envd accepts a body whose
``accessToken`` equals the token in force, so a retry after an answer that was
lost still authenticates.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from ..guest import http_request
from ..qemu.errors import VmError, VmTimeout
from .errors import SnapshotError


async def init_when_ready(host: str, port: int, body: dict, access_token: str | None, timeout: float,
                          alive: Callable[[], bool] | None = None) -> float:
    """POST ``body`` to envd ``/init`` until it answers; returns the seconds it took.
    A non-2xx answer is an error at once (envd answered: retrying would not change it)."""
    start = time.monotonic()
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if access_token:
        headers["X-Access-Token"] = access_token
    last: object = None
    while True:
        left = timeout - (time.monotonic() - start)
        try:
            # one long attempt: under load the first answer can take seconds, and a
            # retry after a client-side timeout would make the guest do it twice
            status, data = await http_request("POST", port, "/init", body=raw, headers=headers,
                                              timeout=max(left, 0.1), host=host)
        except (OSError, asyncio.TimeoutError, ConnectionError) as e:
            last = e
        else:
            if 200 <= status < 300:
                return time.monotonic() - start
            raise SnapshotError(f"envd /init on port {port} answered HTTP {status}: {data[:200]!r}")
        if alive is not None and not alive():
            raise VmError(f"VM exited before envd /init on port {port} answered (last: {last})")
        if time.monotonic() - start > timeout:
            raise VmTimeout(f"envd /init on port {port} did not answer within {timeout} s (last: {last})")
        await asyncio.sleep(0.02)
