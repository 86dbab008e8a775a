"""Random-artifact workload for the crash-safety and gc-concurrency tests.

Run as a script, it commits random artifacts in a loop (until killed, or ``--count``
commits) and journals what it did; imported, it gives the tests the same
deterministic content generator so they can check every committed artifact byte
for byte.

Artifact content is a pure function of its seed, and the seed is part of the
catalog record name (``<prefix>-<seed>``): whatever record the catalog holds, the
checker knows exactly which bytes it must read back, journal or not.

Journal lines (fsynced, written by the committer):
  ``C <name>``  after commit() returned: the record must exist and read back.
  ``D <name>``  *before* deleting the record: it may or may not exist afterwards.
Record names are ``<prefix>-<seed>``; the prefix may itself contain dashes
(re-commits of a deleted artifact's content use ``<prefix>x<n>-<seed>``).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

MEDIA_TYPE = "application/vnd.aenv.blob"
# A small pool of shared blocks: artifacts reuse them, so commits dedup against
# chunks already in the repository (the case gc must never break).
_POOL = [random.Random(1000 + i).randbytes(4096) for i in range(24)]


def content(seed: int, chunk: int = 4096, max_chunks: int = 40) -> bytes:
    """The bytes of artifact ``seed``: a mix of shared blocks, fresh random data,
    zero runs and a ragged tail (sizes not a multiple of the chunk size)."""
    rng = random.Random(seed)
    parts: list[bytes] = []
    for _ in range(rng.randint(0, max_chunks)):
        r = rng.random()
        if r < 0.4:
            parts.append(rng.choice(_POOL)[: chunk])
        elif r < 0.55:
            parts.append(bytes(chunk))
        elif r < 0.65:
            half = bytearray(rng.randbytes(chunk))
            half[: chunk // 2] = bytes(chunk // 2)  # partly zero
            parts.append(bytes(half))
        else:
            # compressible-ish fresh data so packs hold both zstd frames and stored chunks
            parts.append(rng.randbytes(chunk // 4) * 4 if rng.random() < 0.5 else rng.randbytes(chunk))
    parts.append(rng.randbytes(rng.randint(0, chunk - 1)))
    return b"".join(parts)


def record_name(prefix: str, seed: int) -> str:
    return f"{prefix}-{seed}"


def seed_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def write_artifact(ws: object, data: bytes, rng: random.Random) -> object:
    """Write ``data`` through a BlobWriter in a random style: appends of random
    sizes, or random-order positioned writes (sparse; unwritten ranges stay zero)."""
    writer = ws.blob_writer(MEDIA_TYPE, size=len(data))  # type: ignore[attr-defined]
    if rng.random() < 0.5:
        pos = 0
        while pos < len(data):
            n = rng.randint(1, 20000)
            writer.append(data[pos:pos + n])
            pos += n
    else:
        pieces = []
        pos = 0
        while pos < len(data):
            n = rng.randint(1, 12000)
            pieces.append((pos, data[pos:pos + n]))
            pos += n
        rng.shuffle(pieces)
        for off, piece in pieces:
            if piece.count(0) != len(piece):  # all-zero pieces may be skipped: unwritten = zeros
                writer.write(off, piece)
    return writer.close()


def _journal(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())
    os.fsync(fd)


def run(data_dir: Path, prefix: str, seed: int, journal: Path, count: int, delete_prob: float,
        pause: float, recommit_prob: float = 0.0) -> None:
    from aenv_cli.config import load_config
    from aenv_store.formats.catalog import CatalogRecord
    from aenv_store.store import Store

    store = Store.open(load_config(data_dir).store_settings())
    rng = random.Random(seed)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    mine: list[str] = []
    deleted: list[int] = []
    print("ready", flush=True)
    done = 0
    while count <= 0 or done < count:
        if mine and rng.random() < delete_prob:
            victim = mine.pop(rng.randrange(len(mine)))
            _journal(fd, f"D {victim}")
            store.delete_record(victim)
            deleted.append(seed_of(victim))
        if deleted and rng.random() < recommit_prob:
            # Same content as a deleted artifact, new name: its chunks may be garbage a
            # gc just removed, so dedup against a stale view of the index would lose data.
            art_seed = deleted.pop(rng.randrange(len(deleted)))
            name = record_name(f"{prefix}x{done}", art_seed)
        else:
            art_seed = rng.getrandbits(48)
            name = record_name(prefix, art_seed)
        with store.workspace() as ws:
            mid = write_artifact(ws, content(art_seed), rng)
            ws.commit(CatalogRecord(name=name, kind="snapshot", manifests=(("data", mid),),
                                    meta=(("seed", str(art_seed)),), created=time.time()))
        _journal(fd, f"C {name}")
        mine.append(name)
        done += 1
        if pause:
            time.sleep(rng.uniform(0, pause))
    os.close(fd)
    store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--journal", type=Path, required=True)
    p.add_argument("--count", type=int, default=0, help="commits to make (0 = until killed)")
    p.add_argument("--delete-prob", type=float, default=0.0)
    p.add_argument("--pause", type=float, default=0.0, help="max random sleep between commits (s)")
    p.add_argument("--recommit-prob", type=float, default=0.0,
                   help="chance to re-commit the content of a deleted artifact under a new name")
    a = p.parse_args(argv)
    run(a.data_dir, a.prefix, a.seed, a.journal, a.count, a.delete_prob, a.pause, a.recommit_prob)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    sys.exit(main())
