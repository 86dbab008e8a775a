"""A minimal host-side client of the guest's envd (what the sandbox layer needs
itself: readiness, ``/init``, running one command). The wire format is E2B's
(see reference/e2b-wire.md): Connect over HTTP/1.1 with the JSON codec; a
server-streaming response is a sequence of ``[flags u8][length u32 BE][JSON]``
frames ending with a frame whose flags have bit 0x02 set.

Synchronous on purpose (http.client): callers run it in a worker thread."""
from __future__ import annotations

import base64
import http.client
import json
import struct
from dataclasses import dataclass

from .qemu.errors import VmError

END_STREAM = 0x02


class EnvdError(VmError):
    """envd answered with an error, or not in its protocol."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: bytes
    stderr: bytes


def encode_envelope(message: dict, flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def decode_envelopes(data: bytes) -> list[tuple[int, dict]]:
    """All frames of a complete server-streaming body (raises EnvdError when truncated)."""
    out = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < 5:
            raise EnvdError("truncated Connect frame header")
        flags, length = struct.unpack_from(">BI", data, pos)
        pos += 5
        if len(data) - pos < length:
            raise EnvdError("truncated Connect frame")
        try:
            msg = json.loads(data[pos:pos + length] or b"{}")
        except ValueError as e:
            raise EnvdError(f"bad JSON in Connect frame: {e}") from None
        out.append((flags, msg if isinstance(msg, dict) else {}))
        pos += length
    return out


def _request(port: int, method: str, path: str, body: bytes, headers: dict[str, str],
             timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise EnvdError(f"envd on port {port}: {method} {path}: {e}") from None
    finally:
        conn.close()


def init(port: int, body: dict, timeout: float = 10.0) -> None:
    status, data = _request(port, "POST", "/init", json.dumps(body).encode(),
                            {"Content-Type": "application/json"}, timeout)
    if not 200 <= status < 300:
        raise EnvdError(f"envd /init answered HTTP {status}: {data[:200]!r}")


def run_command(port: int, cmd: str, *, user: str = "root", timeout: float = 30.0) -> CommandResult:
    """``bash -l -c cmd`` in the guest as ``user``, the way the E2B SDK's commands.run does it."""
    body = encode_envelope({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {}}})
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
               "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode(),
               "Connect-Timeout-Ms": str(int(timeout * 1000))}
    status, data = _request(port, "POST", "/process.Process/Start", body, headers, timeout)
    if status != 200:
        raise EnvdError(f"envd process start answered HTTP {status}: {data[:200]!r}")
    out, err = bytearray(), bytearray()
    exit_code: int | None = None
    for flags, msg in decode_envelopes(data):
        if flags & END_STREAM:
            if msg.get("error"):
                raise EnvdError(f"envd process start failed: {msg['error']}")
            continue
        event = msg.get("event", {})
        if "data" in event:
            for key, buf in (("stdout", out), ("stderr", err)):
                if key in event["data"]:
                    buf += base64.b64decode(event["data"][key])
        if "end" in event:
            exit_code = int(event["end"].get("exitCode", 0))
    if exit_code is None:
        raise EnvdError("envd process stream ended without an end event")
    return CommandResult(exit_code, bytes(out), bytes(err))
