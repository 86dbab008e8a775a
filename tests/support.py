"""What many tests share: where the repository is, a free loopback port, a small
filesystem of a test's own, and ``require`` (a missing part skips a test on a
developer's machine and fails it in CI, where every part is installed)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def require(condition: bool, why: str) -> None:
    if not condition:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (required in CI)")
        pytest.skip(why)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the test's server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def small_tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs of its own (``options``: size=, nr_inodes=) at ``where``, unmounted after:
    what is free on it is the test's alone, whatever another worker writes meanwhile."""
    where.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "aenv-test", str(where)],
                          capture_output=True, text=True)
    require(done.returncode == 0, f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
        where.rmdir()
