"""The node caps glibc's malloc arenas (aenv_cli/malloc_arenas.py): eight threads
allocating at once through the C library make at most two arenas after the cap, more
without it (glibc's malloc_info counts them), and ``MALLOC_ARENA_MAX`` wins."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = r'''
import ctypes, sys, tempfile, threading
from aenv_cli.malloc_arenas import limit_malloc_arenas
capped = limit_malloc_arenas() if sys.argv[1] == "cap" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
start = threading.Barrier(8)
def work():
    start.wait()
    for _ in range(20000):           # ctypes lets the GIL go: the threads allocate at once
        libc.free(libc.malloc(4096))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(capped, open(f.name).read().count("<heap nr="))
'''


def arenas(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], cwd=REPO, capture_output=True, text=True,
                         env={**{k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}, **(env or {})},
                         timeout=120, check=True).stdout.split()
    return out[0], int(out[1])


def test_two_arenas_at_most_once_capped() -> None:
    capped, n = arenas("cap")
    assert capped == "True" and n <= 2, n
    _, uncapped = arenas("none")
    assert uncapped > 2, uncapped      # the test makes contention: without the cap glibc adds arenas
    capped, n = arenas("cap", {"MALLOC_ARENA_MAX": "5"})
    assert capped == "False"           # the environment's setting is left alone
