"""Named snapshots usable as templates, and fork: children continue from the fork
point, then diverge; siblings and parent do not see each other's writes."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aenv_vm.errors import BadRequest, Conflict
from aenv_vm.sandboxes.manager import SandboxManager

from .conftest import Env, qemu_children
from .test_pause_resume import ash, read_counter, start_worker

pytestmark = pytest.mark.qemu


def test_snapshot_then_create_and_fork(env: Env, tmp_path: Path) -> None:
    async def run() -> None:
        async with SandboxManager(env.store, env.guest, tmp_path / "node") as mgr:
            parent = await mgr.create("base", metadata={"role": "parent"}, access_token="tok-parent")
            T = "tok-parent"
            _, digest, pid = await start_worker(parent, T)
            await ash(parent, "echo before > /home/user/shared", T)

            snap_id, names, size = await mgr.snapshot(parent.id, "snap-a")
            assert names == ["snap-a"] and snap_id.startswith("tpl-")
            assert [(s.snapshot_id, s.names, s.sandbox_id, s.bytes) for s in await mgr.list_snapshots()] == \
                [(snap_id, ("snap-a",), parent.id, size)]
            # its own bytes: a memory image that holds a booted guest, not the whole disk
            assert size is not None and 16 << 20 < size < 2 << 30
            with pytest.raises(Conflict, match="already exists"):
                await mgr.snapshot(parent.id, "snap-a")
            with pytest.raises(BadRequest, match="snapshot name"):   # refused before the VM is touched
                await mgr.snapshot(parent.id, "no spaces or \U000a9ff2")
            # the parent keeps running after the snapshot
            c1, _, _ = await read_counter(parent, T)
            await asyncio.sleep(0.5)
            assert (await read_counter(parent, T))[0] > c1

            # a sandbox created from the snapshot inherits its envd state, token included
            child = await mgr.create("snap-a", access_token=T)
            cc, cd, cp = await read_counter(child, T)
            await asyncio.sleep(0.5)
            assert (cd, cp) == (digest, pid) and (await read_counter(child, T))[0] > cc
            assert await ash(child, "cat /home/user/shared", T) == "before"
            await ash(child, "echo child > /home/user/only-child", T)
            assert await ash(parent, "cat /home/user/only-child 2>/dev/null || echo absent", T) == "absent"

            kids = await mgr.fork(parent.id, 2)
            assert all(not isinstance(k, Exception) for k in kids), kids
            assert len({k.id for k in kids} | {parent.id}) == 3         # type: ignore[union-attr]
            tokens = [mgr.record(k.id).access_token for k in kids]      # type: ignore[union-attr]
            assert len(set(tokens)) == 2 and T not in tokens and None not in tokens
            for i, k in enumerate(kids):
                port = k                                        # type: ignore[union-attr]
                _, kd, kp = await read_counter(port, tokens[i])
                assert (kd, kp) == (digest, pid)                          # continues from the fork point
                assert await ash(port, "hostname", tokens[i]) == k.id     # type: ignore[union-attr]
                await ash(port, f"echo {i} > /home/user/fork-{i}", tokens[i])
                assert mgr.record(k.id).metadata["forked_from"] == parent.id  # type: ignore[union-attr]
            for i, k in enumerate(kids):
                other = kids[1 - i]
                assert await ash(other,                         # type: ignore[union-attr]
                                 f"cat /home/user/fork-{i} 2>/dev/null || echo absent", tokens[1 - i]) == "absent"
                assert await ash(parent, f"cat /home/user/fork-{i} 2>/dev/null || echo absent",
                                 T) == "absent"
            assert (await read_counter(parent, T))[1:] == (digest, pid)  # parent resumed with its id
            # the fork's snapshot is committed in the background: a child's pause waits for it
            # and takes its delta over the committed memory image; the child resumes from it
            k0 = kids[0]
            rec0 = await mgr.pause(k0.id)                                # type: ignore[union-attr]
            assert rec0.snapshot is not None
            assert rec0.snapshot.base == mgr.template(rec0.template).memory.hex()
            k0 = await mgr.resume(k0.id)                                 # type: ignore[union-attr]
            assert await ash(k0, "cat /home/user/fork-0", tokens[0]) == "0"
            assert (await read_counter(k0, tokens[0]))[1:] == (digest, pid)
            with pytest.raises(BadRequest, match="1..100"):
                await mgr.fork(parent.id, 101)

            fork_tpl = mgr.record(kids[0].id).template                  # type: ignore[union-attr]
            with pytest.raises(Conflict, match="in use by 1 sandbox"):
                await mgr.delete_snapshot(snap_id)                        # `child` was created from it
            await mgr.kill(child.id)
            await mgr.delete_snapshot(snap_id)
            assert await mgr.list_snapshots() == []
            for s in list(mgr.sandboxes):
                await mgr.kill(s)
            # the fork's hidden snapshot goes with its last child
            assert fork_tpl not in {r.name for r in env.store.list_records("template")}
            assert not (tmp_path / "node" / "templates" / fork_tpl).exists()
    asyncio.run(run())
    assert not qemu_children()


def test_a_batch_from_a_pause_and_a_crash_mid_batch(env: Env, tmp_path: Path) -> None:
    """A paused sandbox's pause as a hidden snapshot (pausefork.py): a sandbox created from
    it continues the paused guest's process (its 8 MiB of memory, its pid) on the base
    template's own memory file (no image copied), with only the pause's device state and
    delta kept locally; the snapshot goes with its last sandbox; one a crash left without
    any is dropped at the next start, and the paused sandbox resumes afterwards."""
    async def run() -> None:
        root = tmp_path / "node"
        templates = env.store.list_records
        async with SandboxManager(env.store, env.guest, root) as mgr:
            src = await mgr.create("base", access_token="tok-src")
            _, digest, pid = await start_worker(src, "tok-src")
            await mgr.pause(src.id)
            async with mgr.pause_snapshot(src.id) as tpl:
                assert tpl.delta is not None and tpl.memory == env.template.memory
                assert tpl.meta.hidden == "pause" and tpl.meta.snapshot_of == src.id
                kid = await mgr.create(tpl.id, access_token="tok-kid")
            c0, kd, kp = await read_counter(kid, "tok-kid")
            assert (kd, kp) == (digest, pid)
            await asyncio.sleep(0.5)
            assert (await read_counter(kid, "tok-kid"))[0] > c0          # it runs on from the pause
            assert await ash(kid, "hostname", "tok-kid") == kid.id
            base_memory, _ = await mgr.rt.templates.files(env.template)
            assert kid.vm.spec.mem_path == base_memory
            local = root / "templates" / tpl.id
            assert sorted(p.name for p in local.iterdir()) == ["device-state", "memory.delta"]
            assert mgr.record(src.id).state.value == "paused"
            await mgr.kill(kid.id)
            assert tpl.id not in {r.name for r in templates("template")} and not local.exists()
            # a crash between the hidden record and the batch's first sandbox
            from aenv_vm.sandboxes.pausefork import held_source, make_pause_snapshot
            source = held_source(mgr.rt, mgr.record(src.id))
            orphan = make_pause_snapshot(mgr.rt, "tpl-0123456789ab", source)
        assert orphan.id in {r.name for r in templates("template")}
        async with SandboxManager(env.store, env.guest, root) as mgr:
            assert orphan.id not in {r.name for r in templates("template")}     # swept at start
            back = await mgr.resume(src.id)
            assert (await read_counter(back, "tok-src"))[1:] == (digest, pid)
            await mgr.kill(src.id)
    asyncio.run(run())
    assert not qemu_children()
