"""The node cache's LMDB environment, opened once per directory per process.

LMDB forbids opening one environment twice in a process (closing either copy
would drop the other's fcntl locks on lock.mdb), so the NodeCache instances of
a process share one ``SharedEnv`` per directory through an ``EnvRegistry``;
the last instance to release it syncs and closes it. py-lmdb also remembers
environments across fork(): a forked child gets a fresh registry and must
open its own caches (NodeCache enforces that).
"""
from __future__ import annotations

import logging
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import lmdb

from ..errors import StoreError
from .index import FORMAT, IndexDbs

log = logging.getLogger(__name__)

# LMDB map size is virtual address space, not disk; a constant keeps every process that
# opens the directory in agreement (a per-capacity value would force MDB_MAP_RESIZED dances).
MAP_SIZE = 32 << 30
MAX_READERS = 1024
MAX_DBS = 8  # five in use; room to open an older layout far enough to read its format


def boot_id() -> bytes:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_bytes().strip()
    except OSError:
        return b"unknown"


@dataclass
class SharedEnv:
    env: lmdb.Environment
    dbs: IndexDbs
    refs: int = 0


def wipe(cache_dir: Path) -> None:
    """An empty cache directory (index and segment files removed, and the chunk files and
    temporaries of format 1)."""
    for name in ("index", "data", "tmp"):
        shutil.rmtree(cache_dir / name, ignore_errors=True)
    for name in ("index", "data"):
        (cache_dir / name).mkdir(exist_ok=True)


def open_env(cache_dir: Path, wipe_if_bad: bool) -> tuple[lmdb.Environment, IndexDbs]:
    """Open (creating) the index of ``cache_dir``; an unusable index is wiped and
    recreated only when ``wipe_if_bad`` (the first user of the directory)."""
    try:
        env = lmdb.open(str(cache_dir / "index"), map_size=MAP_SIZE, max_dbs=MAX_DBS, max_readers=MAX_READERS,
                        sync=False, metasync=False, readahead=False)
        try:
            env.reader_check()  # free reader slots of dead processes
            # the format first: another layout may have other tables (format 1 had `dying`)
            meta = env.open_db(b"meta")
            with env.begin(db=meta) as txn:
                fmt = txn.get(b"format")
                empty = fmt is None and txn.stat(meta)["entries"] == 0
            if fmt is not None and bytes(fmt) != FORMAT or fmt is None and not empty:
                raise StoreError(f"node cache index has format {bytes(fmt) if fmt else None!r}, "
                                 f"this build uses {FORMAT!r}")
            dbs = IndexDbs(env)
            if fmt is None:
                with env.begin(write=True) as txn:
                    dbs.set_meta(txn, b"format", FORMAT)
        except BaseException:
            env.close()
            raise
        return env, dbs
    except (lmdb.Error, StoreError) as e:
        if "already open in this process" in str(e):
            # py-lmdb remembers environments across fork(): the parent opened this one
            raise StoreError(f"node cache {cache_dir} was opened before fork(); a forked child cannot "
                             "reopen it (use the 'spawn' start method, or open it only in the child)") from None
        if not wipe_if_bad:
            # another process uses it (perhaps an older build, with its layout): refuse, never mix
            raise StoreError(f"node cache index at {cache_dir / 'index'} is unusable: {e}") from None
        log.warning("node cache %s: index unusable (%s); starting empty", cache_dir, e)
        wipe(cache_dir)
        return open_env(cache_dir, wipe_if_bad=False)


class EnvRegistry:
    """This process's open environments, by cache directory."""

    def __init__(self) -> None:
        self._envs: dict[str, SharedEnv] = {}
        self._lock = threading.Lock()

    def acquire(self, cache_dir: Path, wipe_if_bad: bool) -> SharedEnv:
        with self._lock:
            shared = self._envs.get(str(cache_dir))
            if shared is None:
                shared = self._envs[str(cache_dir)] = SharedEnv(*open_env(cache_dir, wipe_if_bad))
            shared.refs += 1
            return shared

    def release(self, cache_dir: Path, shared: SharedEnv) -> None:
        with self._lock:
            shared.refs -= 1
            if shared.refs == 0:
                del self._envs[str(cache_dir)]
                shared.env.sync(True)
                shared.env.close()
