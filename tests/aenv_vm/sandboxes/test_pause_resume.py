"""Pause → resume keeps a running guest process, its memory and the disk; a second
pause is incremental in the store."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aenv_vm.envd_client import EnvdClient
from aenv_vm.errors import Conflict
from aenv_vm.memory import memory_image as mi
from aenv_vm.sandboxes.manager import SandboxManager
from aenv_vm.sandboxes.records import SandboxState
from aenv_vm.sandboxes.sandbox import Sandbox

from .conftest import Env, qemu_children

pytestmark = pytest.mark.qemu

# A guest process holding 8 MiB of data in memory and ticking a counter file; on
# each tick it writes "<count> <checksum of its memory>" so the host sees both.
WORKER = r"""
import hashlib, os, time
blob = bytearray(os.urandom(8 << 20))
digest = hashlib.sha256(blob).hexdigest()[:16]
open('/home/user/expected', 'w').write(digest)
i = 0
while True:
    i += 1
    with open('/home/user/counter.tmp', 'w') as f:
        f.write(f"{i} {hashlib.sha256(blob).hexdigest()[:16]} {os.getpid()}")
    os.replace('/home/user/counter.tmp', '/home/user/counter')
    time.sleep(0.2)
"""


async def ash(box: Sandbox, cmd: str, token: str | None = None) -> str:
    r = await EnvdClient(box.envd_host, box.envd_port, token).run(cmd, user="root", timeout=60.0)
    assert r.exit_code == 0, r
    return r.stdout.decode().strip()


async def start_worker(port: Sandbox, token: str | None = None) -> tuple[int, str, int]:
    await ash(port, "cat > /root/worker.py <<'EOF'\n" + WORKER + "\nEOF\n"
                    "nohup python3 /root/worker.py >/dev/null 2>&1 &", token)
    for _ in range(100):
        out = await ash(port, "cat /home/user/counter 2>/dev/null; echo; cat /home/user/expected 2>/dev/null; true", token)
        lines = out.splitlines()
        if len(lines) == 2 and lines[0]:
            count, digest, pid = lines[0].split()
            assert digest == lines[1]
            return int(count), digest, int(pid)
        await asyncio.sleep(0.3)
    raise AssertionError("worker did not start")


async def read_counter(port: Sandbox, token: str | None = None) -> tuple[int, str, int]:
    count, digest, pid = (await ash(port, "cat /home/user/counter", token)).split()
    return int(count), digest, int(pid)


def repo_bytes(env: Env) -> int:
    return sum(p.stat().st_size for p in env.settings.paths.repo.rglob("*") if p.is_file())


def test_pause_resume_keeps_process_memory_and_disk(env: Env, tmp_path: Path) -> None:
    async def run() -> None:
        async with SandboxManager(env.store, env.guest, tmp_path / "node") as mgr:
            sbx = await mgr.create("base", env_vars={"K": "v"}, metadata={"owner": "test"})
            port = sbx
            count0, digest, pid = await start_worker(port)
            await ash(port, "echo on-disk > /home/user/file && sync")
            rec = await mgr.pause(sbx.id)
            assert rec.state == SandboxState.PAUSED and rec.snapshot is not None
            assert mgr.last_pause is not None
            print(f"\n[snapshot] pause {mgr.last_pause}")
            assert sbx.id not in mgr.sandboxes and not sbx.vm.alive()   # memory released
            assert mgr.record(sbx.id).metadata == {"owner": "test"}
            with pytest.raises(Conflict, match="not running"):
                await mgr.snapshot(sbx.id)
            assert (Path(rec.snapshot.local) / "memory.delta").is_file()

            again = await mgr.resume(sbx.id)
            print(f"[snapshot] resume {mgr.last_resume}")
            assert again.id == sbx.id and mgr.record(sbx.id).state == SandboxState.RUNNING
            port = again
            c1, d1, p1 = await read_counter(port)
            await asyncio.sleep(0.8)
            c2, d2, p2 = await read_counter(port)
            assert p1 == p2 == pid and d1 == d2 == digest      # same process, memory intact
            assert count0 <= c1 < c2                              # it kept running after resume
            assert await ash(port, "cat /home/user/file") == "on-disk"
            assert await ash(port, "echo $K") == "v"              # envd state survived

            # incremental: 8 MiB written in the guest adds <= 2 x 8 MiB (+ state) to the store
            assert mgr.paused.committing(sbx.id) is None  # resume waited for the first commit
            await mgr.pause(sbx.id)
            await mgr.wait_committed(sbx.id)
            await mgr.resume(sbx.id)
            port = mgr.get(sbx.id)
            before = repo_bytes(env)
            await ash(port, "head -c 8M /dev/urandom > /home/user/big")
            previous = Path(mgr.record(sbx.id).snapshot.local)              # type: ignore[union-attr]
            rec = await mgr.pause(sbx.id)
            # this pause wrote only what changed since the previous one (a version-2 file over it) ...
            t = mgr.last_pause
            assert t is not None and 0 < t.written_pages < t.dirty_pages, t
            delta = Path(rec.snapshot.local) / "memory.delta"              # type: ignore[union-attr]
            assert mi.parent_seq(delta) == int(previous.name) and previous.is_dir()
            await mgr.wait_committed(sbx.id)
            # ... and its commit made it self-contained, then removed the previous one
            assert mi.parent_seq(delta) is None and not previous.exists()
            assert (previous.parent / "spare").is_file()          # its file, for the next pause to overwrite
            added = repo_bytes(env) - before
            print(f"[snapshot] second pause after writing 8 MiB added {added / 2**20:.1f} MiB to the store")
            assert added <= 2 * (8 << 20) + (2 << 20)
            await mgr.resume(sbx.id)
            c3, d3, p3 = await read_counter(mgr.get(sbx.id))
            assert p3 == pid and d3 == digest and c3 > c2
            await mgr.kill(sbx.id)
            assert not (tmp_path / "node" / "paused" / sbx.id).exists()
            with pytest.raises(Exception, match="unknown sandbox"):
                mgr.record(sbx.id)
    asyncio.run(run())
    assert not qemu_children()
