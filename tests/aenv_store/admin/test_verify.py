"""`aenv repo verify` on real repositories with injected damage (acceptance 4):
each kind of damage is reported, names exactly the affected snapshots, and
makes the command exit non-zero; --rebuild-index recovers a lost index."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_store.admin.verify import Subset, verify
from aenv_store.formats import pack as packfmt
from aenv_store.repository.repository import INDEX, PACKS, id_from_key


def _keys(root: Path, prefix: str) -> list[Path]:
    return sorted(p for p in (root / prefix).rglob("*") if p.is_file() and not p.name.startswith("."))


def _users(repo, chunks: set[bytes]) -> set[str]:  # type: ignore[no-untyped-def]
    """Names of the records whose manifests (or their parents) use any of ``chunks``."""
    out = set()
    with repo.store() as store:
        for rec in store.list_records():
            for _, mid in rec.manifests:
                m = store.load_manifest(mid)
                while True:
                    if {bytes(c) for c in m.chunks} & chunks:
                        out.add(rec.name)
                    if m.parent is None:
                        break
                    m = store.load_manifest(m.parent)
    return out


def _trailer(path: Path) -> list[packfmt.PackEntry]:
    data = path.read_bytes()
    return packfmt.read_trailer(lambda o, n: data[o:o + n], len(data))


@pytest.fixture
def filled(repo):  # type: ignore[no-untyped-def]
    """A repository with 12 snapshots that share chunks (so damage hits several)."""
    with repo.store() as store:
        repo.names = [repo.commit(store, seed) for seed in range(100, 112)]
    return repo


def test_clean_repository_passes(filled, aenv) -> None:  # type: ignore[no-untyped-def]
    for args in ([], ["--read-data"], ["--read-data-subset", "50%"]):
        r = aenv(filled.data_dir, "repo", "verify", *args)
        assert r.rc == 0, r.out + r.err
        assert "no errors found" in r.out
    r = aenv(filled.data_dir, "repo", "verify", "--read-data", "--output", "json")
    report = json.loads(r.out)
    assert report["ok"] and report["records"] == 12 and report["packs_read"] == report["packs"] > 0
    assert report["chunks_read"] >= report["chunks_referenced"] > 0


def test_flipped_byte_in_pack_payload(filled, aenv) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    referenced = _referenced_chunks(filled)
    pack_path, entry = rng.choice([(p, e) for p in _keys(filled.path, PACKS) for e in _trailer(p)
                                   if bytes(e.chunk) in referenced])
    _flip(pack_path, entry.offset + rng.randrange(entry.length))
    expected = _users(filled, {bytes(entry.chunk)})
    assert expected
    # Structure-only verify does not read payloads...
    assert aenv(filled.data_dir, "repo", "verify").rc == 0
    # ...--read-data does, and names exactly the snapshots that use the chunk.
    r = aenv(filled.data_dir, "repo", "verify", "--read-data", "--output", "json")
    assert r.rc == 1
    report = json.loads(r.out)
    kinds = {p["kind"] for p in report["problems"]}
    assert "corrupt-chunk" in kinds
    assert set(report["affected_snapshots"]) == expected
    text = aenv(filled.data_dir, "repo", "verify", "--read-data")
    assert text.rc == 1 and entry.chunk.hex() in text.out and sorted(expected)[0] in text.out


def _referenced_chunks(repo) -> set[bytes]:  # type: ignore[no-untyped-def]
    out: set[bytes] = set()
    with repo.store() as store:
        for rec in store.list_records():
            for _, mid in rec.manifests:
                out |= {bytes(c) for c in store.load_manifest(mid).chunks}
    return out


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_deleted_pack(filled, aenv) -> None:  # type: ignore[no-untyped-def]
    victim = _keys(filled.path, PACKS)[3]
    chunks = {bytes(e.chunk) for e in _trailer(victim)}
    expected = _users(filled, chunks)
    victim.unlink()
    r = aenv(filled.data_dir, "repo", "verify", "--output", "json")
    assert r.rc == 1
    report = json.loads(r.out)
    missing = [p for p in report["problems"] if p["kind"] == "missing-pack"]
    assert len(missing) == 1 and victim.name in missing[0]["object"]
    assert set(missing[0]["snapshots"]) == expected == set(report["affected_snapshots"])
    text = aenv(filled.data_dir, "repo", "verify")
    assert "missing-pack" in text.out and "affects:" in text.out


def test_truncated_index_file_then_rebuild(filled, aenv) -> None:  # type: ignore[no-untyped-def]
    index_files = _keys(filled.path, INDEX)
    victim = index_files[5]
    data = victim.read_bytes()
    from aenv_store.formats.index import decode_index

    lost = {bytes(e.chunk) for e in decode_index(data).entries()}
    # chunks that only this index file knows
    others = set()
    for p in index_files:
        if p != victim:
            others |= {bytes(e.chunk) for e in decode_index(p.read_bytes()).entries()}
    expected = _users(filled, lost - others)
    assert expected
    victim.write_bytes(data[: len(data) // 2])
    r = aenv(filled.data_dir, "repo", "verify", "--output", "json")
    assert r.rc == 1
    report = json.loads(r.out)
    corrupt = [p for p in report["problems"] if p["kind"] == "corrupt-index"]
    assert len(corrupt) == 1 and victim.name in corrupt[0]["object"]
    assert set(corrupt[0]["snapshots"]) == expected == set(report["affected_snapshots"])
    assert any(p["kind"] == "unindexed-chunk" and "--rebuild-index" in p["message"] for p in report["problems"])

    r = aenv(filled.data_dir, "repo", "verify", "--rebuild-index", "--read-data")
    assert r.rc == 0, r.out + r.err
    assert "rebuilt the index" in r.out
    assert len(_keys(filled.path, INDEX)) == 1
    filled.read_back()


def test_deleted_index_recovered_by_rebuild(filled, aenv) -> None:  # type: ignore[no-untyped-def]
    for p in _keys(filled.path, INDEX):
        p.unlink()
    r = aenv(filled.data_dir, "repo", "verify", "--output", "json")
    assert r.rc == 1
    report = json.loads(r.out)
    assert set(report["affected_snapshots"]) == set(filled.names)
    assert aenv(filled.data_dir, "repo", "verify", "--rebuild-index").rc == 0
    assert aenv(filled.data_dir, "repo", "verify", "--read-data").rc == 0
    assert sorted(filled.read_back()) == sorted(filled.names)


def test_damaged_and_missing_manifest(filled, aenv) -> None:  # type: ignore[no-untyped-def]
    with filled.store() as store:
        a, b = (store.get_record(n) for n in filled.names[:2])
    man_a = filled.path / "manifests" / a.manifests[0][1].hex()[:2] / a.manifests[0][1].hex()
    man_b = filled.path / "manifests" / b.manifests[0][1].hex()[:2] / b.manifests[0][1].hex()
    _flip(man_a, 20)
    man_b.unlink()
    r = aenv(filled.data_dir, "repo", "verify", "--output", "json")
    assert r.rc == 1
    problems = {p["kind"]: p for p in json.loads(r.out)["problems"]}
    assert problems["corrupt-manifest"]["snapshots"] == [a.name]
    assert problems["missing-manifest"]["snapshots"] == [b.name]


def test_pack_trailer_damage_found_without_read_data(filled, aenv) -> None:  # type: ignore[no-untyped-def]
    victim = _keys(filled.path, PACKS)[0]
    chunks = {bytes(e.chunk) for e in _trailer(victim)}
    size = victim.stat().st_size
    _flip(victim, size - packfmt.FOOTER_SIZE - 10)  # inside the chunk table
    r = aenv(filled.data_dir, "repo", "verify", "--output", "json")
    assert r.rc == 1
    report = json.loads(r.out)
    assert any(p["kind"] == "corrupt-pack" and "trailer" in p["message"] for p in report["problems"])
    assert set(report["affected_snapshots"]) == _users(filled, chunks)


def test_read_data_subsets(filled) -> None:  # type: ignore[no-untyped-def]
    with filled.store() as store:
        packs = len(_keys(filled.path, PACKS))
        half = verify(store.repository, read_data=True, subset=Subset.parse("50%"), seed=1)
        assert half.ok and half.packs_read == -(-packs // 2)
        groups = [verify(store.repository, read_data=True, subset=Subset.parse(f"{n}/3")) for n in (1, 2, 3)]
        assert sum(g.packs_read for g in groups) == packs
        assert verify(store.repository, read_data=True, subset=Subset.parse("1%")).packs_read == 1


@pytest.mark.parametrize("bad", ["0%", "150%", "x", "0/3", "4/3"])
def test_bad_subset_is_a_usage_error(filled, aenv, bad: str) -> None:  # type: ignore[no-untyped-def]
    r = aenv(filled.data_dir, "repo", "verify", "--read-data-subset", bad)
    assert r.rc == 2 and "read-data subset" in r.err and "Traceback" not in r.err


def test_missing_repository_is_a_clear_error(tmp_path: Path, aenv) -> None:  # type: ignore[no-untyped-def]
    for cmd in (["verify"], ["gc"], ["unlock"]):
        r = aenv(tmp_path / "nothing-here", "repo", *cmd)
        assert r.rc == 1 and "aenv: error:" in r.err and "no repository" in r.err, r.err


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_pack_byte_is_detected(filled, data) -> None:  # type: ignore[no-untyped-def]
    """Wherever a byte of a pack flips (header, payload, table, footer), --read-data reports an error."""
    packs = _keys(filled.path, PACKS)
    victim = data.draw(st.sampled_from(packs))
    offset = data.draw(st.integers(0, victim.stat().st_size - 1))
    original = victim.read_bytes()
    try:
        _flip(victim, offset)
        with filled.store() as store:
            report = verify(store.repository, read_data=True)
        assert not report.ok
        assert any(victim.name in p.object for p in report.errors)
    finally:
        victim.write_bytes(original)
        os.utime(victim)
    assert id_from_key(victim.name) is not None


def test_verify_waits_for_or_refuses_a_running_gc(filled, aenv) -> None:  # type: ignore[no-untyped-def]
    import threading

    from aenv_store.repository.locks import lock_exclusive

    with filled.store() as store:
        gc_lock = lock_exclusive(store.backend, purpose="a running gc")
        try:
            r = aenv(filled.data_dir, "repo", "verify")
            assert r.rc == 1 and "aenv: error:" in r.err and "a running gc" in r.err
            threading.Timer(0.3, gc_lock.release).start()
            r = aenv(filled.data_dir, "repo", "verify", "--wait", "10s")
            assert r.rc == 0 and "no errors found" in r.out, r.err
        finally:
            gc_lock.release()
