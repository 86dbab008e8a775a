"""`aenv cache stats` / `aenv cache verify` on a real cache directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from aenv_cli.main import main
from aenv_store.cache.node_cache import NodeCache
from aenv_store.config import CacheConfig
from aenv_store.formats.ids import Digest


def fill(data_dir: Path, n: int) -> list[Digest]:
    out = []
    with NodeCache(data_dir / "cache", CacheConfig()) as c:
        for i in range(n):
            data = bytes([i + 1]) * 5000
            d = Digest.of(data)
            c.put(d, data)
            c.get(d)
            out.append(d)
        c.get(Digest.of(b"absent"))
    return out


def test_stats_table_and_json(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(data_dir, 3)
    assert main(["--data-dir", str(data_dir), "cache", "stats"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("STAT")
    assert "entries    3" in text and "hits       3 (75.0% of lookups)" in text
    assert main(["cache", "stats", "--output", "json", "--data-dir", str(data_dir)]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["entries"], st["used_bytes"], st["hits"], st["misses"], st["capacity"]) == (3, 15000, 3, 1, 8 << 30)


def test_stats_of_a_cache_not_created_yet(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--data-dir", str(data_dir), "cache", "stats", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 0
    assert not (data_dir / "cache").exists()  # looking does not create it


def test_config_path_and_bad_config(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (data_dir / "config.toml").write_text(f'[cache]\npath = "{tmp_path / "elsewhere"}"\ncapacity = 1048576\n')
    with NodeCache(tmp_path / "elsewhere", CacheConfig(capacity=1 << 20)) as c:
        c.put(Digest.of(b"x" * 10), b"x" * 10)
    assert main(["--data-dir", str(data_dir), "cache", "stats", "--output", "json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["entries"], st["capacity"]) == (1, 1 << 20)
    (data_dir / "config.toml").write_text("[cache]\ncapacity = 0\n")
    assert main(["--data-dir", str(data_dir), "cache", "stats"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aenv: error: cache.capacity") and "Traceback" not in err


def test_verify_reports_problems(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    digests = fill(data_dir, 2)
    assert main(["--data-dir", str(data_dir), "cache", "verify", "--read-data"]) == 0
    assert "2 entries, 0 problem(s)" in capsys.readouterr().out
    h = digests[0].hex()
    with NodeCache(data_dir / "cache", CacheConfig()) as c:
        loc = c.location_of(digests[0])
    assert loc is not None
    with open(loc.path, "r+b") as f:  # same size, other bytes
        f.seek(loc.offset)
        f.write(b"\0" * loc.size)
    assert main(["--data-dir", str(data_dir), "cache", "verify"]) == 0  # sizes still agree
    capsys.readouterr()
    assert main(["--data-dir", str(data_dir), "cache", "verify", "--read-data", "--output", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == [f"entry {h}: checksum mismatch"]
    assert main(["--data-dir", str(data_dir / "nope"), "cache", "verify"]) == 1
    assert "no node cache at" in capsys.readouterr().err
