"""A process reading chunks through its own Store on a shared data dir (one node
cache), for tests/store/test_read_chain.py.

    read_worker.py DATA_DIR REPO MID LOGFILE THREADS SLEEP
        open the Store, count every chunk read from the repository (appended to
        LOGFILE, one hex id a line; each repository read sleeps SLEEP seconds so
        readers overlap), print "ready", wait for a line on stdin, then THREADS
        threads read all chunks of manifest MID with Store.read_chunks (in
        batches of 8, the thread's own order); print "ok" if the bytes are right.
"""
from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path

from aenv_store.formats.ids import Digest
from aenv_store.formats.index import IndexEntry
from aenv_store.store import Store

from tests.store.conftest import make_settings


def log_reads(logfile: str, cids: list[bytes], sleep: float) -> None:
    fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(f"{bytes(c).hex()}\n" for c in cids).encode())  # one append: atomic
    finally:
        os.close(fd)
    time.sleep(sleep)


def main(argv: list[str]) -> int:
    data_dir, repo, mid, logfile, threads, sleep = (Path(argv[0]), Path(argv[1]), Digest.from_hex(argv[2]),
                                                    argv[3], int(argv[4]), float(argv[5]))
    with Store.open(make_settings(data_dir, repo)) as store:
        repository = store.repository
        read_chunk, read_run = repository.read_chunk, repository.read_run

        def counting_read_chunk(chunk, *a, **k):  # type: ignore[no-untyped-def]
            log_reads(logfile, [chunk], sleep)
            return read_chunk(chunk, *a, **k)

        def counting_read_run(run: list[IndexEntry], *a, **k):  # type: ignore[no-untyped-def]
            log_reads(logfile, [e.chunk for e in run], sleep)
            return read_run(run, *a, **k)

        repository.read_chunk = counting_read_chunk  # type: ignore[method-assign]
        repository.read_run = counting_read_run  # type: ignore[method-assign]
        cids = [e.chunk for e in store.load_manifest(mid).extents if e.chunk is not None]
        results: list[bool] = []

        def body(i: int) -> None:
            order = cids[:]
            random.Random(i).shuffle(order)
            ok = True
            for lo in range(0, len(order), 8):
                part = order[lo:lo + 8]
                ok &= all(Digest.of(d) == c for c, d in zip(part, store.read_chunks(part)))
            results.append(ok)

        print("ready", flush=True)
        sys.stdin.readline()
        workers = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    ok = len(results) == threads and all(results)
    print("ok" if ok else "bad", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
