"""Acceptance 5: under a random workload the cache never exceeds its capacity,
pinned entries survive eviction pressure, and every hit returns the bytes put."""
from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import blake3
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aenv_store.cache.node_cache import NodeCache
from aenv_store.cache.segments import ALIGN
from aenv_store.config import CacheConfig
from aenv_store.formats.ids import Digest

MAX_CHUNK = 65536
CAPACITY = 4 * MAX_CHUNK


def chunk(seed: int, size: int) -> bytes:
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


def disk_bytes(cache: NodeCache) -> tuple[int, int]:
    """(segment files, their bytes)."""
    files = total = 0
    with os.scandir(cache.path / "data") as shards:
        for shard in shards:
            with os.scandir(shard.path) as entries:
                for f in entries:
                    files += 1
                    total += f.stat().st_size
    return files, total


class CacheMachine(RuleBasedStateMachine):
    """Model: the bytes of every digest ever seen, and our pin counts."""

    def __init__(self) -> None:
        super().__init__()
        # tmpfs when there is one: each example creates a cache, and the fsyncs of
        # create/close on a busy disk would dominate the run time
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="aenv-cache-sm-", dir=shm))
        self.config = CacheConfig(capacity=CAPACITY, high_watermark=0.9, low_watermark=0.6, min_free_disk=0)
        self.cache = NodeCache(self.dir / "c", self.config)
        self.known: dict[Digest, bytes] = {}
        self.pins: dict[Digest, int] = {}
        self.fetches = 0
        # pinned digests seen cached while pinned: these must stay cached until unpinned
        self.cached_while_pinned: set[Digest] = set()

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _note_cached(self, d: Digest) -> None:
        if self.pins.get(d, 0) > 0 and self.cache.contains(d):
            self.cached_while_pinned.add(d)

    @rule(seed=st.integers(0, 30), size=st.sampled_from([1, 4096, 30000, MAX_CHUNK]))
    def put(self, seed: int, size: int) -> None:
        data = chunk(seed * 7 + size, size)
        d = Digest.of(data)
        self.known[d] = data
        self.cache.put(d, data)
        self._note_cached(d)

    @rule(seed=st.integers(0, 30), size=st.sampled_from([4096, MAX_CHUNK]))
    def get_or_fetch(self, seed: int, size: int) -> None:
        data = chunk(seed * 7 + size, size)
        d = Digest.of(data)
        self.known[d] = data

        def fetch() -> bytes:
            self.fetches += 1
            return data

        before = self.cache.contains(d)
        fetches = self.fetches
        assert self.cache.get_or_fetch(d, fetch) == data
        assert self.fetches == fetches + (0 if before else 1)
        self._note_cached(d)

    @precondition(lambda self: bool(self.known))
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        d = data.draw(st.sampled_from(sorted(self.known)))
        got = self.cache.get(d)
        assert got is None or got == self.known[d]

    @precondition(lambda self: bool(self.known))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        d = data.draw(st.sampled_from(sorted(self.known)))
        self.cache.pin([d])
        self.pins[d] = self.pins.get(d, 0) + 1
        self._note_cached(d)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        d = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.cache.unpin([d])
        self.pins[d] -= 1
        if not self.pins[d]:
            self.cached_while_pinned.discard(d)

    @rule()
    def reopen(self) -> None:
        # pins belong to the instance: closing releases them
        self.cache.close()
        self.cache = NodeCache(self.dir / "c", self.config)
        self.pins.clear()
        self.cached_while_pinned.clear()

    @invariant()
    def bounded(self) -> None:
        st_ = self.cache.stats()
        assert st_.used_bytes <= CAPACITY  # stronger than "capacity + one chunk"
        # every chunk here is its own segment: a header page and its bytes padded to a page
        files, size = disk_bytes(self.cache)
        assert st_.used_bytes <= size <= st_.used_bytes + files * 2 * ALIGN
        # index <-> files, totals, and the lru table listing exactly the unpinned entries
        assert self.cache.verify() == []

    @invariant()
    def pinned_survive(self) -> None:
        for d in self.cached_while_pinned:
            assert self.cache.get(d) == self.known[d]


CacheMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase


def test_seeded_random_workload(tmp_path: Path) -> None:
    """Many operations with a fixed seed, checked against a model after every step."""
    rng = random.Random(20261129)
    cap = 32 * MAX_CHUNK
    config = CacheConfig(capacity=cap, min_free_disk=0)
    cache = NodeCache(tmp_path / "c", config)
    known: dict[Digest, bytes] = {}
    pinned: list[Digest] = []
    try:
        for step in range(3000):
            op = rng.random()
            size = rng.choice([4096, 16384, MAX_CHUNK, rng.randrange(1, MAX_CHUNK + 1)])
            data = chunk(rng.randrange(400), size)
            d = Digest.of(data)
            known[d] = data
            if op < 0.5:
                cache.put(d, data)
            elif op < 0.8:
                assert cache.get_or_fetch(d, lambda: data) == data
            elif op < 0.9 and len(pinned) < 12:
                cache.get_or_fetch(d, lambda: data)
                cache.pin([d])
                pinned.append(d)
            elif pinned:
                cache.unpin([pinned.pop(rng.randrange(len(pinned)))])
            used = cache.stats().used_bytes if step % 10 == 0 else None
            assert used is None or used <= cap
            for p in pinned:
                assert cache.contains(p), f"pinned {p} evicted at step {step}"
        st_ = cache.stats()
        assert st_.evictions > 100 and st_.used_bytes <= cap
        assert cache.verify(read_data=True) == []
        for d, b in known.items():
            got = cache.get(d)
            assert got is None or got == b
    finally:
        cache.close()
