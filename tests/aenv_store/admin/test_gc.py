"""`aenv repo gc`: what it frees, what it must keep (live data, anything inside the
grace period), dry runs, repacking, refusing under locks or on a damaged
repository, and a crash at every single mutating step of its sweep."""
from __future__ import annotations

import argparse
import os
import random
import shutil
import threading
import time
from pathlib import Path

import pytest

from aenv_store.admin.gc import GcError, gc
from aenv_store.admin.verify import verify
from aenv_store.errors import LockError
from aenv_store.formats import pack as packfmt
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.repository.backends.base import Backend, ObjectInfo
from aenv_store.repository.locks import lock_shared
from aenv_store.repository.repository import INDEX, Repository, pack_key


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and "locks" not in p.parts}


def _age_everything(root: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in root.rglob("*"):
        if p.is_file():
            os.utime(p, (t, t))


@pytest.fixture
def churned(repo):  # type: ignore[no-untyped-def]
    """12 snapshots committed, 8 of them deleted again: lots of garbage, some shared chunks live."""
    with repo.store() as store:
        names = [repo.commit(store, seed) for seed in range(200, 212)]
        rng = random.Random(3)
        repo.deleted = rng.sample(names, 8)
        for n in repo.deleted:
            store.delete_record(n)
    repo.live = sorted(set(names) - set(repo.deleted))
    return repo


def test_gc_frees_garbage_and_keeps_live_data(churned, aenv) -> None:  # type: ignore[no-untyped-def]
    before = sum(len(v) for k, v in _files(churned.path).items() if k.startswith("packs"))
    r = aenv(churned.data_dir, "repo", "gc", "--grace", "0")
    assert r.rc == 0, r.err
    assert "freed" in r.out
    after = sum(len(v) for k, v in _files(churned.path).items() if k.startswith("packs"))
    assert after < before
    with churned.store() as store:
        report = verify(store.repository, read_data=True)
    assert report.ok, report.problems
    assert report.unreferenced_packs == 0 and report.unreachable_manifests == 0
    assert sorted(churned.read_back()) == churned.live
    # a second gc finds nothing more to do
    with churned.store() as store:
        again = gc(store.repository, grace=0)
    assert again.freed_bytes == 0 and again.packs_deleted == again.packs_repacked == again.manifests_deleted == 0


def test_grace_period_protects_young_objects(churned) -> None:  # type: ignore[no-untyped-def]
    snapshot = _files(churned.path)
    with churned.store() as store:
        report = gc(store.repository)  # default grace: 1h; everything was just written
    assert report.freed_bytes == 0 and report.kept_young_packs > 0 and report.kept_young_manifests == 8
    assert _files(churned.path) == snapshot
    _age_everything(churned.path, 2 * 3600)
    with churned.store() as store:
        report = gc(store.repository)
    assert report.packs_deleted > 0 and report.manifests_deleted == 8
    assert sorted(churned.read_back()) == churned.live


def test_dry_run_changes_nothing_and_predicts_the_real_run(churned, aenv) -> None:  # type: ignore[no-untyped-def]
    snapshot = _files(churned.path)
    r = aenv(churned.data_dir, "repo", "gc", "--grace", "0", "--dry-run", "--output", "json")
    assert r.rc == 0
    import json

    dry = json.loads(r.out)
    assert dry["dry_run"] and dry["packs_deleted"] > 0
    assert _files(churned.path) == snapshot
    with churned.store() as store:
        real = gc(store.repository, grace=0).to_json()
    for k in ("packs_deleted", "packs_deleted_bytes", "packs_repacked", "manifests_deleted", "live_chunks"):
        assert dry[k] == real[k], k


def test_repacks_mostly_garbage_pack(repo) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(5)
    big = rng.randbytes(40 * 4096)
    small = rng.randbytes(3 * 4096)
    with repo.store() as store:
        with store.workspace() as ws:
            w = ws.blob_writer(size=len(big))
            w.append(big)
            mid_big = w.close()
            w = ws.blob_writer(size=len(small))
            w.append(small)
            mid_small = w.close()
            ws.commit(CatalogRecord(name="both", kind="snapshot", manifests=(("a", mid_big), ("b", mid_small))))
        store.put_record(CatalogRecord(name="small-only", kind="snapshot", manifests=(("b", mid_small),)))
        store.delete_record("both")
        packs_before = list(store.repository.list_packs())
        assert len(packs_before) == 1
        report = gc(store.repository, grace=0)
        assert report.packs_repacked == 1 and report.packs_written == 1 and report.chunks_copied == 3
        assert report.packs_deleted == 0 and report.freed_bytes > 30 * 4096 * 0.5
        (new,) = list(store.repository.list_packs())
        assert new.key != packs_before[0].key
        data = (repo.path / new.key).read_bytes()
        held = {bytes(e.chunk) for e in packfmt.read_trailer(lambda o, n: data[o:o + n], len(data))}
        assert held == {bytes(c) for c in store.load_manifest(mid_small).chunks}
    with repo.store() as store:
        assert verify(store.repository, read_data=True).ok
        blob = store.open_blob(store.get_record("small-only").manifest("b"))
        assert blob.read(0, blob.size) == small


def test_gc_waits_for_or_refuses_shared_lock(churned, aenv) -> None:  # type: ignore[no-untyped-def]
    snapshot = _files(churned.path)
    with churned.store() as store:
        holder = lock_shared(store.backend, purpose="a committing workspace")
        try:
            with pytest.raises(LockError, match="a committing workspace"):
                gc(store.repository, grace=0)
            r = aenv(churned.data_dir, "repo", "gc", "--grace", "0")
            assert r.rc == 1 and "aenv: error:" in r.err and "a committing workspace" in r.err
            assert _files(churned.path) == snapshot
            threading.Timer(0.3, holder.release).start()
            r = aenv(churned.data_dir, "repo", "gc", "--grace", "0", "--wait", "10s")
            assert r.rc == 0, r.err
        finally:
            holder.release()
    assert sorted(churned.read_back()) == churned.live


def test_gc_refuses_a_damaged_repository(churned, aenv) -> None:  # type: ignore[no-untyped-def]
    from aenv_store.formats.index import decode_index

    with churned.store() as store:
        live = {bytes(c) for n in churned.live for _, m in store.get_record(n).manifests
                for c in store.load_manifest(m).chunks}
    held = {p: {bytes(e.chunk) for e in decode_index(p.read_bytes()).entries()}
            for p in sorted((churned.path / INDEX).iterdir())}
    # an index file that alone knows some live chunk: without it, liveness of its pack is unknowable
    victim = next(p for p, cs in held.items() if (cs & live) - set().union(*(o for q, o in held.items() if q != p)))
    victim.unlink()
    snapshot = _files(churned.path)
    with churned.store() as store:
        with pytest.raises(GcError, match="rebuild-index"):
            gc(store.repository, grace=0)
    r = aenv(churned.data_dir, "repo", "gc", "--grace", "0")
    assert r.rc == 1 and "rebuild-index" in r.err
    assert _files(churned.path) == snapshot  # nothing deleted


def test_unindexed_pack_of_a_crashed_commit(repo) -> None:  # type: ignore[no-untyped-def]
    from aenv_store.formats.ids import Digest

    with repo.store() as store:
        repo.commit(store, 1)
        tmp = repo.tmp / "orphan"
        w = packfmt.PackWriter(tmp)
        payload = os.urandom(5000)
        w.add(Digest.of(payload), payload, len(payload))
        pid = w.finish()
        store.backend.put_file(pack_key(pid), tmp)
        assert gc(store.repository).packs_deleted == 0  # young: kept
        assert store.backend.exists(pack_key(pid))
        assert gc(store.repository, grace=0).packs_deleted == 1
        assert not store.backend.exists(pack_key(pid))
    assert len(repo.read_back()) == 1


class SimulatedCrash(BaseException):
    pass


class CrashingBackend(Backend):
    """Forwards to a real backend; the ``crash_after``-th mutating call (lock
    objects aside) and every later one raise SimulatedCrash, as if the process died."""

    def __init__(self, inner: Backend, crash_after: int | None) -> None:
        self.inner = inner
        self.crash_after = crash_after
        self.mutations = 0

    def _mutate(self, key: str) -> None:
        if key.startswith("locks/"):
            return
        if self.crash_after is not None and self.mutations >= self.crash_after:
            raise SimulatedCrash(key)
        self.mutations += 1

    def put(self, key: str, data: bytes) -> None:
        self._mutate(key)
        self.inner.put(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self._mutate(key)
        self.inner.put_file(key, path)

    def create(self, key: str, data: bytes) -> None:
        self._mutate(key)
        self.inner.create(key, data)

    def swap(self, key: str, data: bytes, expect: bytes | None) -> None:
        self._mutate(key)
        self.inner.swap(key, data, expect)

    def delete(self, key: str) -> None:
        self._mutate(key)
        self.inner.delete(key)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.get_range(key, offset, length)

    def open_stream(self, key: str):  # type: ignore[no-untyped-def]
        return self.inner.open_stream(key)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def list(self, prefix: str = ""):  # type: ignore[no-untyped-def]
        return self.inner.list(prefix)


def test_gc_crash_at_every_step_leaves_a_valid_repository(churned, tmp_path: Path, wl) -> None:  # type: ignore[no-untyped-def]
    from aenv_store.repository.backends.posix_fs import PosixFsBackend

    # Make one pack mostly garbage so the sweep also repacks.
    with churned.store() as store:
        name = churned.commit(store, 999, parts=2, max_chunks=60)
        rec = store.get_record(name)
        store.put_record(CatalogRecord(name="keep-999", kind="snapshot", manifests=(rec.manifests[1],)))
        store.delete_record(name)
    live = sorted(churned.live + ["keep-999"])
    pristine = tmp_path / "pristine"
    shutil.copytree(churned.path, pristine)

    counter = CrashingBackend(PosixFsBackend(churned.path), None)
    full = gc(Repository.open(counter, "test"), grace=0)
    assert full.packs_repacked >= 1 and full.packs_deleted >= 1
    steps = counter.mutations
    assert steps >= 5
    for k in range(steps):
        shutil.rmtree(churned.path)
        shutil.copytree(pristine, churned.path)
        with pytest.raises(SimulatedCrash):
            gc(Repository.open(CrashingBackend(PosixFsBackend(churned.path), k), "test"), grace=0)
        repo = Repository.open(PosixFsBackend(churned.path), "test")
        report = verify(repo, read_data=True)
        assert report.ok, (k, report.problems)
        assert sorted(r.name for r in repo.list_records()) == live
        _read_live(churned, live, wl)
        # the next gc completes the job
        gc(repo, grace=0)
        final = verify(repo, read_data=True)
        assert final.ok and final.unreferenced_packs == 0 and final.unreachable_manifests == 0, k
    _read_live(churned, live, wl)


def _read_live(churned, live: list[str], wl) -> None:  # type: ignore[no-untyped-def]
    plain = [n for n in live if n != "keep-999"]
    assert sorted(churned.read_back(plain)) == plain
    # "keep-999" holds part 1 of artifact 999 (content seed 1000, 60 chunks at most)
    with churned.store() as store:
        blob = store.open_blob(store.get_record("keep-999").manifests[0][1])
        assert blob.read(0, blob.size) == wl.content(1000, max_chunks=60)


@pytest.mark.parametrize("text,seconds", [("0", 0), ("90", 90), ("90s", 90), ("30m", 1800), ("1h", 3600),
                                          ("2d", 172800), ("1h30m", 5400), ("0.5h", 1800)])
def test_parse_duration(text: str, seconds: float) -> None:
    from aenv_cli.repo_admin import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1x", "-1h", "1h 2m", "10 30"])
def test_parse_duration_rejects(text: str) -> None:
    from aenv_cli.repo_admin import parse_duration

    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_young_manifest_protects_old_chunks_it_uses(repo, wl) -> None:  # type: ignore[no-untyped-def]
    """A lock-less writer that wrote its manifest (deduped against old packs) but not yet
    its record: inside the grace period gc keeps everything that manifest reaches."""
    with repo.store() as store:
        name = repo.commit(store, 77)
        mid = store.get_record(name).manifests[0][1]
        _age_everything(repo.path, 2 * 3600)
        # the "in-flight" manifest: same content under another media type, all chunks deduped
        m = store.load_manifest(mid)
        from dataclasses import replace

        inflight = replace(m, media_type="application/vnd.aenv.test-inflight")
        with store.workspace() as ws:
            ws.add_manifest(inflight)
            assert ws.commit().packs_added == 0
        store.delete_record(name)
        report = gc(store.repository)  # default grace: 1h
        assert report.packs_deleted == 0 and report.kept_young_manifests == 1
        assert report.manifests_deleted == 1  # the old, unreachable original
        store.put_record(CatalogRecord(name="late", kind="snapshot", manifests=(("data", inflight.id),)))
    with repo.store() as store:
        assert verify(store.repository, read_data=True).ok
        blob = store.open_blob(store.get_record("late").manifests[0][1])
        assert blob.read(0, blob.size) == wl.content(77)
