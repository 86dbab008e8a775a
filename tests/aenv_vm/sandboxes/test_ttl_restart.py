"""TTL: expiry pauses (default) or kills (auto_pause=False); set_timeout moves the
deadline; a paused sandbox stays resumable across a restart of the manager."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from aenv_vm.sandboxes.records import SandboxState
from aenv_vm.errors import NotFound
from aenv_vm.sandboxes.manager import SandboxManager

from .conftest import Env, qemu_children
from .test_pause_resume import ash, read_counter, start_worker

pytestmark = pytest.mark.qemu


async def wait_for(pred, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


def test_ttl_pause_and_delete_then_restart(env: Env, tmp_path: Path) -> None:
    node = tmp_path / "node"

    async def first() -> tuple[str, str, int]:
        async with SandboxManager(env.store, env.guest, node) as mgr:
            keep = await mgr.create("base", timeout=600, metadata={"k": "v"})
            gone = await mgr.create("base", timeout=1.0, auto_pause=False)
            _, digest, pid = await start_worker(keep)
            await ash(keep, "echo persisted > /home/user/p")
            rec = await mgr.set_timeout(keep.id, 1.0)
            assert rec.end_at - time.time() < 1.5 and rec.started_at <= time.time()
            await wait_for(lambda: gone.id not in mgr.sandboxes and keep.id not in mgr.sandboxes
                           and not gone.vm.alive() and not keep.vm.alive())
            assert mgr.record(keep.id).state == SandboxState.PAUSED             # auto-paused
            with pytest.raises(NotFound, match="unknown sandbox"):
                mgr.record(gone.id)                                               # deleted
            assert not gone.vm.alive() and not keep.vm.alive()
            return keep.id, digest, pid

    sid, digest, pid = asyncio.run(first())
    assert not qemu_children()
    # local files of a snapshot that never reached the store (server killed mid-fork)
    orphan = node / "templates" / "tpl-000000000000"
    orphan.mkdir(parents=True)
    (orphan / "memory").write_bytes(b"x")
    kept = sorted(p.name for p in (node / "templates").iterdir() if p != orphan)

    async def second() -> None:
        async with SandboxManager(env.store, env.guest, node) as mgr:               # a restarted node
            assert not orphan.exists() and kept                                   # the template's files stay
            assert sorted(p.name for p in (node / "templates").iterdir()) == kept
            rec = mgr.record(sid)
            assert rec.state == SandboxState.PAUSED and rec.metadata == {"k": "v"}
            assert rec.snapshot is not None and rec.snapshot.committed
            sbx = await mgr.resume(sid, timeout=600)
            _, d, p = await read_counter(sbx)
            assert (d, p) == (digest, pid)
            assert await ash(sbx, "cat /home/user/p") == "persisted"
            assert mgr.record(sid).end_at > time.time() + 500
            await mgr.kill(sid)
            assert mgr.records() == []
    asyncio.run(second())
    assert not qemu_children()
