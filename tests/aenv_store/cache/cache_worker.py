"""A separate process using a node cache directory, driven by the cache tests.

    cache_worker.py fetch DIR CAPACITY SEED LOGFILE THREADS [SLEEP]
        print "ready", wait for a line on stdin, then THREADS threads call
        get_or_fetch on one digest; the fetch appends a line to LOGFILE and
        sleeps SLEEP seconds (default 0.5) so that the others pile up. Prints
        "ok" if every thread got the data.
    cache_worker.py fetch_many DIR CAPACITY SEED N LOGFILE THREADS SLEEP ORDER
        print "ready", wait for a line on stdin, then THREADS threads call
        get_or_fetch_many on chunk(SEED..SEED+N-1, 4096), in order (ORDER
        "forward"), reversed ("reverse") or shuffled per thread ("shuffle");
        the fetch appends the digests it fetches to LOGFILE (one hex line each)
        and sleeps SLEEP seconds. Prints "ok" if every thread got the data.
    cache_worker.py churn DIR CAPACITY SEED
        print "ready", then put/put_many/get/pin/unpin random chunks forever (until killed).
    cache_worker.py dirty DIR CAPACITY N
        put chunks chunk(0..N-1, 4096), pin the first, then exit without closing
        (what a crash after those operations leaves behind).

Helpers for worker processes (also tests/aenv_store/store/read_worker.py): append_lines,
run_threads_and_report; and for the tests that drive them: release_and_collect.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import blake3

from aenv_store.cache.node_cache import NodeCache
from aenv_store.config import CacheConfig
from aenv_store.formats.ids import Digest


def chunk(seed: int, size: int) -> bytes:
    """Deterministic content: any process can recompute and check it."""
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


def append_lines(logfile: str, lines: list[str]) -> None:
    """Append lines to a log shared by processes, in one write (O_APPEND: not interleaved)."""
    fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(f"{line}\n" for line in lines).encode())
    finally:
        os.close(fd)


def run_threads_and_report(threads: int, body: Callable[[int], bool]) -> int:
    """print "ready", wait for a line on stdin, run body(0..threads-1) on threads, print
    "ok" if all returned True; the exit status."""
    results: list[bool] = []
    print("ready", flush=True)
    sys.stdin.readline()
    workers = [threading.Thread(target=lambda i=i: results.append(body(i))) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    ok = len(results) == threads and all(results)
    print("ok" if ok else "bad", flush=True)
    return 0 if ok else 1


def release_and_collect(procs: list[subprocess.Popen[str]], timeout: float = 60) -> list[str]:
    """Send "go" to workers that all said ready (so they start together); their output.
    Workers still running afterwards (a failed test) are killed."""
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def fetch_mode(cache: NodeCache, seed: int, logfile: str, threads: int, sleep: float) -> int:
    data = chunk(seed, 65536)
    digest = Digest.of(data)

    def fetch() -> bytes:
        with open(logfile, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(sleep)
        return data

    results: list[bytes] = []
    print("ready", flush=True)
    sys.stdin.readline()
    workers = [threading.Thread(target=lambda: results.append(cache.get_or_fetch(digest, fetch)))
               for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    ok = len(results) == threads and all(r == data for r in results)
    print("ok" if ok else "bad", flush=True)
    return 0 if ok else 1


def fetch_many_mode(cache: NodeCache, seed: int, n: int, logfile: str, threads: int, sleep: float,
                    order: str) -> int:
    items = [chunk(seed + i, 4096) for i in range(n)]
    by_digest = {Digest.of(b): b for b in items}

    def fetch(missing: list[Digest]) -> list[bytes]:
        append_lines(logfile, [d.hex() for d in missing])
        time.sleep(sleep)
        return [by_digest[d] for d in missing]

    def body(i: int) -> bool:
        digests = list(by_digest)
        if order == "reverse":
            digests.reverse()
        elif order == "shuffle":
            random.Random(i).shuffle(digests)
        got = cache.get_or_fetch_many(digests, fetch)
        return all(g == by_digest[d] for d, g in zip(digests, got))

    return run_threads_and_report(threads, body)


def churn_mode(cache: NodeCache, seed: int) -> int:
    rng = random.Random(seed)
    pinned: list[Digest] = []
    print("ready", flush=True)
    while True:
        op = rng.random()
        n = rng.randrange(200)
        size = rng.choice((4096, 16384, 65536, rng.randrange(1, 65536)))
        data = chunk(n * 1000 + size % 997, size)
        digest = Digest.of(data)
        if op < 0.45:
            cache.put(digest, data)
        elif op < 0.6:  # a batch: one segment of several chunks (what a fill of misses writes)
            batch = [(Digest.of(b), b) for b in (chunk(rng.randrange(200) * 1000 + 7, size) for _ in range(4))]
            cache.put_many(batch + [(digest, data)])
        elif op < 0.8:
            got = cache.get(digest)
            assert got is None or got == data
        elif op < 0.9:
            cache.get_or_fetch(digest, lambda: data)
        elif op < 0.95 or not pinned:
            cache.pin([digest])
            pinned.append(digest)
        else:
            cache.unpin([pinned.pop(rng.randrange(len(pinned)))])


def main(argv: list[str]) -> int:
    mode, directory, capacity = argv[0], Path(argv[1]), int(argv[2])
    cache = NodeCache(directory, CacheConfig(capacity=capacity, min_free_disk=0))
    if mode == "dirty":
        items = [chunk(i, 4096) for i in range(int(argv[3]))]
        for data in items:
            assert cache.put(Digest.of(data), data)
        cache.pin([Digest.of(items[0])])
        sys.stdout.flush()
        os._exit(0)  # no close(): the directory stays marked as in use by a user that vanished
    try:
        if mode == "fetch_many":
            return fetch_many_mode(cache, int(argv[3]), int(argv[4]), argv[5], int(argv[6]), float(argv[7]), argv[8])
        if mode == "fetch":
            return fetch_mode(cache, int(argv[3]), argv[4], int(argv[5]), float(argv[6]) if argv[6:] else 0.5)
        return churn_mode(cache, int(argv[3]))
    finally:
        cache.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
