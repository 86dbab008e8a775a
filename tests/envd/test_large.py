"""Large transfers stay within bounded envd memory (peak RSS asserted)."""

from __future__ import annotations

import hashlib
import io
import os
from typing import Iterator

import pytest
from e2b import Sandbox

from .conftest import TEST_USER, Envd, start_envd, stop_envd

MiB = 1 << 20
GROWTH_LIMIT = 64 * MiB


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakRss:
    """Peak-RSS growth of a process over a block (kernel VmHWM, reset first)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> "PeakRss":
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.base = _status_kib(self.pid, "VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = _status_kib(self.pid, "VmHWM") * 1024 - self.base


class PatternFile(io.RawIOBase):
    """``size`` bytes of a non-repeating pattern, produced on the fly."""

    def __init__(self, size: int) -> None:
        self.left = size
        self.block = 0
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        n = min(len(b), self.left, MiB)
        if n == 0:
            return 0
        chunk = (self.block.to_bytes(8, "little") * (MiB // 8))[:n]
        self.block += 1
        b[:n] = chunk
        self.sha.update(chunk)
        self.left -= n
        return n


@pytest.fixture(scope="module")
def big_envd(test_user) -> Iterator[Envd]:  # type: ignore[no-untyped-def]
    e = start_envd("--user", TEST_USER)
    try:
        yield e
    finally:
        stop_envd(e)


@pytest.mark.slow
@pytest.mark.parametrize("octet", [True, False], ids=["octet-stream", "multipart"])
def test_256mib_write_read_bounded_memory(big_envd: Envd, workdir, octet: bool) -> None:  # type: ignore[no-untyped-def]
    sbx = Sandbox.create(debug=True, sandbox_url=big_envd.url, api_key="test")
    target = workdir / "big.bin"
    sbx.files.write(str(workdir / "warm.bin"), b"x" * MiB)  # warm up code paths first
    sbx.files.read(str(workdir / "warm.bin"), format="bytes")
    size = 256 * MiB
    src = PatternFile(size)
    with PeakRss(big_envd.pid) as peak:
        info = sbx.files.write(str(target), io.BufferedReader(src, MiB), use_octet_stream=octet)
        assert info.path == str(target)
        assert target.stat().st_size == size
        got = hashlib.sha256()
        n = 0
        for chunk in sbx.files.read(str(target), format="stream"):
            got.update(chunk)
            n += len(chunk)
    assert n == size and got.hexdigest() == src.sha.hexdigest()
    print(f"envd peak RSS growth {peak.growth / MiB:.1f} MiB")
    assert peak.growth < GROWTH_LIMIT, f"envd peak RSS grew by {peak.growth / MiB:.1f} MiB"
    os.remove(target)


@pytest.mark.slow
def test_100mib_stdout_streams_bounded(big_envd: Envd) -> None:
    sbx = Sandbox.create(debug=True, sandbox_url=big_envd.url, api_key="test")
    sbx.commands.run("echo warm")
    total = 0

    def count(s: str) -> None:
        nonlocal total
        total += len(s)

    with PeakRss(big_envd.pid) as peak:
        r = sbx.commands.run("head -c 104857600 /dev/zero | tr '\\0' 'a'", on_stdout=count,
                             retain_output=False, timeout=300)
    assert r.exit_code == 0 and total == 100 * MiB
    print(f"envd peak RSS growth {peak.growth / MiB:.1f} MiB")
    assert peak.growth < GROWTH_LIMIT, f"envd peak RSS grew by {peak.growth / MiB:.1f} MiB"
