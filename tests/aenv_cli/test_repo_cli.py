"""`aenv repo init|stats|ls|cat`: output and clear errors (no tracebacks)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aenv_cli.main import main
from aenv_store.config import StorePaths, StoreSettings
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.store import Store


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_init_stats_ls_cat(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = ["--data-dir", str(data_dir)]
    rc, _, err = run(capsys, *d, "repo", "stats")
    assert rc == 1 and "no repository at" in err and "aenv repo init" in err
    rc, out, _ = run(capsys, *d, "repo", "init", "--chunk-size", "16K")
    assert rc == 0 and "chunk size 16.0 KiB" in out
    rc, _, err = run(capsys, *d, "repo", "init")
    assert rc == 1 and "already exists" in err

    with Store.open(StoreSettings(paths=StorePaths(data_dir))) as store:
        assert store.chunk_size == 16 << 10
        with store.workspace() as ws:
            w = ws.blob_writer("application/vnd.aenv.disk-layer", meta={"fs": "ext4"})
            w.append(b"hello" * 10_000)
            mid = w.close()
            ws.commit(CatalogRecord("snap-1", "snapshot", (("disk", mid),), created=1.0))
        store.put_record(CatalogRecord("latest", "alias", target="snap-1"))

    rc, out, _ = run(capsys, *d, "repo", "stats", "--output", "json")
    stats = json.loads(out)
    assert rc == 0 and stats["packs"] == 1 and stats["manifests"] == 1 and stats["records"] == 2
    assert stats["chunk_size"] == 16 << 10 and stats["chunk_bytes"] > 0
    rc, out, _ = run(capsys, *d, "repo", "ls")
    assert rc == 0 and "snap-1" in out and "-> snap-1" in out and mid.hex()[:12] in out
    rc, out, _ = run(capsys, *d, "repo", "ls", "--kind", "alias", "--output", "json")
    assert [r["name"] for r in json.loads(out)] == ["latest"]
    rc, out, _ = run(capsys, *d, "repo", "cat", "snap-1")
    assert json.loads(out)["manifests"] == [["disk", mid.hex()]]
    rc, out, _ = run(capsys, *d, "repo", "cat", mid.hex(), "--extents")
    m = json.loads(out)
    assert m["size"] == 50_000 and m["meta"] == {"fs": "ext4"} and len(m["extent_list"]) == m["extents"]
    rc, _, err = run(capsys, *d, "repo", "cat", "0" * 64)
    assert rc == 1 and "no manifest" in err
    rc, _, err = run(capsys, *d, "repo", "cat", "no-such")
    assert rc == 1 and "no catalog record named 'no-such'" in err


def test_errors_are_messages_not_tracebacks(tmp_path: Path) -> None:
    aenv = [sys.executable, "-m", "aenv_cli.main", "--data-dir", str(tmp_path / "d")]
    p = subprocess.run(aenv + ["repo", "init", "--chunk-size", "3000"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "power of two" in p.stderr and "Traceback" not in p.stderr
    subprocess.run(aenv + ["repo", "init"], check=True, capture_output=True, timeout=60)
    (tmp_path / "d" / "repo" / "config").write_text("{not json")
    p = subprocess.run(aenv + ["repo", "ls"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "corrupt repository config" in p.stderr and "Traceback" not in p.stderr
