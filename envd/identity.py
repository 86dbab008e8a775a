"""A restored clone's own identity, set through ``/init``: hostname and fresh
kernel randomness.

Every sandbox restored from one template wakes up with the template's hostname
and the template's kernel RNG state, so two clones would hand out the same
``getrandom()`` bytes until the kernel reseeds on its own (every 60 s on
Linux 6.1). ``/init`` therefore carries bytes from the host that are credited
to the input pool (``RNDADDENTROPY``) and then forces a reseed of the CRNG
(``RNDRESEEDCRNG``), so the very next ``getrandom()`` differs per clone.
Writing to ``/dev/urandom`` alone would mix the bytes in without reseeding.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import os
import re
import socket
import struct

# <linux/random.h>: _IOW('R', 0x03, int[2]) and _IO('R', 0x07).
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
MAX_SEED_BYTES = 4096
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,62})\Z")


class IdentityError(ValueError):
    """A hostname or seed in an /init body is malformed."""


def parse_hostname(value: object) -> str:
    if not isinstance(value, str) or not _HOSTNAME.match(value):
        raise IdentityError("hostname must be 1-64 characters of letters, digits, '.' and '-', "
                            "starting with a letter or digit")
    return value


def parse_seed(value: object) -> bytes:
    """The base64 (standard or URL-safe) entropy seed of an /init body."""
    if not isinstance(value, str):
        raise IdentityError("entropy must be a base64 string")
    try:
        text = value.replace("-", "+").replace("_", "/")
        seed = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise IdentityError("entropy is not valid base64") from None
    if not 16 <= len(seed) <= MAX_SEED_BYTES:
        raise IdentityError(f"entropy must decode to 16-{MAX_SEED_BYTES} bytes, got {len(seed)}")
    return seed


def set_hostname(name: str) -> None:
    socket.sethostname(name)


def seed_kernel_rng(seed: bytes) -> None:
    """Credit ``seed`` to the kernel's input pool and reseed the CRNG from it (needs root)."""
    fd = os.open("/dev/random", os.O_WRONLY | os.O_CLOEXEC)
    try:
        # struct rand_pool_info { int entropy_count (bits); int buf_size (bytes); __u32 buf[]; }
        fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)
