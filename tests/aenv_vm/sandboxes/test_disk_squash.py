"""Squashing a layer stack gives one parentless layer with the same bytes."""
from __future__ import annotations

import os
import random
from pathlib import Path

from aenv_store.store import Store
from aenv_vm.blockimage.image import BlockImage
from aenv_vm.blockimage.squash import squash

from .conftest import store_settings

SIZE = 4 << 20


def test_squash_keeps_bytes_and_reuses_whole_chunks(tmp_path: Path) -> None:
    rng = random.Random(7)
    store = Store.open(store_settings(tmp_path / "data"), create=True)
    try:
        image = BlockImage.open(store, None, "sq", upper_dir=tmp_path / "upper", size=SIZE)
        for _ in range(6):                   # six sealed layers of overlapping, unaligned-length writes
            for _ in range(8):
                off = rng.randrange(0, SIZE // 4096 - 40) * 4096
                image.write(off, os.urandom(rng.randrange(1, 40) * 4096))
            if rng.random() < 0.5:
                image.write_zeroes(rng.randrange(0, SIZE // 4096 - 8) * 4096, 8 * 4096)
            image.commit()
        top = image.top
        assert top is not None and len(image.layers) == 6
        expect = image.read(0, SIZE)
        with store.workspace() as ws:
            sq, restaged = squash(store, ws, top, {"sandbox": "t"})
            ws.commit()
        image.close()
        assert 0 < restaged < SIZE
        again = BlockImage.open(store, sq, "sq2")
        try:
            assert len(again.layers) == 1 and again.layers[0].parent is None
            assert again.read(0, SIZE) == expect
            old_chunks = {e.chunk for m in image.layers for e in m.extents if e.chunk is not None}
            kept = {e.chunk for e in again.layers[0].extents if e.chunk is not None} & old_chunks
            assert kept          # whole chunks were reused, not restaged
        finally:
            again.close()
    finally:
        store.close()


def test_pauses_squash_a_long_disk_chain(env, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With the chain bound lowered to 3, repeated pauses keep the sandbox's stack
    short and every file written before each pause readable after resume."""
    import asyncio

    import pytest

    from aenv_store.formats.ids import Digest
    from aenv_vm.blockimage.layer import load_stack
    from aenv_vm.sandboxes import pause
    from aenv_vm.sandboxes.manager import SandboxManager

    from .test_pause_resume import ash

    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setattr(pause, "MAX_DISK_CHAIN", 3)

    async def run() -> None:
        async with SandboxManager(env.store, env.guest, tmp_path / "node") as mgr:
            sbx = await mgr.create("base")
            depths = []
            for i in range(4):
                await ash(sbx, f"echo round-{i} > /home/user/r{i} && sync")
                rec = await mgr.pause(sbx.id)
                await mgr.wait_committed(sbx.id)
                rec = mgr.record(sbx.id)
                assert rec.snapshot is not None and rec.snapshot.disk_top is not None
                depths.append(len(load_stack(env.store, Digest(bytes.fromhex(rec.snapshot.disk_top)))))
                sbx = await mgr.resume(sbx.id)
                for j in range(i + 1):
                    assert await ash(sbx, f"cat /home/user/r{j}") == f"round-{j}"
            assert max(depths) <= 3 and 1 in depths, depths
            await mgr.kill(sbx.id)
    asyncio.run(run())
