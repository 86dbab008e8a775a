"""What many tests share: where the repository is, a free loopback port, and
``require`` (a missing part skips a test on a developer's machine and fails it in CI,
where every part is installed)."""
from __future__ import annotations

import os
import socket
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
