"""Memory a guest frees goes back to the host (virtio-balloon free page reporting), and a
clone's discards never reach the memory file its template's other clones map.

Real QEMU, real guest, the node's own sandbox path (confined as a node confines it).
The guest needs room for 200 MiB, so the test builds a 512 MiB template of its own."""
from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest

from aenv_vm.sandboxes.manager import SandboxManager
from aenv_vm.sandboxes.sandbox import Sandbox
from aenv_vm.templates.base import build_template

from .conftest import Env, qemu_children
from .test_pause_resume import ash

pytestmark = pytest.mark.qemu

MiB = 1 << 20
ALLOC_MIB = 200
RETURN_SHARE = 0.8          # the bound: 80 % of what the guest freed ...
RETURN_SECONDS = 10.0       # ... back on the host within 10 s

# Allocates 200 MiB, writes every page (a different word on each, so KSM has nothing to
# merge), says so, frees it when told, says so, and stays alive: the memory comes back
# because the guest freed it, not because a process exited.
ALLOCATOR = r"""
import os, time
n = ALLOC_MIB << 20
b = bytearray(n)
for i in range(0, n, 4096):
    b[i:i + 8] = i.to_bytes(8, "little")
open("/tmp/held", "w").close()
while not os.path.exists("/tmp/release"):
    time.sleep(0.05)
del b
open("/tmp/freed", "w").close()
time.sleep(3600)
""".replace("ALLOC_MIB", str(ALLOC_MIB))


def rss(pid: int) -> int:
    """The QEMU's resident memory in bytes (/proc/PID/smaps_rollup ``Rss``)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no Rss in /proc/{pid}/smaps_rollup")


def cgroup_memory(box: Sandbox) -> tuple[int, str] | None:
    """(usage in bytes, limit) of the QEMU's own memory cgroup (v2 or v1); None: not in one."""
    if box.vm.cgroup is None:
        return None
    for d in box.vm.cgroup.dirs:
        for usage, limit in (("memory.current", "memory.max"), ("memory.usage_in_bytes", "memory.limit_in_bytes")):
            if (d / usage).is_file():
                return int((d / usage).read_text()), (d / limit).read_text().strip()
    return None


