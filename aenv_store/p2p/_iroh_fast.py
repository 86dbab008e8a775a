"""Work around the byte-by-byte copy in the iroh 1.x Python bindings.

uniffi's generated ``_UniffiRustBufferBuilder.write`` lowers a ``bytes``
argument (e.g. ``SendStream.write_all(buf)``) into Rust memory with a Python
loop, one byte per iteration: ~3-7 MB/s. Replacing that one method with a
single ``memmove`` makes the same call run at memcpy speed (measured here:
6.9 MB/s -> 230 MB/s on loopback). The replacement keeps the method's contract
(reserve, copy, advance ``len``); ``apply()`` checks the shape of the class it
patches and leaves the bindings alone if they ever change."""
from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger(__name__)

_applied = False


def _fast_write(self: Any, value: Any) -> None:
    n = len(value)
    with self._reserve(n):
        if n:
            src = value if isinstance(value, bytes) else bytes(value)
            dst = ctypes.cast(self.rbuf.data, ctypes.c_void_p).value
            assert dst is not None
            ctypes.memmove(dst + self.rbuf.len, src, n)


def apply() -> bool:
    """Install the block copy (idempotent). False if the bindings look different."""
    global _applied
    if _applied:
        return True
    try:
        from iroh import iroh_ffi
    except ImportError:
        return False
    builder = getattr(iroh_ffi, "_UniffiRustBufferBuilder", None)
    if builder is None or not hasattr(builder, "_reserve") or not hasattr(builder, "write"):
        log.warning("iroh bindings changed shape; P2P sends use the slow byte copy")
        return False
    builder.write = _fast_write
    _applied = True
    return True
