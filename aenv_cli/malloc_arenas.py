"""The node's C allocator keeps at most ``NODE_ARENAS`` arenas.

glibc gives each thread that allocates while another holds an arena a new one, up to
8 per core, and an arena's freed memory mostly stays resident. The node's worker
threads (restores, snapshot reads, store I/O: 16 at once in a fork of 16) each end up
with one: measured on a 2-vCPU node, a node that had created one sandbox and forked it
into 16 three times held 191 MiB with the default and 155 MiB with two arenas (31 MiB
less before the first fork). Python objects live in pymalloc's pools and most C work
runs under the GIL, so two arenas cost little contention.

``MALLOC_ARENA_MAX`` in the environment, glibc's own setting, wins: it is read when the
process starts, and this leaves it alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

NODE_ARENAS = 2
M_ARENA_MAX = -8        # mallopt's parameter number (malloc.h)


def limit_malloc_arenas(arenas: int = NODE_ARENAS) -> bool:
    """Cap the arenas glibc makes from now on (call before threads start). False where
    the C library is not glibc or the environment already says."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, arenas))
