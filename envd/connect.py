"""Connect protocol framing and errors, sans-IO.

Everything here is a pure function or a small state machine over bytes: the
asyncio server only moves bytes to and from it, so every corner of the wire
format is testable (and fuzzed) with plain byte strings.

Wire facts (connectrpc.com/docs/protocol):
- Streaming bodies are a sequence of envelopes ``[flags u8][len u32 BE][data]``.
  Flag 0x01 = compressed, 0x02 = end-of-stream (server to client only, its
  data is a JSON object ``{"error"?: {...}, "metadata"?: {...}}``).
- Unary errors are a non-200 status with a JSON body ``{"code", "message"}``;
  streaming errors travel in the end-of-stream envelope of a 200 response.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
HEADER_LEN = 5
# Largest request envelope envd accepts. Process input and filesystem requests
# are small JSON; file contents go over plain HTTP, not RPC.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class Code(enum.Enum):
    """Connect error codes with the HTTP status the protocol assigns each."""

    CANCELED = ("canceled", 499)
    UNKNOWN = ("unknown", 500)
    INVALID_ARGUMENT = ("invalid_argument", 400)
    DEADLINE_EXCEEDED = ("deadline_exceeded", 504)
    NOT_FOUND = ("not_found", 404)
    ALREADY_EXISTS = ("already_exists", 409)
    PERMISSION_DENIED = ("permission_denied", 403)
    RESOURCE_EXHAUSTED = ("resource_exhausted", 429)
    FAILED_PRECONDITION = ("failed_precondition", 400)
    ABORTED = ("aborted", 409)
    OUT_OF_RANGE = ("out_of_range", 400)
    UNIMPLEMENTED = ("unimplemented", 501)
    INTERNAL = ("internal", 500)
    UNAVAILABLE = ("unavailable", 503)
    DATA_LOSS = ("data_loss", 500)
    UNAUTHENTICATED = ("unauthenticated", 401)

    @property
    def wire(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]


class ConnectError(Exception):
    """An RPC failure that is reported to the client with a Connect code."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code.wire, "message": self.message}


def unary_error_body(err: ConnectError) -> bytes:
    return json.dumps(err.to_dict()).encode()


def encode_envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def encode_message(message: dict[str, Any]) -> bytes:
    """One data envelope carrying ``message`` as compact JSON."""
    return encode_envelope(json.dumps(message, separators=(",", ":")).encode())


def encode_end_stream(error: ConnectError | None = None) -> bytes:
    body: dict[str, Any] = {} if error is None else {"error": error.to_dict()}
    return encode_envelope(json.dumps(body).encode(), FLAG_END_STREAM)


@dataclass(frozen=True)
class Envelope:
    flags: int
    data: bytes


class EnvelopeDecoder:
    """Incremental envelope parser: feed bytes, get complete envelopes.

    Raises ConnectError(INVALID_ARGUMENT) on a compressed envelope (envd
    negotiates identity only), an end-stream flag from a client, or an
    oversized length; the caller then fails the RPC without reading further.
    """

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_message_bytes

    def feed(self, data: bytes) -> list[Envelope]:
        self._buf += data
        out: list[Envelope] = []
        while len(self._buf) >= HEADER_LEN:
            flags, length = struct.unpack_from(">BI", self._buf)
            if flags & FLAG_COMPRESSED:
                raise ConnectError(Code.INVALID_ARGUMENT, "compressed envelopes are not supported")
            if flags != 0:
                raise ConnectError(Code.INVALID_ARGUMENT, f"invalid envelope flags 0x{flags:02x}")
            if length > self._max:
                raise ConnectError(
                    Code.RESOURCE_EXHAUSTED, f"message of {length} bytes exceeds {self._max}"
                )
            if len(self._buf) < HEADER_LEN + length:
                break
            out.append(Envelope(flags, bytes(self._buf[HEADER_LEN : HEADER_LEN + length])))
            del self._buf[: HEADER_LEN + length]
        return out

    def finish(self) -> None:
        """Call at end of body: leftover bytes mean a truncated envelope."""
        if self._buf:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"truncated envelope: {len(self._buf)} trailing bytes"
            )


def decode_envelopes(body: bytes) -> list[Envelope]:
    """All envelopes of a complete body (server-streaming requests carry one)."""
    dec = EnvelopeDecoder()
    envs = dec.feed(body)
    dec.finish()
    return envs


def decode_json_message(data: bytes) -> dict[str, Any]:
    """A request message: must be a JSON object."""
    try:
        value = json.loads(data) if data.strip() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise ConnectError(Code.INVALID_ARGUMENT, f"invalid JSON message: {e}") from None
    if not isinstance(value, dict):
        raise ConnectError(Code.INVALID_ARGUMENT, "message must be a JSON object")
    return value


def parse_timeout_ms(value: str | None) -> int | None:
    """``Connect-Timeout-Ms``: at most 10 ASCII digits (protocol rule)."""
    if value is None or value == "":
        return None
    if len(value) > 10 or not value.isascii() or not value.isdigit():
        raise ConnectError(Code.INVALID_ARGUMENT, f"invalid connect-timeout-ms {value!r}")
    return int(value)
