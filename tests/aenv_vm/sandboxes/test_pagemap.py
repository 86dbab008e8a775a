"""pagemap.read_and_hash against a real process's memory (root: process_vm_readv)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from aenv_vm.memory.pagemap import PAGE, PagemapError, RamMapping, read_and_hash

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read another process's memory")

CHILD = """
import ctypes, mmap, sys
m = mmap.mmap(-1, 64 * 4096)
for i in range(64):
    m[i * 4096:(i + 1) * 4096] = bytes([i]) * 4096
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True)
sys.stdin.read()
"""


@pytest.fixture()
def child():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        addr = int(p.stdout.readline())  # type: ignore[union-attr]
        yield p.pid, RamMapping(addr, addr + 64 * PAGE, 0)
    finally:
        p.kill()
        p.wait()


def test_reads_runs_and_hashes(child) -> None:
    pid, mapping = child
    pages = np.array([0, 1, 2, 5, 6, 9, 40, 63], dtype=np.int64)   # several runs, both ends
    data, hashes = read_and_hash(pid, mapping, pages)
    assert len(data) == len(pages) * PAGE
    for k, p in enumerate(pages.tolist()):
        assert bytes(data[k * PAGE:(k + 1) * PAGE]) == bytes([p]) * PAGE
        assert int(hashes[k]) == xxhash.xxh3_64_intdigest(bytes([p]) * PAGE)


def test_buffer_reused_when_large_enough(child) -> None:
    pid, mapping = child
    buf = bytearray(16 * PAGE)
    data, _ = read_and_hash(pid, mapping, np.array([3, 4], dtype=np.int64), buf)
    assert data.obj is buf and bytes(data) == bytes([3]) * PAGE + bytes([4]) * PAGE
    small = bytearray(PAGE)
    data, _ = read_and_hash(pid, mapping, np.array([7, 8], dtype=np.int64), small)
    assert data.obj is not small and len(data.obj) >= 2 * PAGE   # grown, with headroom
    data, hashes = read_and_hash(pid, mapping, np.zeros(0, dtype=np.int64), buf)
    assert len(data) == 0 and len(hashes) == 0


def test_unmapped_range_is_an_error(child) -> None:
    pid, mapping = child
    with pytest.raises(PagemapError):
        read_and_hash(pid, RamMapping(PAGE, PAGE + 64 * PAGE, 0), np.array([0], dtype=np.int64))  # never mapped
