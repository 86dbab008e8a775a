"""Load: 16 concurrent SDK clients, each looping create → run → write/read → kill for
AENV_LOAD_SECONDS (default 60): zero failed calls, no QEMU left behind, the
server's memory bounded (its peak RSS is printed and asserted)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from .conftest import Server, qemu_children

pytestmark = [pytest.mark.qemu, pytest.mark.slow]

CLIENTS = 16


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_sixteen_clients_loop(sdk_env: Server) -> None:
    from e2b import Sandbox, SandboxQuery

    seconds = float(os.environ.get("AENV_LOAD_SECONDS", "60"))
    pid = sdk_env.proc.pid
    rss_before = _rss_kib(pid, "VmRSS")
    failures: list[str] = []
    loops = [0] * CLIENTS
    stop_at = time.monotonic() + seconds

    def client(i: int) -> None:
        while time.monotonic() < stop_at:
            s = None
            try:
                s = Sandbox.create(metadata={"suite": "load", "client": str(i)}, timeout=300)
                assert s.commands.run(f"echo {i}").stdout.strip() == str(i)
                payload = f"client {i} loop {loops[i]}" * 100
                s.files.write("/home/user/load.txt", payload)
                assert s.files.read("/home/user/load.txt") == payload
                s.kill()
                s = None
                loops[i] += 1
            except Exception as e:  # every failure is collected and fails the test
                failures.append(f"client {i}: {type(e).__name__}: {e}"[:300])
                if s is not None:
                    try:
                        s.kill()
                    except Exception:
                        pass

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hwm = _rss_kib(pid, "VmHWM")
    rss_after = _rss_kib(pid, "VmRSS")
    print(f"\n[load] {CLIENTS} clients x {seconds:.0f} s: {sum(loops)} loops (min {min(loops)} per client), "
          f"{len(failures)} failures; server RSS {rss_before // 1024} -> {rss_after // 1024} MiB, "
          f"peak {hwm // 1024} MiB")
    assert not failures, failures[:5]
    assert min(loops) >= 1
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "load"})).next_items() == []
    # only the warm pool's VM(s) remain children of the server
    assert len(qemu_children(pid)) <= 1
    assert hwm < 512 * 1024, f"server peak RSS {hwm // 1024} MiB"
