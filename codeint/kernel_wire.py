"""The channel between the server and a Python kernel process (pykernel.py): frames of
``be32 length | UTF-8 JSON object`` over a socketpair, stdlib only (both ends run on the
guest's Python).

Server → kernel: ``{"t": "exec", "code": str, "silent": bool}``, one at a time; the
next is sent only after the kernel's ``done``.
Kernel → server: ``{"t": "ready"}`` once after start-up; then per cell
``{"t": "count", "n"}`` (before the user's code runs), any number of
``{"t": "stream", "name": "stdout"|"stderr", "text", "ts"}``, ``{"t": "result",
"data": {mime: value}, "main": bool}`` and ``{"t": "error", "ename", "evalue",
"traceback": [str]}``, and ``{"t": "done"}`` last. Interrupts are SIGINT to the kernel's
process group, not messages.

Why not Jupyter's own protocol (ZeroMQ, HMAC-signed multipart messages, a tornado loop
in the kernel, jupyter_client here): measured in a TCG guest, a ``1`` took 224-512 ms
through jupyter_client and ipykernel against 32-55 ms for IPython's ``run_cell`` alone
(docs/code-interpreter.md, *Why a kernel of its own*)."""
from __future__ import annotations

import base64
import json
import struct
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME = 128 << 20     # a result bundle (a big DataFrame's HTML) may be large; streams are cut at 1 MiB


class WireError(Exception):
    """A frame that is not a JSON object or is larger than MAX_FRAME."""


def _default(value: Any) -> Any:
    # IPython's formatters give image/png and image/jpeg as bytes; Jupyter sends base64
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return str(value)


def encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, default=_default, ensure_ascii=False, separators=(",", ":")).encode("utf-8",
                                                                                               "surrogatepass")
    if len(body) > MAX_FRAME:
        raise WireError(f"a message of {len(body)} bytes is larger than {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise WireError(f"a frame of {n} bytes is larger than {MAX_FRAME}")
    return n


def decode(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body.decode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"a frame is not JSON: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise WireError("a frame is not a message object")
    return msg
