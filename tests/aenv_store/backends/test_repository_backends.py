"""Repository-level behaviour on both backends (posix_fs and oss on moto):
workspace -> commit -> fresh Store read, exclusive records under concurrency,
crash safety of an interrupted commit, verify and gc."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from aenv_store.admin.gc import gc
from aenv_store.admin.verify import verify
from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_store.errors import AlreadyExists, BackendError, Conflict
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.repository.backends.base import Backend
from aenv_store.repository.backends.factory import open_backend
from aenv_store.repository.repository import RecordVersion, Repository
from aenv_store.store import Store, describe_location
from aenv_store.workspace import Workspace


def settings(data_dir: Path, repo: RepositoryConfig) -> StoreSettings:
    # small chunks and 1 MiB packs: several packs per test, cheaply
    return StoreSettings(paths=StorePaths(data_dir), repository=repo,
                         store=StoreConfig(chunk_size=4096, pack_target_size=1 << 20),
                         cache=CacheConfig(capacity=64 << 20, min_free_disk=0))


def commit_blob(store: Store, data: bytes, name: str) -> Digest:
    with store.workspace() as ws:
        w = ws.blob_writer(size=len(data))
        w.write(0, data)
        mid = w.close()
        ws.commit(CatalogRecord(name=name, kind="snapshot", manifests=(("disk", mid),)))
    return mid


def test_round_trip_through_a_fresh_node(repository_config: RepositoryConfig, tmp_path: Path) -> None:
    data = os.urandom(1 << 20) + bytes(300_000) + os.urandom(2 << 20)
    with Store.open(settings(tmp_path / "a", repository_config), create=True) as a:
        mid = commit_blob(a, data, "snap-1")
    with Store.open(settings(tmp_path / "b", repository_config)) as b:  # another node: empty cache
        rec = b.resolve("snap-1")
        assert rec.manifests == (("disk", mid),)
        blob = b.open_blob(mid)
        assert blob.size == len(data)
        assert blob.read(0, len(data)) == data
        assert blob.read(1 << 20, 300_000) == bytes(300_000)
        assert blob.read(len(data) - 10, 100) == data[-10:]
        assert [r.name for r in b.list_records()] == ["snap-1"]
        with pytest.raises(AlreadyExists):
            commit_blob(b, b"other", "snap-1")


def test_concurrent_exclusive_commits_one_winner(repository_config: RepositoryConfig, tmp_path: Path) -> None:
    Store.open(settings(tmp_path / "init", repository_config), create=True).close()
    n = 4
    stores = [Store.open(settings(tmp_path / f"n{i}", repository_config)) for i in range(n)]
    wins: list[int] = []
    losses: list[int] = []
    barrier = threading.Barrier(n)

    def go(i: int) -> None:
        ws = stores[i].workspace()
        w = ws.blob_writer()
        w.append(os.urandom(20_000))
        mid = w.close()
        barrier.wait()
        try:
            ws.commit(CatalogRecord(name="contested", kind="snapshot", manifests=(("disk", mid),)))
            wins.append(i)
        except AlreadyExists:
            losses.append(i)
            ws.abort()

    try:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(wins) == 1 and len(losses) == n - 1
        rec = stores[0].get_record("contested")
        blob = stores[0].open_blob(rec.manifests[0][1])
        assert len(blob.read(0, blob.size)) == 20_000
    finally:
        for s in stores:
            s.close()


def test_swap_record_has_one_winner_per_version(repository_config: RepositoryConfig, tmp_path: Path) -> None:
    """A pause record's compare-and-swap (issue 29's fencing): of four nodes that read the
    same version, exactly one replaces it; then every node increments a counter in the
    record through read-swap-retry loops, and no increment is lost."""
    Store.open(settings(tmp_path / "init", repository_config), create=True).close()
    n = 4
    stores = [Store.open(settings(tmp_path / f"n{i}", repository_config)) for i in range(n)]
    try:
        stores[0].swap_record(CatalogRecord(name="held", kind="paused", meta=(("n", "0"),)),
                              stores[0].get_record_version("held"))
        with pytest.raises(Conflict):       # None: only if absent
            stores[1].swap_record(CatalogRecord(name="held", kind="paused"), RecordVersion("held", None))
        seen = [s.get_record_version("held") for s in stores]
        wins: list[int] = []
        barrier = threading.Barrier(n)

        def claim(i: int) -> None:
            barrier.wait()
            try:
                stores[i].swap_record(CatalogRecord(name="held", kind="paused", meta=(("holder", str(i)),)), seen[i])
                wins.append(i)
            except Conflict:
                pass
        threads = [threading.Thread(target=claim, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(wins) == 1
        assert stores[0].get_record("held").meta_dict() == {"holder": str(wins[0])}

        per, conflicts = 5, []

        def count(i: int) -> None:
            for _ in range(per):
                while True:
                    v = stores[i].get_record_version("held")
                    rec = v.record()
                    assert rec is not None
                    k = int(rec.meta_dict().get("count", "0"))
                    try:
                        stores[i].swap_record(CatalogRecord(name="held", kind="paused", meta=(("count", str(k + 1)),)), v)
                        break
                    except Conflict:
                        conflicts.append(i)
        threads = [threading.Thread(target=count, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert stores[0].get_record("held").meta_dict() == {"count": str(n * per)}
        print(f"{len(conflicts)} conflicts retried")
    finally:
        for s in stores:
            s.close()


def test_a_commit_replaces_only_the_version_it_read(repository_config: RepositoryConfig, tmp_path: Path) -> None:
    """A pause's commit (pause -> resume -> pause of one sandbox): the record exists, and
    the commit swaps over the version read; over a stale version it is refused."""
    with Store.open(settings(tmp_path / "a", repository_config), create=True) as store:
        commit_blob(store, b"first", "paused-x")
        v1 = store.get_record_version("paused-x")
        for data, version, ok in ((b"second", v1, True), (b"third", v1, False)):
            with store.workspace() as ws:
                w = ws.blob_writer(size=len(data))
                w.write(0, data)
                mid = w.close()
                rec = CatalogRecord(name="paused-x", kind="snapshot", manifests=(("disk", mid),))
                if ok:
                    ws.commit(rec, replaces=version)
                else:
                    with pytest.raises(Conflict):
                        ws.commit(rec, replaces=version)
        blob = store.open_blob(store.get_record("paused-x").manifests[0][1])
        assert blob.read(0, blob.size) == b"second"


class _FailAt(Backend):
    """Fails every write whose key starts with ``prefix`` (a crash at that point of a commit)."""

    def __init__(self, inner: Backend, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix
        self.name = inner.name

    def _check(self, key: str) -> None:
        if key.startswith(self.prefix):
            raise BackendError(f"injected crash writing {key}")

    def put(self, key: str, data: bytes) -> None:
        self._check(key)
        self.inner.put(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self._check(key)
        self.inner.put_file(key, path)

    def create(self, key: str, data: bytes) -> None:
        self._check(key)
        self.inner.create(key, data)

    def swap(self, key: str, data: bytes, expect: bytes | None) -> None:
        self._check(key)
        self.inner.swap(key, data, expect)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.get_range(key, offset, length)

    def open_stream(self, key: str):  # type: ignore[no-untyped-def]
        return self.inner.open_stream(key)

    def stat(self, key: str):  # type: ignore[no-untyped-def]
        return self.inner.stat(key)

    def list(self, prefix: str = ""):  # type: ignore[no-untyped-def]
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("crash_at", ["index/", "manifests/", "catalog/"])
def test_interrupted_commit_leaves_a_valid_repository(repository_config: RepositoryConfig, tmp_path: Path,
                                                      crash_at: str) -> None:
    st = settings(tmp_path / "a", repository_config)
    with Store.open(st, create=True) as a:
        keep = os.urandom(600_000)
        commit_blob(a, keep, "kept")
    backend = _FailAt(open_backend(repository_config, tmp_path / "a"), crash_at)
    repo = Repository.open(backend, describe_location(st))
    ws = Workspace(st.paths.workspace, repo, st.store, lambda c: repo.read_chunk(c), 4096)
    w = ws.blob_writer()
    w.append(os.urandom(1_500_000))
    mid = w.close()
    with pytest.raises(BackendError, match="injected crash"):
        ws.commit(CatalogRecord(name="lost", kind="snapshot", manifests=(("disk", mid),)))
    ws.abort()
    repo.close()
    backend.close()
    with Store.open(settings(tmp_path / "b", repository_config)) as b:
        assert [r.name for r in b.list_records()] == ["kept"]
        report = verify(b.repository, read_data=True)
        assert report.ok, report.errors  # at worst unreferenced packs: warnings, not errors
        blob = b.open_blob(b.get_record("kept").manifests[0][1])
        assert blob.read(0, blob.size) == keep
        g = gc(b.repository, grace=0)
        assert verify(b.repository, read_data=True).unreferenced_packs == 0
        if crash_at != "index/":
            assert g.packs_deleted >= 1  # the interrupted commit's packs are garbage


def test_verify_finds_a_corrupted_pack(repository_config: RepositoryConfig, tmp_path: Path) -> None:
    with Store.open(settings(tmp_path / "a", repository_config), create=True) as a:
        commit_blob(a, os.urandom(300_000), "snap")
        assert verify(a.repository, read_data=True).ok
        backend = a.backend
        (pack,) = list(backend.list("packs/"))
        raw = bytearray(backend.get(pack.key))
        raw[100] ^= 0xFF  # inside the first payload
        backend.put(pack.key, bytes(raw))
        report = verify(a.repository, read_data=True)
        assert not report.ok
        assert any("snap" in p.snapshots for p in report.errors)


def test_gc_keeps_live_and_removes_dead(repository_config: RepositoryConfig, tmp_path: Path) -> None:
    with Store.open(settings(tmp_path / "a", repository_config), create=True) as a:
        live = os.urandom(700_000)
        commit_blob(a, live, "live")
        commit_blob(a, os.urandom(1_200_000), "dead")
        packs_before = len(list(a.backend.list("packs/")))
        a.delete_record("dead")
        report = gc(a.repository, grace=0)
        assert report.packs_deleted + report.packs_repacked >= 1
        assert len(list(a.backend.list("packs/"))) < packs_before
        assert verify(a.repository, read_data=True).ok
    with Store.open(settings(tmp_path / "b", repository_config)) as b:
        blob = b.open_blob(b.get_record("live").manifests[0][1])
        assert blob.read(0, blob.size) == live


def test_missing_region_fails_store_open(tmp_path: Path) -> None:
    cfg = RepositoryConfig(backend="oss", bucket="b", endpoint_url="http://127.0.0.1:9")
    from aenv_store.errors import ConfigError

    with pytest.raises(ConfigError, match=r"repository\.region"):
        Store.open(settings(tmp_path, cfg))


def test_gc_concurrent_with_commits(repository_config: RepositoryConfig, tmp_path: Path) -> None:
    """Two committers keep committing (re-using chunks gc may just have swept) and
    deleting records while gc runs again and again with no grace period: no
    committed record loses data and verify stays clean (repository locks on the
    backend keep gc out while a writer is between staging and commit)."""
    import random
    import time

    from aenv_store.errors import LockError, StoreNotFound

    Store.open(settings(tmp_path / "init", repository_config), create=True).close()
    shared = [os.urandom(4096) for _ in range(64)]  # chunks that keep coming back
    live: dict[str, bytes] = {}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def committer(who: int) -> None:
        rng = random.Random(who)
        try:
            with Store.open(settings(tmp_path / f"c{who}", repository_config)) as s:
                i = 0
                while not stop.is_set():
                    name = f"c{who}-{i}"
                    data = b"".join(rng.sample(shared, 16)) + os.urandom(rng.randrange(1, 40_000))
                    try:
                        commit_blob(s, data, name)
                    except LockError:  # gc held the exclusive lock past the writer's wait: try again
                        continue
                    with lock:
                        live[name] = data
                    if i >= 2 and rng.random() < 0.5:
                        victim = f"c{who}-{i - 2}"
                        with lock:
                            live.pop(victim, None)
                        s.delete_record(victim)
                    i += 1
                    stop.wait(0.05)  # writers hold shared locks; leave gc a window now and then
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=committer, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    runs = busy = 0
    deadline = time.monotonic() + 60
    with Store.open(settings(tmp_path / "gc", repository_config)) as g:
        while runs < 2 and time.monotonic() < deadline and not errors:
            try:
                gc(g.repository, grace=0, lock_wait=5.0)
                runs += 1
            except LockError:
                busy += 1
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert runs >= 1, f"gc never got the lock ({busy} busy)"
        gc(g.repository, grace=0, lock_wait=10.0)
    with Store.open(settings(tmp_path / "check", repository_config)) as c:
        report = verify(c.repository, read_data=True)
        assert report.ok, report.errors
        assert live, "nothing was committed"
        for name, data in live.items():
            try:
                rec = c.get_record(name)
            except StoreNotFound:
                raise AssertionError(f"committed record lost: {name}") from None
            blob = c.open_blob(rec.manifests[0][1])
            assert blob.read(0, blob.size) == data, name
