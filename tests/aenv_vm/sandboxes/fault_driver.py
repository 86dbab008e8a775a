"""A stand-in for the API server, for the fault tests: opens the store and a
SandboxManager on a run directory and walks one sandbox through the lifecycle,
printing each phase before it starts, so the test can SIGKILL it inside one.

    python -m tests.aenv_vm.sandboxes.fault_driver DATA_DIR RUN_ROOT setup
    python -m tests.aenv_vm.sandboxes.fault_driver DATA_DIR RUN_ROOT cycle SID DIGEST PID

``cycle``: recovery (the sandbox must be paused), resume + check the guest
process and its memory, pause, resume, fork 2 (children killed), pause.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aenv_store.store import Store
from aenv_vm.guest import ensure_guest
from aenv_vm.sandboxes.records import SandboxState
from aenv_vm.sandboxes.manager import SandboxManager

from .conftest import store_settings
from .test_pause_resume import read_counter, start_worker


def say(*words: object) -> None:
    print(*words, flush=True)


async def main(data: Path, run_root: Path, mode: str, args: list[str]) -> int:
    store = Store.open(store_settings(data))
    try:
        async with SandboxManager(store, ensure_guest(quiet=True), run_root) as mgr:
            if mode == "setup":
                sbx = await mgr.create("base", timeout=3600)
                _, digest, pid = await start_worker(sbx)
                await mgr.pause(sbx.id)
                say("SID", sbx.id, digest, pid)
                return 0
            sid, digest, pid = args[0], args[1], int(args[2])
            lost = [r.id for r in mgr.records() if r.state == SandboxState.LOST]
            for r in lost:              # fork children caught by a kill: reported, then cleaned
                await mgr.kill(r)
            state = mgr.record(sid).state
            say("state", state.value, "lost", len(lost))
            if state != SandboxState.PAUSED:
                return 3
            say("phase resume")
            sbx = await mgr.resume(sid)
            count, d, p = await read_counter(sbx)
            if (d, p) != (digest, pid):
                say("MISMATCH", d, p)
                return 4
            say("verified", count)
            say("phase pause")
            await mgr.pause(sid)
            say("phase resume2")
            await mgr.resume(sid)
            say("phase fork")
            kids = await mgr.fork(sid, 2, timeout=3600)
            for k in kids:
                if isinstance(k, Exception):
                    say("fork child failed:", k)
                    return 5
                await mgr.kill(k.id)
            say("phase pause2")
            await mgr.pause(sid)
            say("done")
            return 0
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:])))
