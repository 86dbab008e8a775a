"""A node in its own process, for the two-node tests and benchmarks/remote_bench.py.

  writer DATA_DIR REPO_JSON SIZE SEED
      open the store (P2P on), commit SIZE random bytes as record "snap",
      print {"ticket", "mid", "sha256"} and serve peers until killed.
  reader DATA_DIR REPO_JSON TICKET MID FIRST [LOOKUP_MS]
      open the store (P2P on, the writer as peer), read [0, FIRST) of the blob,
      print counters, wait for a line on stdin, read the rest, print counters
      and the sha256 of the whole blob.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path

from aenv_store.assembly import open_node_store, peer_source
from aenv_store.config import P2PConfig, RepositoryConfig, StorePaths, StoreSettings
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.store import Store


def emit(obj: dict[str, object]) -> None:
    print(json.dumps(obj), flush=True)


def counters(store: Store) -> dict[str, object]:
    src = peer_source(store)
    return {"s3": store.backend.stats(), "p2p": src.status()["totals"] if src else {},
            "peers": src.status()["peers"] if src else []}


def writer(data_dir: Path, repo: RepositoryConfig, size: int, seed: int) -> None:
    data = random.Random(seed).randbytes(size)
    store = open_node_store(StoreSettings(StorePaths(data_dir), repository=repo, p2p=P2PConfig(enabled=True)),
                            create=True)
    with store.workspace() as ws:
        w = ws.blob_writer(size=size)
        w.write(0, data)
        mid = w.close()
        ws.commit(CatalogRecord(name="snap", kind="snapshot", manifests=(("disk", mid),), created=time.time()))
    peers = peer_source(store)
    assert peers is not None
    emit({"ticket": peers.ticket, "mid": mid.hex(), "sha256": hashlib.sha256(data).hexdigest()})
    while True:
        time.sleep(3600)


def reader(data_dir: Path, repo: RepositoryConfig, ticket: str, mid: str, first: int, lookup_ms: int,
           port: int = 0) -> None:
    settings = StoreSettings(StorePaths(data_dir), repository=repo,
                             p2p=P2PConfig(enabled=True, peers=(ticket,), lookup_timeout_ms=lookup_ms, port=port))
    with open_node_store(settings) as store:
        blob = store.open_blob(Digest.from_hex(mid))
        h = hashlib.sha256()
        t = time.perf_counter()
        h.update(blob.read(0, first))
        emit({"phase": "first", "seconds": time.perf_counter() - t, **counters(store)})
        sys.stdin.readline()
        pos = first
        while pos < blob.size:  # the rest in 1 MiB reads, as a lazily reading VM would
            n = min(1 << 20, blob.size - pos)
            h.update(blob.read(pos, n))
            pos += n
        emit({"phase": "done", "sha256": h.hexdigest(), **counters(store)})


def main() -> None:
    role, data_dir, repo_json = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    repo = RepositoryConfig(**json.loads(repo_json))
    if role == "writer":
        writer(data_dir, repo, int(sys.argv[4]), int(sys.argv[5]))
    else:
        reader(data_dir, repo, sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7]) if len(sys.argv) > 7 else 300,
               int(sys.argv[8]) if len(sys.argv) > 8 else 0)


if __name__ == "__main__":
    main()
