"""Realistic ext4 disk images for storage benchmarks.

v1 is ``mkfs.ext4 -d`` over a tree of real files copied from this machine (/usr:
binaries, libraries, Python, docs — data that compresses and dedups the way a
guest root filesystem does). v2 is made the way a VM's disk evolves: a copy of
v1 is loop-mounted read-write and ~N% of its files are changed in place by the
kernel's ext4 (region overwrites, appends, rewrite-and-rename, deletes, new
files), so the journal, bitmaps, inode tables and block allocation change like
they do in a running guest — not a fresh mkfs."""
from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from _common import MiB, BenchError, is_root, run

DEFAULT_SOURCES = ("/usr/bin", "/usr/lib", "/usr/share", "/usr/sbin", "/usr/include", "/usr/libexec")
# Larger files are skipped so a tree of a few MiB (smoke tests) still holds many files.
MAX_FILE = 32 * MiB
BLOCK = 4096


@dataclass(frozen=True)
class TreeStats:
    files: int
    bytes: int              # sum of file sizes
    allocated: int          # sum of sizes rounded up to ext4 blocks


@dataclass(frozen=True)
class ChangeStats:
    """What evolve_in_place did to the filesystem."""

    files_before: int
    overwritten: int        # a region rewritten in place
    appended: int
    rewritten: int          # new file written next to it, renamed over it (dpkg/editor style)
    deleted: int
    created: int
    bytes_written: int      # file data written through the filesystem

    @property
    def changed(self) -> int:
        return self.overwritten + self.appended + self.rewritten + self.deleted + self.created


