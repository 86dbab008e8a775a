"""Repository/Store behaviour: abort leaves nothing, exclusive catalog records,
clear errors on open, corruption detection on read, index rebuild, stale
workspace cleanup after a killed writer."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aenv_store.errors import AlreadyExists, CorruptData, StoreNotFound, RepositoryError
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.repository.repository import pack_key
from aenv_store.store import Store

from .conftest import make_settings

REPO_ROOT = Path(__file__).resolve().parents[3]


def objects(repo: Path) -> set[str]:
    """Every repository object except config and locks."""
    out = set()
    for p in repo.rglob("*"):
        rel = p.relative_to(repo).as_posix()
        if p.is_file() and rel != "config" and not rel.startswith("locks/"):
            out.add(rel)
    return out


def write_blob(store: Store, data: bytes, name: str | None = None) -> Digest:
    with store.workspace() as ws:
        w = ws.blob_writer()
        w.append(data)
        mid = w.close()
        ws.commit(CatalogRecord(name, "layer", (("d", mid),)) if name else None)
    return mid


def test_abort_and_exception_leave_nothing(settings_factory, tmp_path: Path) -> None:
    with Store.open(settings_factory(), create=True) as store:
        ws = store.workspace()
        w = ws.blob_writer()
        w.append(os.urandom(200_000))
        w.close()
        ws.abort()
        with pytest.raises(RuntimeError):
            with store.workspace() as ws2:
                ws2.blob_writer().append(os.urandom(200_000))
                raise RuntimeError("builder failed")
        assert ws2.state == "aborted"
        assert objects(tmp_path / "repo") == set()
        assert list((tmp_path / "node" / "workspace").iterdir()) == []


def test_exclusive_record_conflict_and_replace(settings_factory) -> None:
    with Store.open(settings_factory(), create=True) as store:
        a = write_blob(store, b"a" * 5000, "snap")
        with store.workspace() as ws:
            w = ws.blob_writer()
            w.append(b"b" * 5000)
            b = w.close()
            with pytest.raises(AlreadyExists):
                ws.commit(CatalogRecord("snap", "layer", (("d", b),)))
            ws.commit(CatalogRecord("snap", "layer", (("d", b),)), exclusive=False)
        assert store.get_record("snap").manifest("d") == b != a
        store.put_record(CatalogRecord("latest", "alias", target="snap"))
        assert store.resolve("latest").manifest("d") == b
        assert [r.name for r in store.list_records("alias")] == ["latest"]
        store.delete_record("latest")
        with pytest.raises(StoreNotFound):
            store.get_record("latest")


def test_concurrent_exclusive_creates_one_winner(settings_factory, tmp_path: Path) -> None:
    with Store.open(settings_factory(), create=True) as store:
        mid = write_blob(store, b"z" * 100)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from pathlib import Path
        from tests.aenv_store.store.conftest import make_settings
        from aenv_store.store import Store
        from aenv_store.formats.catalog import CatalogRecord
        from aenv_store.formats.ids import Digest
        from aenv_store.errors import AlreadyExists
        with Store.open(make_settings(Path(sys.argv[1]), Path(sys.argv[2]))) as s:
            try:
                s.put_record(CatalogRecord("race", "layer", (("d", Digest.from_hex({mid.hex()!r})),),
                                           meta=(("who", sys.argv[1]),)))
                print("won")
            except AlreadyExists:
                print("lost")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"n{i}"), str(tmp_path / "repo")],
                              stdout=subprocess.PIPE, text=True) for i in range(4)]
    results = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(results) == ["lost", "lost", "lost", "won"]


def test_open_errors(tmp_path: Path) -> None:
    s = make_settings(tmp_path / "d")
    with pytest.raises(RepositoryError, match="no repository at .*aenv repo init"):
        Store.open(s)
    Store.open(s, create=True).close()
    config = tmp_path / "d" / "repo" / "config"
    good = config.read_bytes()
    obj = json.loads(good)
    config.write_text(json.dumps({**obj, "version": 99}))
    with pytest.raises(RepositoryError, match="version 99"):
        Store.open(s)
    config.write_bytes(b"\x00garbage")
    with pytest.raises(RepositoryError, match="corrupt repository config"):
        Store.open(s)
    config.write_bytes(good)
    Store.open(s).close()
    with pytest.raises(RepositoryError, match="already exists"):
        Store.init(s)


def test_corrupt_chunk_is_reported_with_chunk_and_pack(settings_factory, tmp_path: Path) -> None:
    data = os.urandom(4096) * 3  # incompressible chunk stored raw
    with Store.open(settings_factory(), create=True) as store:
        mid = write_blob(store, data)
        m = store.load_manifest(mid)
    [pack_file] = [p for p in (tmp_path / "repo" / "packs").rglob("*") if p.is_file()]
    raw = bytearray(pack_file.read_bytes())
    raw[100] ^= 0xFF  # inside the first (only) payload
    pack_file.write_bytes(bytes(raw))
    with Store.open(settings_factory("cold")) as cold:
        entry = cold.repository.lookup(m.extents[0].chunk)
        assert entry is not None
        with pytest.raises(CorruptData) as e:
            cold.open_blob(mid).read(0, 4096)
        assert m.extents[0].chunk.hex() in str(e.value) and entry.pack.hex() in str(e.value)
        assert cold.cache is None or not cold.cache.contains(m.extents[0].chunk)  # never cached


def test_rebuild_index_from_pack_trailers(settings_factory, tmp_path: Path) -> None:
    data = os.urandom(300_000)  # several 64 KiB packs
    with Store.open(settings_factory(), create=True) as store:
        mid = write_blob(store, data, "x")
        write_blob(store, os.urandom(50_000), "y")
    index_dir = tmp_path / "repo" / "index"
    for f in index_dir.iterdir():
        f.unlink()
    with Store.open(settings_factory("cold")) as cold:
        with pytest.raises(StoreNotFound):
            cold.open_blob(mid).read(0, 10)
        iid, n = cold.repository.rebuild_index()
        assert iid is not None and n == 300_000 // 4096 + 1 + 50_000 // 4096 + 1
        assert cold.open_blob(mid).read(0, len(data)) == data
    assert [f.name for f in index_dir.iterdir()] == [iid.hex()]


def test_truncated_index_file_is_skipped_and_reported(settings_factory, tmp_path: Path) -> None:
    with Store.open(settings_factory(), create=True) as store:
        write_blob(store, os.urandom(10_000), "x")
    [f] = list((tmp_path / "repo" / "index").iterdir())
    f.write_bytes(f.read_bytes()[:-10])
    with Store.open(settings_factory("cold")) as cold:
        assert list(cold.repository.bad_index_files) == [f"index/{f.name}"]
        assert len(cold.repository.index) == 0


def test_killed_writer_leaves_nothing_visible_and_is_cleaned(tmp_path: Path) -> None:
    data_dir, repo = tmp_path / "killed", tmp_path / "repo"
    Store.open(make_settings(tmp_path / "init", repo), create=True).close()
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from pathlib import Path
        from tests.aenv_store.store.conftest import make_settings
        from aenv_store.store import Store
        s = Store.open(make_settings(Path(sys.argv[1]), Path(sys.argv[2])))
        ws = s.workspace()
        w = ws.blob_writer()
        w.append(os.urandom(500_000))
        w.write(3, b"partial")
        print("staged", flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", script, str(data_dir), str(repo)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "staged"
        [ws_dir] = list((data_dir / "workspace").iterdir())
        assert any(ws_dir.iterdir())  # packs / scratch on local disk
        # while the owner lives, another open must not touch its workspace
        Store.open(make_settings(data_dir / "other", repo)).close()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    assert ws_dir.exists()
    assert objects(repo) == set()
    # the next open on that data dir removes the dead workspace (its flock is gone)
    # and gets past the dead writer's repository lock
    Store.open(make_settings(data_dir, repo)).close()
    assert not ws_dir.exists()


def test_pack_key_layout(settings_factory, tmp_path: Path) -> None:
    with Store.open(settings_factory(), create=True) as store:
        mid = write_blob(store, os.urandom(5000), "k")
        pid = store.repository.lookup(store.load_manifest(mid).extents[0].chunk).pack
    repo = tmp_path / "repo"
    assert (repo / pack_key(pid)).is_file()
    assert (repo / "manifests" / mid.hex()[:2] / mid.hex()).is_file()
    assert (repo / "catalog" / "k").is_file()
    assert Digest.of((repo / pack_key(pid)).read_bytes()) == pid


def test_commit_writes_in_order_packs_index_manifests_record(tmp_path: Path) -> None:
    from aenv_store.repository.backends.posix_fs import PosixFsBackend
    from aenv_store.repository.repository import Repository

    class Recording(PosixFsBackend):
        """The real posix_fs backend, noting the order of durable writes."""

        def __init__(self, root: Path) -> None:
            super().__init__(root)
            self.writes: list[str] = []

        def put(self, key: str, data: bytes) -> None:
            super().put(key, data)
            self.writes.append(key)

        def move_file(self, key: str, path: Path) -> None:
            super().move_file(key, path)
            self.writes.append(key)

        def create(self, key: str, data: bytes) -> None:
            super().create(key, data)
            self.writes.append(key)

    settings = make_settings(tmp_path / "node", tmp_path / "repo", pack_target=64 << 10)
    Store.open(settings, create=True).close()
    backend = Recording(tmp_path / "repo")
    store = Store(settings, backend, Repository.open(backend, "test"), cache=None)
    try:
        with store.workspace() as ws:
            w = ws.blob_writer()
            w.append(os.urandom(200_000))  # > 1 pack
            mid = w.close()
            backend.writes.clear()  # ignore lock objects written when the workspace opened
            ws.commit(CatalogRecord("ordered", "layer", (("d", mid),)))
        kinds = [k.split("/")[0] for k in backend.writes if not k.startswith("locks/")]
        assert kinds == sorted(kinds, key=["packs", "index", "manifests", "catalog"].index)
        assert kinds.count("packs") >= 3 and kinds.count("index") == 1
        assert kinds[-2:] == ["manifests", "catalog"]
    finally:
        store.close()


def test_coalesce_groups_nearby_entries_per_pack() -> None:
    from aenv_store.formats.index import IndexEntry
    from aenv_store.repository.repository import coalesce

    p1, p2 = Digest(b"\1" * 32), Digest(b"\2" * 32)

    def e(pack: Digest, off: int, ln: int = 100) -> IndexEntry:
        return IndexEntry(Digest.of(f"{pack.hex()}{off}".encode()), pack, off, ln, ln)

    entries = [e(p1, 16), e(p2, 16), e(p1, 116), e(p1, 300), e(p1, 10_000_000), e(p1, 200_000)]
    runs = coalesce(entries, max_gap=1000, max_span=1 << 20)
    shape = sorted((r[0].pack == p1, [x.offset for x in r]) for r in runs)
    assert shape == [(False, [16]), (True, [16, 116, 300]), (True, [200_000]), (True, [10_000_000])]


def test_batched_reads_match_single_reads_and_detect_corruption(settings_factory, tmp_path: Path) -> None:
    data = os.urandom(4096) * 2 + os.urandom(20 * 4096)
    with Store.open(settings_factory(), create=True) as store:
        mid = write_blob(store, data)
    with Store.open(settings_factory("cold")) as cold:
        m = cold.load_manifest(mid)
        cids = [x.chunk for x in m.extents if x.chunk is not None]
        assert cold.read_chunks(cids + cids[:3], cache=False) == [cold.fetch_chunk(c) for c in cids + cids[:3]]
    for pack_file in (tmp_path / "repo" / "packs").rglob("*"):
        if pack_file.is_file() and pack_file.stat().st_size > 16 + 4 * 4096:
            raw = bytearray(pack_file.read_bytes())
            raw[16 + 3 * 4096 + 7] ^= 0x40  # inside a later payload (random data is stored raw)
            pack_file.write_bytes(bytes(raw))
    with Store.open(settings_factory("cold2")) as cold:
        with pytest.raises(CorruptData, match="does not match its id"):
            cold.open_blob(mid).read(0, len(data))


def test_reader_survives_a_repack_behind_its_back(settings_factory, tmp_path: Path) -> None:
    """A long-lived Store loaded the index; then, as gc's repack does, the chunks
    are rewritten into a new pack (+ index) and the old pack and index deleted."""

    from aenv_store.formats import pack as packfmt
    from aenv_store.formats.index import IndexEntry, encode_index
    from aenv_store.repository.repository import index_key

    data = os.urandom(30_000)
    with Store.open(settings_factory(), create=True) as store:
        mid = write_blob(store, data, "r")
    repo_dir = tmp_path / "repo"
    with Store.open(settings_factory("reader")) as reader:
        assert len(reader.repository.index) == 8
        [old_pack] = [p for p in (repo_dir / "packs").rglob("*") if p.is_file()]
        [old_index] = list((repo_dir / "index").iterdir())
        # the repack: same chunks, reverse order, so a new pack id
        old_entries = packfmt.parse_pack(old_pack.read_bytes())
        writer = packfmt.PackWriter(tmp_path / "repacked")
        blob = old_pack.read_bytes()
        for e in reversed(old_entries):
            writer.add(e.chunk, blob[e.offset:e.offset + e.length], e.raw_length)
        new_id = writer.finish()
        reader.backend.put_file(pack_key(new_id), tmp_path / "repacked")
        idx = encode_index([IndexEntry(e.chunk, new_id, e.offset, e.length, e.raw_length)
                            for e in writer.entries])
        reader.backend.put(index_key(Digest.of(idx)), idx)
        old_pack.unlink()
        old_index.unlink()
        # batched read (runs) and single-chunk read both re-resolve to the new pack
        assert reader.open_blob(mid, cache=False).read(0, len(data)) == data
        assert reader.read_chunk(reader.load_manifest(mid).extents[3].chunk) == data[3 * 4096:4 * 4096]
        assert all(e.pack == new_id for e in reader.repository.index.entries())


def test_workspace_never_dedups_against_packs_gc_deleted(settings_factory, tmp_path: Path) -> None:
    """A Store kept open across a gc: its next workspace must reload the index,
    or it would reference chunks whose pack is gone (admin.md: requirement on writers)."""
    data = os.urandom(20_000)
    with Store.open(settings_factory(), create=True) as store:
        write_blob(store, data)  # no record: garbage for gc
        repo_dir = tmp_path / "repo"
        # what gc does for an unreferenced commit: delete its pack, index and manifest
        for sub in ("packs", "index", "manifests"):
            for f in (repo_dir / sub).rglob("*"):
                if f.is_file():
                    f.unlink()
        assert store.repository.has_chunk(Digest.of(data[:4096]))  # stale in memory
        with store.workspace() as ws:
            w = ws.blob_writer()
            w.append(data)
            mid = w.close()
            res = ws.commit(CatalogRecord("again", "layer", (("d", mid),)))
        assert res.chunks_added == 5 and res.chunks_deduped == 0
    with Store.open(settings_factory("cold")) as cold:
        assert cold.open_blob(mid).read(0, len(data)) == data
