"""Response values that handlers return and the server writes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncGenerator, BinaryIO


@dataclass(frozen=True)
class Response:
    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    # When set, the body is streamed: with Content-Length if the headers carry
    # one, else chunked. Each item is flushed before the next is produced; the
    # writer closes the generator (aclose) when it is done with it.
    stream: AsyncGenerator[bytes, None] | None = None
    # A file sent as the whole body with the kernel's sendfile (Content-Length
    # must be in the headers); closed after sending.
    file: BinaryIO | None = None


def json_response(status: int, value: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, (("Content-Type", "application/json"), *headers), json.dumps(value).encode())


def http_error(status: int, message: str) -> Response:
    """envd.yaml's Error schema: ``{"code": <http status>, "message": ...}``."""
    return json_response(status, {"code": status, "message": message})
