"""JSON request bodies as both servers read them."""
from __future__ import annotations

# RFC 8259's whitespace; bytes.strip() would also take \x0b and \x0c, turning such a
# body into "no body" instead of the invalid JSON it is
JSON_WHITESPACE = b" \t\r\n"


def is_blank(raw: bytes) -> bool:
    """No JSON value at all: empty, or only JSON whitespace (the request has no body)."""
    return not raw.strip(JSON_WHITESPACE)