def _walk_regular(root: str) -> Iterator[Path]:
    """Regular files under root in sorted (reproducible) order; unreadable parts skipped."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        try:
            if e.is_symlink():
                continue
            if e.is_dir():
                yield from _walk_regular(e.path)
            elif e.is_file() and 0 < e.stat().st_size <= MAX_FILE:
                yield Path(e.path)
        except OSError:
            continue


def _interleave(sources: Sequence[str]) -> Iterator[Path]:
    """Round-robin over the sources so a small tree still mixes binaries, libraries and text."""
    walkers = [_walk_regular(s) for s in sources if os.path.isdir(s)]
    while walkers:
        for w in list(walkers):
            nxt = next(w, None)
            if nxt is None:
                walkers.remove(w)
            else:
                yield nxt


def _copy_into(src: Path, tree: Path) -> int:
    dest = tree / src.relative_to("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copyfile(src, dest)
    except OSError:
        return -1
    os.chmod(dest, 0o755 if os.access(src, os.X_OK) else 0o644)
    return dest.stat().st_size


def build_tree(tree: Path, target_bytes: int, holdout_bytes: int,
               sources: Sequence[str] = DEFAULT_SOURCES) -> tuple[TreeStats, list[Path]]:
    """Copy real files into ``tree`` until ``target_bytes`` are there. Returns the tree's
    stats and a list of further real files (about ``holdout_bytes``) that v2 adds."""
    files = size = alloc = 0
    holdout: list[Path] = []
    held = 0
    it = _interleave(sources)
    for src in it:
        n = _copy_into(src, tree)
        if n < 0:
            continue
        files += 1
        size += n
        alloc += -(-n // BLOCK) * BLOCK
        if size >= target_bytes:
            break
    else:
        raise BenchError(f"only {size} bytes of files found under {', '.join(sources)}; "
                         f"choose a smaller --size")
    for src in it:
        if held >= holdout_bytes:
            break
        holdout.append(src)
        held += src.stat().st_size
    return TreeStats(files, size, alloc), holdout


def image_size_for(stats: TreeStats) -> int:
    """A little larger than the tree, like a VM disk with some free space: data
    blocks + 12% headroom (journal, inode tables, the files v2 adds) + 32 MiB,
    rounded to MiB."""
    raw = int(stats.allocated * 1.12) + stats.files * 256 + 32 * MiB
    return -(-raw // MiB) * MiB


def make_ext4(tree: Path, image: Path, size: int) -> None:
    image.unlink(missing_ok=True)
    with open(image, "wb") as f:
        f.truncate(size)
    # Inodes for ~4 KiB/inode of data: /usr holds many small files.
    run(["mkfs.ext4", "-F", "-q", "-b", str(BLOCK), "-i", "8192", "-L", "aenv-bench",
         "-d", str(tree), str(image)])


def _read_some(path: Path, rng: random.Random, limit: int) -> bytes:
    size = path.stat().st_size
    start = rng.randrange(0, max(1, size - limit))
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(limit)


def evolve_in_place(image: Path, fraction: float, holdout: Sequence[Path], seed: int) -> ChangeStats:
    """Loop-mount ``image`` read-write and change ``fraction`` of its files through ext4.

    The mix per changed file: 35% overwrite a 4-64 KiB region in place (random bytes:
    new content), 25% append 1-64 KiB (real bytes from another file), 20% rewrite the
    whole file with a small edit via write-new-then-rename (how dpkg and editors do it:
    new blocks get allocated, old ones freed but not zeroed), 10% delete; plus new
    files (10% of the changes) copied from real files not yet in the image."""
    if not is_root():
        raise BenchError("making v2 loop-mounts the image: run the benchmark as root")
    rng = random.Random(seed)
    mnt = Path(tempfile.mkdtemp(prefix="aenv-bench-mnt-"))
    try:
        run(["mount", "-o", "loop", str(image), str(mnt)])
        try:
            return _apply_changes(mnt, fraction, holdout, rng)
        finally:
            os.sync()
            subprocess.run(["umount", str(mnt)], check=False)
    finally:
        mnt.rmdir()


def _apply_changes(mnt: Path, fraction: float, holdout: Sequence[Path], rng: random.Random) -> ChangeStats:
    files = sorted(p for p in mnt.rglob("*") if p.is_file() and not p.is_symlink()
                   and "lost+found" not in p.parts)
    if not files:
        raise BenchError("the image holds no files to change")
    n_change = max(1, round(len(files) * fraction))
    n_new = max(1, n_change // 10)
    picked = rng.sample(files, min(len(files), n_change - n_new))
    counts = {"overwritten": 0, "appended": 0, "rewritten": 0, "deleted": 0, "created": 0}
    written = 0
    for path in picked:
        roll = rng.random() * 0.9
        size = path.stat().st_size
        if roll < 0.35:
            n = min(size, rng.randrange(4096, 65537))
            off = rng.randrange(0, max(1, size - n + 1))
            with open(path, "r+b") as f:
                f.seek(off)
                f.write(rng.randbytes(n))
            counts["overwritten"] += 1
            written += n
        elif roll < 0.60:
            src = rng.choice(files)
            while not src.exists():  # deleted earlier in this loop: take another source
                src = rng.choice(files)
            data = _read_some(src, rng, rng.randrange(1024, 65537))
            with open(path, "ab") as f:
                f.write(data)
            counts["appended"] += 1
            written += len(data)
        elif roll < 0.80:
            data = bytearray(path.read_bytes())
            if data:
                i = rng.randrange(len(data))
                edit = rng.randbytes(min(len(data) - i, rng.randrange(16, 4097)))
                data[i:i + len(edit)] = edit
            tmp = path.with_name(path.name + ".dpkg-new")
            tmp.write_bytes(data)
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
            os.replace(tmp, path)
            counts["rewritten"] += 1
            written += len(data)
        else:
            path.unlink()
            counts["deleted"] += 1
    for src in holdout[:n_new]:
        dest = mnt / "new" / src.relative_to("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(src, dest)
        except OSError:
            continue
        counts["created"] += 1
        written += dest.stat().st_size
    return ChangeStats(files_before=len(files), bytes_written=written, **counts)


def copy_image(src: Path, dest: Path) -> None:
    """A byte copy that keeps holes (the untouched free space of the filesystem)."""
    run(["cp", "--sparse=always", str(src), str(dest)])
