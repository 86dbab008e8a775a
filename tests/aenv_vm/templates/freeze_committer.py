"""A template committer for the freeze crash test (test_freeze_crash.py): commits
templates the way a build's last step does (templates/freeze.py: the disk's upper layer
sealed, the memory image and device state staged, the template record, then its
alias) in a loop until killed, journaling each template whose ``freeze`` returned.

The content of template ``i`` of seed ``s`` is a pure function of both (``files``), so
the test can check every committed template byte for byte, journal or not.

    python freeze_committer.py --data-dir D --base RECORD --seed S --journal J --work W
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

MEM = 2 << 20           # a sparse 2 MiB memory image
CHUNK = 4096


def files(seed: int, i: int) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], bytes]:
    """(disk writes, memory extents, device state) of template ``i`` of ``seed``."""
    rng = random.Random(seed * 100_003 + i)
    # writes within the 1 MiB base image (256 chunks): at most 3 chunks from chunk 0..252
    disk = [(rng.randrange(0, 253) * CHUNK, rng.randbytes(rng.randint(1, 3) * CHUNK)) for _ in range(rng.randint(1, 6))]
    mem = [(rng.randrange(0, MEM // CHUNK - 8) * CHUNK, rng.randbytes(rng.randint(1, 8) * CHUNK))
           for _ in range(rng.randint(1, 12))]
    return disk, mem, rng.randbytes(rng.randint(100, 9000))


def template_id(seed: int, i: int) -> str:
    return f"tpl-{seed & 0xffffffff:08x}{i:04x}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--base", required=True, help="the image record the templates' disks start from")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--journal", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()

    from aenv_cli.config import load_config
    from aenv_store.store import Store
    from aenv_vm.blockimage.image import BlockImage
    from aenv_vm.blockimage.layer import image_top
    from aenv_vm.templates.freeze import freeze
    from aenv_vm.templates.meta import TemplateMeta

    store = Store.open(load_config(args.data_dir, overrides={}).store_settings())
    top = image_top(store.get_record(args.base))
    meta = TemplateMeta(memory_mib=max(1, MEM >> 20), vcpus=1, accel="tcg", guest_key="crash-test", kernel_cmdline="quiet")
    print("ready", flush=True)
    i = 0
    while True:
        tid = template_id(args.seed, i)
        disk, mem, state = files(args.seed, i)
        work = args.work / tid
        work.mkdir(parents=True, exist_ok=True)
        with BlockImage.open(store, top, f"build-{tid}", upper_dir=work / "upper") as image:
            for off, data in disk:
                image.write(off, data)
            with open(work / "memory", "wb") as f:
                f.truncate(MEM)
                for off, data in mem:
                    f.seek(off)
                    f.write(data)
            (work / "device-state").write_bytes(state)
            freeze(store, tid, disk=image, memory=work / "memory", device_state=work / "device-state", meta=meta,
                   alias=f"crash-{tid[4:]}")
        with open(args.journal, "a") as j:
            j.write(f"C {tid}\n")
            j.flush()
            os.fsync(j.fileno())
        i += 1


if __name__ == "__main__":
    sys.exit(main())
