"""The CLI on an oss repository: a missing region is a clear startup error;
with a region, init and stats work against the moto server."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w


def aenv(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aenv_cli.main", "--data-dir", str(data_dir), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [["repo", "init"], ["repo", "stats"], ["p2p", "serve", "--seconds", "1"]])
def test_oss_without_region_fails_naming_the_key(data_dir: Path, command: list[str]) -> None:
    (data_dir / "config.toml").write_text(tomli_w.dumps({"repository": {
        "backend": "oss", "bucket": "snapshots", "endpoint_url": "http://127.0.0.1:9"}}))
    r = aenv(data_dir, *command)
    assert r.returncode != 0
    assert r.stderr.startswith("aenv: error: repository.region is required"), r.stderr
    assert "Traceback" not in r.stderr


def test_oss_without_bucket_names_the_key(data_dir: Path) -> None:
    (data_dir / "config.toml").write_text(tomli_w.dumps({"repository": {"backend": "oss", "region": "us-east-1"}}))
    r = aenv(data_dir, "repo", "init")
    assert r.returncode != 0 and "repository.bucket" in r.stderr and "Traceback" not in r.stderr


def test_repo_init_and_stats_on_moto(moto, data_dir: Path) -> None:  # type: ignore[no-untyped-def]
    (data_dir / "config.toml").write_text(tomli_w.dumps({"repository": moto.repository_config(moto.new_bucket())}))
    r = aenv(data_dir, "repo", "init")
    assert r.returncode == 0, r.stderr
    r = aenv(data_dir, "repo", "stats")
    assert r.returncode == 0, r.stderr
    assert "oss://" in r.stdout
    r = aenv(data_dir, "repo", "init")  # a second init refuses
    assert r.returncode != 0 and r.stderr.startswith("aenv: error:")
