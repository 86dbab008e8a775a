"""The sandbox's own environment variables (``Sandbox.create(envs=…)``), which envd
holds, and the check of the envd access token that comes with them.

Kernels started when the template was built cannot have inherited the sandbox's envs,
so each context takes them from envd's ``GET /envs`` before its first cell, with the
access token the SDK sent. The same call is the token check of ``/execute``: envd is
the one holder of the sandbox's token (the node re-keys it at every restore through
``/init``), and it answers ``/envs`` 401 to a wrong or missing token exactly when it
guards its own API, so the code interpreter refuses what envd would refuse."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from . import ENVD_PORT

MAX_ENVS_BODY = 4 << 20


class EnvdUnreachable(Exception):
    """envd did not answer ``/envs`` (not running, timed out, a malformed answer)."""


@dataclass(frozen=True)
class EnvsAnswer:
    status: int                     # envd's HTTP status
    envs: dict[str, str] | None     # the sandbox's envs when status is 200, else None

    @property
    def refused(self) -> bool:
        return self.status in (401, 403)


async def fetch_envs(access_token: str | None, port: int = ENVD_PORT, timeout: float = 10.0) -> EnvsAnswer:
    """envd's answer to ``GET /envs`` with ``access_token``; EnvdUnreachable when there is
    none. The answer is read by its own framing (Content-Length or chunked): envd keeps
    connections open."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                head = f"GET /envs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
                if access_token:
                    head += f"X-Access-Token: {access_token}\r\n"
                writer.write((head + "\r\n").encode("latin-1"))
                status, body = await _read_response(reader)
            finally:
                writer.close()
    except (OSError, TimeoutError, UnicodeEncodeError, ValueError, IndexError, asyncio.IncompleteReadError,
            asyncio.LimitOverrunError) as e:
        raise EnvdUnreachable(str(e) or type(e).__name__) from None
    if status != 200:
        return EnvsAnswer(status, None)
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    envs = {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(value, dict) else {}
    return EnvsAnswer(status, envs)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    lines = head.split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0 or len(out) + size > MAX_ENVS_BODY:
                return status, bytes(out)
            out += await reader.readexactly(size + 2)
            del out[-2:]
    length = int(headers.get("content-length", "0"))
    if length > MAX_ENVS_BODY:
        raise ValueError(f"envd /envs answer of {length} bytes")
    return status, await reader.readexactly(length)
