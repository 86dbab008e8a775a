"""Single-flight across threads and processes (single and batched reads), failing
fetches, and crash safety (SIGKILL of processes in the middle of puts/evictions,
repeated)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import blake3
import pytest

from aenv_store.cache.node_cache import NodeCache
from aenv_store.cache.segments import SegmentFormatError, read_header
from aenv_store.config import CacheConfig
from aenv_store.formats.ids import Digest

from .cache_worker import release_and_collect

WORKER = Path(__file__).with_name("cache_worker.py")
S = 65536


def chunk(seed: int, size: int) -> bytes:
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[NodeCache]:
    c = NodeCache(tmp_path / "cache", CacheConfig(capacity=64 * S, min_free_disk=0))
    yield c
    c.close()


def run_threads(n: int, target) -> list:  # type: ignore[no-untyped-def]
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def body(i: int) -> None:
        barrier.wait()
        try:
            results[i] = target(i)
        except BaseException as e:  # collected and checked by the test
            results[i] = e

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_single_flight_threads(cache: NodeCache) -> None:
    data = chunk(1, S)
    digest = Digest.of(data)
    calls = []

    def fetch() -> bytes:
        calls.append(1)
        time.sleep(0.2)
        return data

    results = run_threads(16, lambda i: cache.get_or_fetch(digest, fetch))
    assert len(calls) == 1
    assert all(r == data for r in results)
    st = cache.stats()
    assert (st.fetches, st.misses, st.entries) == (1, 16, 1)


def test_failing_fetch_propagates_to_all_waiters(cache: NodeCache) -> None:
    data = chunk(2, S)
    digest = Digest.of(data)
    calls = []

    def failing() -> bytes:
        calls.append(1)
        time.sleep(0.2)
        raise RuntimeError("repository unreachable")

    results = run_threads(8, lambda i: cache.get_or_fetch(digest, failing))
    assert len(calls) == 1
    assert all(isinstance(r, RuntimeError) and "unreachable" in str(r) for r in results)
    assert not cache.contains(digest) and cache.stats().entries == 0
    assert not list((cache.path / "data").glob("*/*.seg"))  # nothing written for a failed fetch
    # no negative caching: the next caller fetches again
    assert cache.get_or_fetch(digest, lambda: data) == data
    assert cache.get(digest) == data


def test_many_digests_each_fetched_once(cache: NodeCache) -> None:
    items = [(Digest.of(b), b) for b in (chunk(100 + i, 4096) for i in range(40))]
    counts: dict[Digest, int] = {}
    lock = threading.Lock()

    def worker(i: int) -> bool:
        order = items[:]
        random.Random(i).shuffle(order)
        for d, b in order:
            def fetch(d: Digest = d, b: bytes = b) -> bytes:
                with lock:
                    counts[d] = counts.get(d, 0) + 1
                time.sleep(0.001)
                return b
            assert cache.get_or_fetch(d, fetch) == b
        return True

    assert run_threads(6, worker) == [True] * 6
    assert counts == {d: 1 for d, _ in items}


def test_batched_reads_single_flight_threads_any_order(cache: NodeCache) -> None:
    """Overlapping batches in opposite and shuffled orders, mixed with single reads:
    nobody deadlocks and every chunk is fetched exactly once."""
    items = [(Digest.of(b), b) for b in (chunk(300 + i, 4096) for i in range(48))]
    by_digest = dict(items)
    counts: dict[Digest, int] = {}
    lock = threading.Lock()

    def fetch(missing: list[Digest]) -> list[bytes]:
        with lock:
            for d in missing:
                counts[d] = counts.get(d, 0) + 1
        time.sleep(0.02)
        return [by_digest[d] for d in missing]

    def worker(i: int) -> bool:
        order = [d for d, _ in items]
        if i % 3 == 1:
            order.reverse()
        elif i % 3 == 2:
            random.Random(i).shuffle(order)
        if i == 5:  # one thread asks chunk by chunk
            return all(cache.get_or_fetch(d, lambda d=d: fetch([d])[0]) == by_digest[d] for d in order)
        for lo in range(0, len(order), 16):
            part = order[lo:lo + 16] + order[lo:lo + 2]  # duplicates in a batch are fine
            assert cache.get_or_fetch_many(part, fetch) == [by_digest[d] for d in part]
        return True

    assert run_threads(8, worker) == [True] * 8
    assert counts == {d: 1 for d, _ in items}
    st = cache.stats()
    assert (st.fetches, st.entries) == (len(items), len(items))


def test_a_fetch_handed_to_the_write_behind_is_not_fetched_again(cache: NodeCache,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The interleaving that once fetched a chunk twice: thread A misses (index and
    write-behind both checked), then thread B fetches the chunk, hands it to the
    write-behind (not yet indexed) and ends its flight; only then does A take the lead.
    Fetch locks do not exclude threads of one process, so A must find B's bytes in the
    write-behind instead of fetching again."""
    data = chunk(900, 4096)
    d = Digest.of(data)
    fetches: list[str] = []
    a_in_fill, b_done, indexed_gate = threading.Event(), threading.Event(), threading.Event()
    real_fill, real_store = cache._fill, cache._writes._store
    a_thread: list[threading.Thread] = []

    def fill(*args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread() in a_thread:
            a_in_fill.set()
            assert b_done.wait(10)
        return real_fill(*args, **kwargs)

    def store(items):  # type: ignore[no-untyped-def]
        assert indexed_gate.wait(10)      # the write-behind indexes only when the test says
        return real_store(items)

    monkeypatch.setattr(cache, "_fill", fill)
    monkeypatch.setattr(cache._writes, "_store", store)

    def fetch(name: str):  # type: ignore[no-untyped-def]
        def run(missing: list[Digest]) -> list[bytes]:
            fetches.append(name)
            return [data for _ in missing]
        return run

    got: list[bytes] = []
    a = threading.Thread(target=lambda: got.extend(cache.get_or_fetch_many([d], fetch("A"))))
    a_thread.append(a)
    a.start()
    assert a_in_fill.wait(10)
    assert cache.get_or_fetch_many([d], fetch("B")) == [data]   # handed over, not indexed
    b_done.set()
    a.join(10)
    indexed_gate.set()
    assert not a.is_alive() and got == [data]
    assert fetches == ["B"]
    assert cache.get_or_fetch_many([d], fetch("C")) == [data] and fetches == ["B"]


def test_batched_fetch_failure_reaches_the_waiters_and_caches_nothing(cache: NodeCache) -> None:
    items = [(Digest.of(b), b) for b in (chunk(400 + i, 4096) for i in range(6))]
    calls = []

    def failing(missing: list[Digest]) -> list[bytes]:
        calls.append(list(missing))
        time.sleep(0.2)
        raise RuntimeError("repository unreachable")

    results = run_threads(4, lambda i: cache.get_or_fetch_many([d for d, _ in items], failing))
    assert len(calls) == 1 and sorted(calls[0]) == sorted(d for d, _ in items)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert cache.stats().entries == 0
    assert cache.get_or_fetch_many([d for d, _ in items], lambda m: [dict(items)[d] for d in m]) == [b for _, b in items]


def test_mapped_reads_check_the_file_and_refetch_a_bad_one(cache: NodeCache) -> None:
    import mmap

    (d1, b1), (d2, b2), (d3, b3) = items = [(Digest.of(b), b) for b in (chunk(500 + i, S) for i in range(3))]
    cache.put_many(items)
    l1, l2 = cache.location_of(d1), cache.location_of(d2)
    assert l1 is not None and l2 is not None and l1.path == l2.path  # one put_many: one segment
    with open(l1.path, "r+b") as f:  # same size, one byte flipped
        f.seek(l1.offset + S - 1)
        f.write(bytes([b1[-1] ^ 1]))
    os.truncate(l2.path, l2.offset + S // 2)  # d2 cut short, d3 (after it) gone with it
    fetched: list[Digest] = []

    def fetch(missing: list[Digest]) -> list[bytes]:
        fetched.extend(missing)
        return [dict(items)[d] for d in missing]

    got = cache.get_or_fetch_many([d1, d2, d3], fetch, mapped=True)
    assert [bytes(g) for g in got] == [b1, b2, b3]
    assert sorted(fetched) == sorted([d1, d2, d3])        # the bad ones, refetched
    assert all(isinstance(g, mmap.mmap) for g in got)     # the refetched ones are mapped too
    assert cache.stats().corrupt == 3
    assert cache.verify(read_data=True) == []


def start_worker(*args: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        raise AssertionError(f"worker did not start: {line!r}")
    return proc


def test_single_flight_across_processes(tmp_path: Path) -> None:
    log = tmp_path / "fetches.log"
    log.touch()
    procs = [start_worker("fetch", tmp_path / "cache", 64 * S, 7, log, 4) for _ in range(3)]
    outs = release_and_collect(procs)
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert all(o.strip() == "ok" for o in outs)
    assert len(log.read_text().split()) == 1  # 3 processes x 4 threads, one fetch
    with NodeCache(tmp_path / "cache", CacheConfig(capacity=64 * S, min_free_disk=0)) as c:
        st = c.stats()
        assert (st.fetches, st.entries) == (1, 1)
        assert c.get(Digest.of(chunk(7, S))) == chunk(7, S)


def test_batched_single_flight_across_processes(tmp_path: Path) -> None:
    """Two processes (three threads each) read the same 32 cold chunks in batches, in
    opposite orders: each chunk is fetched once in all, and nobody deadlocks."""
    log = tmp_path / "fetches.log"
    log.touch()
    procs = [start_worker("fetch_many", tmp_path / "cache", 64 * S, 1000, 32, log, 3, 0.3, order)
             for order in ("forward", "reverse")]
    outs = release_and_collect(procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert all(o.strip() == "ok" for o in outs)
    fetched = log.read_text().split()
    assert len(fetched) == 32 and len(set(fetched)) == 32
    with NodeCache(tmp_path / "cache", CacheConfig(capacity=64 * S, min_free_disk=0)) as c:
        assert (c.stats().fetches, c.stats().entries) == (32, 32)


def check_contents(c: NodeCache, capacity: int) -> int:
    """Every chunk a segment file lists reads back as the bytes of its digest (or as a miss),
    as bytes and mapped."""
    seen = 0
    digests: set[Digest] = set()
    for f in (c.path / "data").glob("*/*.seg"):
        try:
            digests.update(Digest(i.digest) for i in read_header(str(f)))
        except (OSError, SegmentFormatError):
            pass  # a segment being written, or evicted meanwhile, or torn by the kill
    for d in digests:
        data = c.get(d)
        if data is not None:
            assert Digest.of(data) == d
            (mapped,) = c.get_or_fetch_many([d], lambda _m, data=data: [data], mapped=True)
            assert Digest.of(bytes(mapped)) == d
            seen += 1
    assert c.stats().used_bytes <= capacity
    return seen


def kill_after(proc: subprocess.Popen[str], rng: random.Random) -> None:
    time.sleep(rng.uniform(0.02, 0.4))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_sigkill_mid_put_leaves_consistent_cache(tmp_path: Path) -> None:
    rng = random.Random(1234)
    cap = 16 * S
    directory = tmp_path / "cache"
    for i in range(15):
        kill_after(start_worker("churn", directory, cap, i), rng)
        with NodeCache(directory, CacheConfig(capacity=cap, min_free_disk=0)) as c:
            # first user after a crash: reconciled, so index and files agree exactly
            assert c.verify(read_data=True) == []
            assert check_contents(c, cap) == c.stats().entries
            assert c.stats().pinned == 0  # the dead worker's pins are gone
    with NodeCache(directory, CacheConfig(capacity=cap, min_free_disk=0)) as c:
        st = c.stats()
        assert st.entries > 0 and st.evictions > 0  # the workers really churned


@pytest.mark.slow
def test_sigkill_while_others_keep_using_the_cache(tmp_path: Path) -> None:
    rng = random.Random(99)
    cap = 16 * S
    directory = tmp_path / "cache"
    survivor = NodeCache(directory, CacheConfig(capacity=cap, min_free_disk=0))
    try:
        for i in range(8):
            procs = [start_worker("churn", directory, cap, 100 * i + k) for k in range(2)]
            time.sleep(rng.uniform(0.02, 0.3))
            for p in procs:
                kill_after(p, rng)
            # no reconciliation happens while we hold the directory: reads must still be right
            check_contents(survivor, cap)
            for k in range(20):  # and the cache keeps working
                data = chunk(10_000 + 100 * i + k, S)
                assert survivor.get_or_fetch(Digest.of(data), lambda: data) == data
    finally:
        survivor.close()
    # a crashed user means the directory is not clean: the next first user reconciles
    with NodeCache(directory, CacheConfig(capacity=cap, min_free_disk=0)) as c:
        assert c.verify(read_data=True) == []
        assert check_contents(c, cap) == c.stats().entries


def test_threads_under_eviction_pressure(tmp_path: Path) -> None:
    """Reads, fetches, pins and evictions from several threads at once on a tiny cache."""
    cap = 8 * S
    items = [(Digest.of(b), b) for b in (chunk(5000 + i, rnd) for i, rnd in
                                         enumerate(random.Random(3).choices([4096, 30000, S], k=60)))]
    with NodeCache(tmp_path / "c", CacheConfig(capacity=cap, min_free_disk=0)) as c:
        def worker(i: int) -> int:
            rng = random.Random(i)
            for _ in range(300):
                d, b = items[rng.randrange(len(items))]
                op = rng.random()
                if op < 0.5:
                    assert c.get_or_fetch(d, lambda: b) == b
                elif op < 0.8:
                    got = c.get(d)
                    assert got is None or got == b
                elif op < 0.9:
                    c.put(d, b)
                else:
                    c.pin([d])
                    assert c.get_or_fetch(d, lambda: b) == b
                    c.unpin([d])
                assert c.stats().used_bytes <= cap if op < 0.05 else True
            return 0

        assert run_threads(4, worker) == [0, 0, 0, 0]
        st = c.stats()
        assert st.used_bytes <= cap and st.evictions > 0 and st.pinned == 0
        assert c.verify(read_data=True) == []


def test_waiter_takes_over_when_the_fetching_process_dies(tmp_path: Path) -> None:
    log = tmp_path / "fetches.log"
    log.touch()
    directory = tmp_path / "cache"
    leader = start_worker("fetch", directory, 64 * S, 8, log, 1, 600)  # its fetch never ends
    waiter = None
    try:
        assert leader.stdin is not None
        leader.stdin.write("go\n")
        leader.stdin.flush()
        deadline = time.monotonic() + 30
        while not log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert log.read_text().split() == [str(leader.pid)]  # the leader is inside its fetch
        waiter = start_worker("fetch", directory, 64 * S, 8, log, 2, 0.05)
        assert waiter.stdin is not None
        waiter.stdin.write("go\n")
        waiter.stdin.flush()
        time.sleep(0.5)
        assert waiter.poll() is None  # blocked on the leader's in-flight lock
        os.kill(leader.pid, signal.SIGKILL)  # the kernel drops its lock
        leader.wait()
        out, _ = waiter.communicate(timeout=60)
        assert waiter.returncode == 0 and out.strip() == "ok"
        assert log.read_text().split() == [str(leader.pid), str(waiter.pid)]  # exactly one more fetch
    finally:
        for p in (leader, waiter):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    with NodeCache(directory, CacheConfig(capacity=64 * S, min_free_disk=0)) as c:
        assert c.get(Digest.of(chunk(8, S))) == chunk(8, S)
        assert c.verify() == []
