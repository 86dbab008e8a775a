"""The C library this Python already runs on, for the few calls the standard library
lacks (inotify, mount, umount2). ``dlopen(NULL)``, never a library found by name:
that runs ldconfig and may name the image's own libc (musl) in a tools image."""

from __future__ import annotations

import ctypes

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc = lib
    return _libc
