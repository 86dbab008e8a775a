"""The node process of the power-cut test (test_powercut.py): a SandboxManager on a
run directory and a repository, its fsyncs recorded (powercut.py) when the test
asks, printing each step so the test can cut the power inside one.

    python -m tests.aenv_vm.sandboxes.powercut_driver DATA_DIR RUN_ROOT setup
    python -m tests.aenv_vm.sandboxes.powercut_driver DATA_DIR RUN_ROOT cycle SID DIGEST PID MARK

``cycle``: recovery (the sandbox must be paused), resume (= connect), check the
guest's process and memory and print the markers the resumed state holds (one in
guest RAM, one on its disk), write MARK into both, pause ("acked" once the pause
returned), wait for its commit, then wait to be killed. MARK "-" ends after the
check (the test's final, undisturbed run).
"""
from __future__ import annotations

from .powercut import install_from_env

install_from_env()   # before anything opens a file of the node: every fsync is seen

import asyncio  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from aenv_store.store import Store  # noqa: E402
from aenv_vm.guest import ensure_guest  # noqa: E402
from aenv_vm.sandboxes.manager import SandboxManager  # noqa: E402
from aenv_vm.sandboxes.records import RecordStore, SandboxRecord, SandboxState  # noqa: E402
from aenv_vm.sandboxes.sandbox import Sandbox  # noqa: E402

from aenv_store.cache import node_cache  # noqa: E402

from .conftest import store_settings  # noqa: E402
from .test_pause_resume import ash, read_counter, start_worker  # noqa: E402

# RAM: the guest's /dev/shm is a tmpfs (only in the memory delta); disk: synced to the upper layer
WRITE_MARK = "echo {m} > /dev/shm/mark && echo {m} > /home/user/mark && sync"
READ_MARK = "cat /dev/shm/mark /home/user/mark"


def say(*words: object) -> None:
    print(*words, flush=True)


async def mark(sbx: Sandbox, m: str) -> None:
    await ash(sbx, WRITE_MARK.format(m=m))


def new_boot() -> None:
    """A power cut is a reboot: the node cache, which fsyncs nothing, empties itself
    when it finds another boot id than the one it was opened under (AENV_POWERCUT_BOOT:
    one per cut, set by the test)."""
    boot = os.environ.get("AENV_POWERCUT_BOOT")
    if boot:
        node_cache.boot_id = lambda: boot.encode()   # type: ignore[assignment]


def cut_at_record() -> None:
    """AENV_POWERCUT_AT=record: the process kills itself just before the pause's record
    is written (its files are as durable as they will be before the acknowledgement):
    the one cut point a random delay hits only by chance."""
    if os.environ.get("AENV_POWERCUT_AT") != "record":
        return
    put = RecordStore.put

    def put_or_die(self: RecordStore, rec: SandboxRecord) -> None:
        if rec.state == SandboxState.PAUSED and rec.snapshot is not None and not rec.snapshot.committed:
            os.kill(os.getpid(), signal.SIGKILL)    # only a pause writes such a record
        put(self, rec)
    RecordStore.put = put_or_die    # type: ignore[method-assign]


async def main(data: Path, run_root: Path, mode: str, args: list[str]) -> int:
    new_boot()
    cut_at_record()
    store = Store.open(store_settings(data))
    try:
        async with SandboxManager(store, ensure_guest(quiet=True), run_root) as mgr:
            mgr.standby_limit = 0   # a restart has none either: every resume starts its QEMU
            if mode == "setup":
                sbx = await mgr.create("base", timeout=3600)
                _, digest, pid = await start_worker(sbx)
                await mark(sbx, "0")
                await mgr.pause(sbx.id)
                await mgr.wait_committed(sbx.id)
                say("SID", sbx.id, digest, pid)
                return 0
            sid, digest, pid, new_mark = args[0], args[1], int(args[2]), args[3]
            rec = mgr.record(sid)
            say("state", rec.state.value, "seq", rec.snapshot.seq if rec.snapshot else 0, "note", rec.note or "-")
            if rec.state != SandboxState.PAUSED:
                return 3
            sbx = await mgr.resume(sid)
            _, d, p = await read_counter(sbx)
            if (d, p) != (digest, pid):
                say("MISMATCH", d, p)
                return 4
            say("marks", *(await ash(sbx, READ_MARK)).split())
            if new_mark == "-":
                await mgr.pause(sid)
                await mgr.wait_committed(sid)
                say("done")
                return 0
            await mark(sbx, new_mark)
            say("phase pause")
            await mgr.pause(sid)
            say("acked")
            await mgr.wait_committed(sid)
            say("committed")
            await asyncio.sleep(3600)   # the power is cut before this ends
            return 0
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:])))
