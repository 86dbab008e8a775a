"""Smoke run of benchmarks/store_bench.py at a tiny size, so CI catches the
benchmark breaking (image generation, every tool's phases, the report). The
numbers themselves are meaningless at this size; docs/benchmarks.md holds the
1 GiB run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "store_bench.py"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop-mounts an image: needs root (CI runs as root)")


@pytest.mark.timeout(120)
def test_store_bench_tiny_run(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--size", "8M", "--chunk-sizes", "32K,64K",
         "--work-dir", str(tmp_path / "work"), "--json", str(out_json), "--markdown", str(out_md)],
        capture_output=True, text=True, timeout=110, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())

    image = report["images"]
    assert image["image_bytes"] > image["tree_bytes"] >= 8 * 1024 * 1024
    assert image["changes"]["changed"] >= 1 and image["changes"]["bytes_written"] > 0

    results = {r["tool"]: r for r in report["results"]}
    # aenv twice: through the store API and through `aenv image import/export`
    assert set(results) == {"aenv", "aenv-cli", "restic", "borg"}
    for tool, r in results.items():
        assert r["readback_identical"], tool
        assert r["ingest_v1_s"] > 0 and r["readback_s"] > 0 and r["verify_s"] > 0, tool
        # v2 is v1 with a few files changed: it must add something, and much less than v1 took
        assert 0 < r["v2_added"] < r["repo_after_v1"], tool
    assert results["aenv"]["verify_how"].startswith("aenv repo verify --read-data")
    assert len(report["runs"]["restic"]) == 1

    study = {row["chunk_size"]: row for row in report["chunk_study"]}
    assert set(study) == {32 * 1024, 64 * 1024}
    assert all(row["v2_added"] > 0 and row["ingest_v1_mb_s"] > 0 for row in study.values())

    table = proc.stdout
    assert "ingest v1 (MB/s)" in table and "aenv/restic" in table and "chunk-size study" in table
    assert "| metric |" in out_md.read_text()
    # the work dir is cleaned up (only the empty parent remains)
    assert list((tmp_path / "work").iterdir()) == []
