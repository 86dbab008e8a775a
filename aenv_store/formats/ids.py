"""Content identities: BLAKE3-256 of the plaintext."""
from __future__ import annotations

import blake3

DIGEST_SIZE = 32


class Digest(bytes):
    """A 32-byte BLAKE3 digest. Hashable, ordered like bytes, printed as hex."""

    __slots__ = ()

    def __new__(cls, raw: bytes) -> "Digest":
        if len(raw) != DIGEST_SIZE:
            raise ValueError(f"digest must be {DIGEST_SIZE} bytes, got {len(raw)}")
        return super().__new__(cls, raw)

    @classmethod
    def of(cls, data: bytes | memoryview) -> "Digest":
        return cls(blake3.blake3(data).digest())

    @classmethod
    def from_hex(cls, text: str) -> "Digest":
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"not a hex digest: {text!r}") from None
        return cls(raw)

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"Digest({self.hex()[:16]}…)"

    def short(self) -> str:
        return self.hex()[:12]
