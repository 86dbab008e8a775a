"""A guest writes its serial console without end (issue 28), as root, for ~20 s: through
/dev/ttyS0 and through the kernel's printk (/dev/kmsg), while the logs API is asked
again and again. The console the node keeps stays within its ring ([vm] console_kib,
aenv_vm/qemu/console.py), the sandbox's log files within [server] sandbox_log_mib
(aenv_api/server/sandbox_logs.py), and the node and the neighbour are fine.

Under TCG QEMU's emulated UART moves ~10 KB/s, so this module's node keeps the smallest
ring (128 KiB) for the guest to write past it within the test's time."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import Server, serving
from .watch import watching

pytestmark = [pytest.mark.qemu]

FLOOD_SECONDS = 20
CONSOLE_BYTES = 128 << 10           # [vm] console_kib of this module's node (the least allowed)
LOG_BYTES = 8 << 20                 # the default of [server] sandbox_log_mib
CAPTURE = 1 << 20                   # what one capture may append (sandbox_logs.MAX_CONSOLE_BYTES)

OFFENDER = (f"timeout {FLOOD_SECONDS} sh -c 'while :; do echo kmsg flood line > /dev/kmsg; done' & "
            "python3 -c \"import os, time\n"
            "fd = os.open('/dev/ttyS0', os.O_WRONLY | os.O_NOCTTY)\n"
            f"end, n = time.time() + {FLOOD_SECONDS}, 0\n"
            "while time.time() < end:\n"
            "    n += os.write(fd, b'console flood line from the guest 0123456789abcdefghijklmnopqrstuvwxyz\\n')\n"
            "print(n)\"; wait")


@pytest.fixture(scope="module")
def server(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """This module's node: the smallest console ring."""
    with serving(node_data_dir, tmp_path_factory.mktemp("console-logs"),
                 env={"AENV_VM__CONSOLE_KIB": str(CONSOLE_BYTES >> 10)}) as srv:
        yield srv


def _console_file(node: Server, sid: str) -> Path:
    found = [p for p in node.data_dir.rglob(f"vm/{sid}/serial.log")] or \
        [p for p in Path(node.data_dir).resolve().rglob(f"vm/{sid}/serial.log")]
    assert found, f"no console file of {sid} under {node.data_dir}"
    return found[0]


def _log_bytes(node: Server, sid: str) -> int:
    root = node.data_dir / "sandbox-logs"
    return sum(p.stat().st_size for p in root.glob(f"{sid}.jsonl*"))


def test_a_console_flood_stays_in_its_ring(node: Server, neighbour: Any) -> None:
    from e2b import Sandbox

    offender = Sandbox.create(timeout=300)
    sid = offender.sandbox_id
    try:
        console = _console_file(node, sid)
        biggest_console = biggest_log = 0
        queries = 0
        with watching(node, neighbour) as harm:
            flood = offender.commands.run(OFFENDER, user="root", background=True)
            end = time.monotonic() + FLOOD_SECONDS
            while time.monotonic() < end:
                status, _, body = node.request("GET", f"/sandboxes/{sid}/logs?limit=50")
                assert status == 200 and len(body["logs"]) <= 50, (status, str(body)[:300])
                queries += 1
                biggest_console = max(biggest_console, console.stat().st_size)
                biggest_log = max(biggest_log, _log_bytes(node, sid))
                time.sleep(0.5)
            result = flood.wait()
        harm.check("console flood")
        written = int(result.stdout.strip().splitlines()[-1])
        status, _, body = node.request("GET", f"/v2/sandboxes/{sid}/logs?direction=backward&limit=20")
        assert status == 200
        newest = [e["message"] for e in body["logs"]]
        print(f"[hostile] console: the guest wrote {written} bytes to ttyS0 (and printk); ring file at most "
              f"{biggest_console} bytes, log files at most {biggest_log} bytes over {queries} log queries")
        assert offender.commands.run("echo alive").stdout.strip() == "alive"
        assert written > CONSOLE_BYTES and 0 < biggest_console <= CONSOLE_BYTES
        assert console.stat().st_size <= CONSOLE_BYTES
        assert biggest_log <= LOG_BYTES + 2 * CAPTURE
        assert any("console flood line" in m or "kmsg flood line" in m for m in newest), newest
        # the node and the neighbour still work
        assert neighbour.commands.run("true").exit_code == 0
        assert node.request("GET", "/health")[0] in (200, 204)
    finally:
        offender.kill()
