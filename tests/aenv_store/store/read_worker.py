"""A process reading chunks through its own Store on a shared data dir (one node
cache), for tests/aenv_store/store/test_read_chain.py.

    read_worker.py DATA_DIR REPO MID LOGFILE THREADS SLEEP
        open the Store, count every chunk read from the repository (appended to
        LOGFILE, one hex id a line; each repository read sleeps SLEEP seconds so
        readers overlap), print "ready", wait for a line on stdin, then THREADS
        threads read all chunks of manifest MID with Store.read_chunks (in
        batches of 8, the thread's own order); print "ok" if the bytes are right.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from aenv_store.formats.ids import Digest
from aenv_store.formats.index import IndexEntry
from aenv_store.store import Store

from tests.aenv_store.cache.cache_worker import append_lines, run_threads_and_report
from tests.aenv_store.store.conftest import make_settings


def log_reads(logfile: str, cids: list[bytes], sleep: float) -> None:
    append_lines(logfile, [bytes(c).hex() for c in cids])
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

        def body(i: int) -> bool:
            order = cids[:]
            random.Random(i).shuffle(order)
            return all(Digest.of(d) == c for lo in range(0, len(order), 8)
                       for c, d in zip(order[lo:lo + 8], store.read_chunks(order[lo:lo + 8])))

        return run_threads_and_report(threads, body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