def node_used() -> int:
    """MemTotal - MemAvailable of the node, in bytes (shown, not asserted: other work moves it)."""
    info = {k: int(v.split()[0]) * 1024 for k, v in
            (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
    return info["MemTotal"] - info["MemAvailable"]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return h.hexdigest()


async def wait_file(box: Sandbox, path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while await ash(box, f"test -e {path} && echo yes || echo no") != "yes":
        assert time.monotonic() < deadline, f"{path} did not appear in the guest"
        await asyncio.sleep(0.2)


async def returned_within(pid: int, peak: int, want: int, seconds: float) -> tuple[int, float]:
    """Poll the QEMU's RSS until ``want`` bytes below ``peak`` or ``seconds`` are up:
    (bytes returned, seconds taken)."""
    t0 = time.monotonic()
    back = peak - rss(pid)
    while back < want and time.monotonic() - t0 < seconds:
        await asyncio.sleep(0.2)
        back = peak - rss(pid)
    return back, time.monotonic() - t0


def test_freed_guest_memory_returns_to_the_host(env: Env, tmp_path: Path) -> None:
    async def run() -> None:
        await build_template(env.store, env.guest, tmp_path / "work", alias="roomy", memory_mib=512)
        async with SandboxManager(env.store, env.guest, tmp_path / "node") as mgr:
            box = await mgr.create("roomy")
            pid = box.vm.pid
            assert "Free page reporting enabled" in await ash(box, "dmesg")
            await ash(box, "cat > /root/alloc.py <<'EOF'\n" + ALLOCATOR + "\nEOF\n"
                           "nohup python3 /root/alloc.py >/root/alloc.log 2>&1 &")
            before = rss(pid)
            await wait_file(box, "/tmp/held")
            held, node_held, cg_held = rss(pid), node_used(), cgroup_memory(box)
            await ash(box, "touch /tmp/release")
            t0 = time.monotonic()
            await wait_file(box, "/tmp/freed")
            freed_after = time.monotonic() - t0
            back, took = await returned_within(pid, held, int(RETURN_SHARE * ALLOC_MIB * MiB),
                                               RETURN_SECONDS - freed_after)
            after, node_after, cg_after = rss(pid), node_used(), cgroup_memory(box)
            print(f"\n[balloon] QEMU RSS: restored {before / MiB:.0f} MiB, {ALLOC_MIB} MiB held "
                  f"{held / MiB:.0f} MiB, freed {after / MiB:.0f} MiB: {back / MiB:.0f} MiB "
                  f"({back / (ALLOC_MIB * MiB):.0%} of {ALLOC_MIB}) back {freed_after + took:.1f} s after the free; "
                  f"node MemTotal-MemAvailable meanwhile {(node_after - node_held) / MiB:+.0f} MiB")
            assert held - before >= ALLOC_MIB * MiB * 0.9, (before, held)    # the guest did hold it
            assert back >= RETURN_SHARE * ALLOC_MIB * MiB, (before, held, after)
            assert freed_after + took <= RETURN_SECONDS
            if cg_held is not None and cg_after is not None:
                # a confined QEMU's cgroup: the pages are uncharged with it, its bound stays
                print(f"[balloon] its memory cgroup: {cg_held[0] / MiB:.0f} -> {cg_after[0] / MiB:.0f} MiB "
                      f"used, limit {cg_after[1]}")
                assert cg_after[1] == cg_held[1]
                assert cg_held[0] - cg_after[0] >= RETURN_SHARE * ALLOC_MIB * MiB
            # the guest goes on as before, its memory usable again
            assert await ash(box, "python3 -c 'print(len(bytearray(150 << 20)) >> 20)'") == "150"
            await mgr.kill(box.id)
    asyncio.run(run())
    assert not qemu_children()


@pytest.mark.parametrize("confine", ["auto", "off"])
def test_a_clones_discards_stay_out_of_its_template(env: Env, tmp_path: Path, confine: str) -> None:
    """A guest freeing pages that hold its template's data gives the host those pages
    back, and the template's memory file, and with it every other clone, keeps them:
    confined (the file opened read-only) or not (QEMU could write it, and without
    aenv_vm/confine/discard.py would punch the pages out of it)."""
    name = f"holding-{confine}"

    async def run() -> None:
        async with SandboxManager(env.store, env.guest, tmp_path / "node", confine=confine) as mgr:
            a = await mgr.create("base")
            # 64 MiB of data in the guest's page cache (tmpfs): part of a snapshot's memory
            await ash(a, "head -c 64M /dev/urandom > /dev/shm/data")
            digest = await ash(a, "sha256sum /dev/shm/data | cut -d' ' -f1")
            await mgr.snapshot(a.id, name)
            await mgr.kill(a.id)
            tpl = mgr.template(name)
            memory, _ = await mgr.rt.templates.files(tpl)
            image = file_digest(memory)

            b = await mgr.create(name)
            assert await ash(b, "sha256sum /dev/shm/data | cut -d' ' -f1") == digest   # read: mapped from the file
            held = rss(b.vm.pid)
            await ash(b, "rm /dev/shm/data")
            # the freed pages go back: QEMU unmaps them ...
            back, took = await returned_within(b.vm.pid, held, 48 * MiB, RETURN_SECONDS)
            print(f"\n[balloon] a clone deleting 64 MiB of its template's tmpfs: {back / MiB:.0f} MiB "
                  f"back in {took:.1f} s")
            assert back >= 48 * MiB
            # ... and only from the clone: the file under every clone is as it was
            assert file_digest(memory) == image
            c = await mgr.create(name)
            assert await ash(c, "sha256sum /dev/shm/data | cut -d' ' -f1") == digest
            assert await ash(b, "test -e /dev/shm/data && echo yes || echo no") == "no"
            for box in (b, c):
                await mgr.kill(box.id)
            await mgr.delete_snapshot(name)     # the store is the module's: other tests list its snapshots
    asyncio.run(run())
    assert not qemu_children()
