"""The upper layer keeps the node's free-disk floor and never grows past the image."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from aenv_vm.blockimage.upper import BLOCK, UpperLayer


def test_writes_that_would_cross_the_floor_fail_with_enospc(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    up = UpperLayer(tmp_path / "u", 16 * BLOCK, None, min_free=0)
    up.write_blocks(0, b"a" * BLOCK)
    up.min_free = free + (1 << 30)           # a floor this filesystem is already below
    with pytest.raises(OSError) as e:
        up.write_blocks(BLOCK, b"b" * BLOCK)
    assert e.value.errno == errno.ENOSPC
    up.write_blocks(0, b"c" * BLOCK)         # rewriting allocated blocks takes no new space
    assert up.read_data(0, BLOCK) == b"c" * BLOCK
    up.close()


def test_the_data_file_is_the_image_size_at_most(tmp_path: Path) -> None:
    up = UpperLayer(tmp_path / "u", 8 * BLOCK, None)
    for i in range(8):
        up.write_blocks(i * BLOCK, b"x" * BLOCK)
    assert up.data_path.stat().st_size == 8 * BLOCK
    assert os.stat(up.data_path).st_blocks * 512 <= 8 * BLOCK + 64 * 1024   # allocation never beyond it
    up.close()
