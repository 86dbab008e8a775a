"""The sandbox's own environment variables (``Sandbox.create(envs=…)``), which envd
holds: kernels started when the template was built cannot have inherited them, so each
context takes them from envd's ``GET /envs`` before its first cell, with the access
token the SDK sent (a secured sandbox's envd demands it)."""
from __future__ import annotations

import asyncio
import json
import logging

from . import ENVD_PORT

log = logging.getLogger(__name__)


async def fetch_envs(access_token: str | None, port: int = ENVD_PORT, timeout: float = 10.0) -> dict[str, str]:
    """envd's envs; {} when envd is not there or refuses (logged). The answer is read by
    its own framing (Content-Length or chunked): envd keeps connections open."""
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
    except (OSError, TimeoutError, UnicodeEncodeError, ValueError, asyncio.IncompleteReadError) as e:
        log.warning("envd /envs unreachable: %s", e)
        return {}
    if status != 200:
        log.warning("envd /envs answered %d", status)
        return {}
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(value, dict) else {}


MAX_ENVS_BODY = 4 << 20


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
