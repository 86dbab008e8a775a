"""The ingest pipeline (whole chunks hashed and compressed on the store's pool while
the caller goes on): results must equal the sequential path, whatever the caller
does with its buffer after append() returns and however writes interleave."""
from __future__ import annotations

import os
import random

from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import BLOB
from aenv_store.store import Store

CS = 4096


def _ingest(store: Store, blocks: list[bytes], reuse_buffer: bool) -> bytes:
    with store.workspace() as ws:
        assert ws._executor is not None or (os.cpu_count() or 1) < 2
        w = ws.blob_writer(BLOB)
        buf = bytearray(max(len(b) for b in blocks))
        for b in blocks:
            if reuse_buffer:
                # one mutable buffer, overwritten right after each append (like readinto)
                buf[:len(b)] = b
                w.append(memoryview(buf)[:len(b)])
                buf[:] = os.urandom(len(buf))
            else:
                w.append(b)
        mid = w.close()
        ws.commit()
    return bytes(mid)


def test_pipeline_with_reused_buffer_matches_content(settings_factory) -> None:
    rng = random.Random(7)
    chunk_kinds = [bytes(CS), b"a" * CS, os.urandom(CS)]
    blocks = []
    for _ in range(12):
        n = rng.choice([CS * 64, CS * 100 + 123, CS * 3, 77])
        blob = b"".join(rng.choice(chunk_kinds) if rng.random() < 0.5 else os.urandom(CS)
                        for _ in range(n // CS + 1))[:n]
        blocks.append(blob)
    data = b"".join(blocks)
    with Store.open(settings_factory(), create=True) as store:
        mid_reused = _ingest(store, blocks, reuse_buffer=True)
        mid_bytes = _ingest(store, blocks, reuse_buffer=False)
        assert mid_reused == mid_bytes  # same manifest: same chunk ids, same zero runs
        assert store.open_blob(Digest(mid_reused)).read(0, len(data)) == data


def test_partial_write_and_zeros_after_pipelined_chunks(settings_factory) -> None:
    """Out-of-order writes over chunks that may still be in flight see their final bytes."""
    with Store.open(settings_factory(), create=True) as store:
        with store.workspace() as ws:
            size = CS * 200
            w = ws.blob_writer(BLOB, size=size)
            model = bytearray(os.urandom(size))
            w.write(0, bytes(model))
            patch = os.urandom(100)
            w.write(CS * 150 + 10, patch)           # read-modify-write of a pipelined chunk
            model[CS * 150 + 10:CS * 150 + 110] = patch
            w.write_zeros(CS * 20, CS * 5)          # zero whole chunks that were in flight
            model[CS * 20:CS * 25] = bytes(CS * 5)
            again = os.urandom(CS * 64)
            w.write(CS * 100, again)                # whole chunks rewritten while others in flight
            model[CS * 100:CS * 164] = again
            mid = w.close()
            ws.commit()
        assert store.open_blob(mid).read(0, size) == bytes(model)
