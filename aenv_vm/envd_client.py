"""A minimal host-side client of the guest's envd (what the sandbox layer needs
itself: ``/init``, running a command and moving a file the way the SDK does,
to warm pooled clones). The wire format is E2B's
(see reference/e2b-wire.md): Connect over HTTP/1.1 with the JSON codec; a
server-streaming response is a sequence of ``[flags u8][length u32 BE][JSON]``
frames ending with a frame whose flags have bit 0x02 set.

Synchronous on purpose (http.client): callers run it in a worker thread."""
from __future__ import annotations

import base64
import http.client
import json
import secrets
import struct
import urllib.parse
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
             timeout: float, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """``host``: 127.0.0.1 with user-mode networking, the sandbox's namespace address with tap."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise EnvdError(f"envd at {host}:{port}: {method} {path}: {e}") from None
    finally:
        conn.close()


def _auth(user: str | None, access_token: str | None) -> dict[str, str]:
    """Headers as the SDK sends them: no Authorization means envd's default user."""
    headers = {}
    if user is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
    if access_token:
        headers["X-Access-Token"] = access_token
    return headers


def init(port: int, body: dict, timeout: float = 10.0, access_token: str | None = None,
         host: str = "127.0.0.1") -> None:
    """POST /init. ``body`` may carry aenv's ``hostname`` and ``entropy`` (docs/envd.md)."""
    headers = {"Content-Type": "application/json", **_auth(None, access_token)}
    status, data = _request(port, "POST", "/init", json.dumps(body).encode(), headers, timeout, host)
    if not 200 <= status < 300:
        raise EnvdError(f"envd /init answered HTTP {status}: {data[:200]!r}")


def write_file(port: int, path: str, data: bytes, *, user: str | None = None, timeout: float = 30.0,
               access_token: str | None = None, host: str = "127.0.0.1") -> None:
    """Upload ``data`` to ``path`` as the SDK's ``files.write`` does for bytes (multipart/form-data)."""
    boundary = secrets.token_hex(16)
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path}\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    query = urllib.parse.urlencode({"path": path, **({"username": user} if user else {})})
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", **_auth(None, access_token)}
    status, answer = _request(port, "POST", f"/files?{query}", body, headers, timeout, host)
    if status != 200:
        raise EnvdError(f"envd file upload to {path} answered HTTP {status}: {answer[:200]!r}")


def read_file(port: int, path: str, *, user: str | None = None, timeout: float = 30.0,
              access_token: str | None = None, host: str = "127.0.0.1") -> bytes:
    """``GET /files`` as the SDK's ``files.read`` does."""
    query = urllib.parse.urlencode({"path": path, **({"username": user} if user else {})})
    status, data = _request(port, "GET", f"/files?{query}", b"", _auth(None, access_token), timeout, host)
    if status != 200:
        raise EnvdError(f"envd file download of {path} answered HTTP {status}: {data[:200]!r}")
    return data


def run_command(port: int, cmd: str, *, user: str | None = "root", timeout: float = 30.0,
                access_token: str | None = None, host: str = "127.0.0.1") -> CommandResult:
    """``bash -l -c cmd`` in the guest, the way the E2B SDK's ``commands.run`` does it
    (same request, same headers); ``user=None`` is the SDK's default: envd's default user."""
    body = encode_envelope({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {}}, "stdin": False})
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
               "Keepalive-Ping-Interval": "50", "Connect-Timeout-Ms": str(int(timeout * 1000)),
               **_auth(user, access_token)}
    status, data = _request(port, "POST", "/process.Process/Start", body, headers, timeout, host)
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
