"""Helpers for the admin tests: small-chunk repositories, committing the
deterministic workload artifacts, cold read-back, and running `aenv` in-process."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from aenv_cli.config import load_config
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.store import Store

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
WORKLOAD_SCRIPT = HERE / "workload.py"


def _load_workload() -> ModuleType:
    spec = importlib.util.spec_from_file_location("aenv_admin_workload", WORKLOAD_SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


workload = _load_workload()


def write_config(data_dir: Path, repo: Path | None = None) -> None:
    """4 KiB chunks and the smallest allowed packs, so small artifacts span many chunks."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = ["[store]", "chunk_size = 4096", "pack_target_size = 1048576",
             "[cache]", "capacity = 268435456", "min_free_disk = 0"]
    if repo is not None:
        lines += ["[repository]", f"path = {str(repo)!r}"]
    (data_dir / "config.toml").write_text("\n".join(lines) + "\n")


def write_remote_config(data_dir: Path, repository: dict[str, object]) -> None:
    """As ``write_config``, with the [repository] table of a remote (S3) repository."""
    write_config(data_dir)
    with open(data_dir / "config.toml", "a") as f:
        f.write("[repository]\n")
        for k, v in repository.items():
            f.write(f"{k} = {json.dumps(v)}\n")


def open_store(data_dir: Path, create: bool = False) -> Store:
    return Store.open(load_config(data_dir, overrides={}).store_settings(), create=create)


@dataclass
class Repo:
    """A test repository under ``data_dir`` (repository at data_dir/repo)."""

    data_dir: Path
    tmp: Path
    remote: dict[str, object] | None = None    # the [repository] table of a remote repository

    @property
    def path(self) -> Path:
        return self.data_dir / "repo"

    def store(self) -> Store:
        return open_store(self.data_dir)

    def commit(self, store: Store, seed: int, prefix: str = "snap", parts: int = 1,
               max_chunks: int = 40) -> str:
        """Commit artifact(s) of ``seed`` as record ``<prefix>-<seed>``."""
        rng = random.Random(seed)
        with store.workspace() as ws:
            mids = [workload.write_artifact(ws, workload.content(seed + i, max_chunks=max_chunks), rng)
                    for i in range(parts)]
            name = workload.record_name(prefix, seed)
            ws.commit(CatalogRecord(name=name, kind="snapshot",
                                    manifests=tuple((f"p{i}", m) for i, m in enumerate(mids)), created=time.time()))
        return name

    def read_back(self, names: list[str] | None = None, parts: int = 1, max_chunks: int = 40) -> list[str]:
        """Read every record (or ``names``) through a fresh Store with a cold node cache
        and compare with the workload content; returns the names checked."""
        cold = self.tmp / f"cold-{time.monotonic_ns()}"
        if self.remote is not None:
            write_remote_config(cold, self.remote)
        else:
            write_config(cold, repo=self.path)
        with open_store(cold) as store:
            recs = store.list_records() if names is None else [store.get_record(n) for n in names]
            for rec in recs:
                seed = workload.seed_of(rec.name)
                for i, (_, mid) in enumerate(rec.manifests):
                    blob = store.open_blob(mid)
                    got = blob.read(0, blob.size)
                    want = workload.content(seed + i, max_chunks=max_chunks)
                    assert got == want, f"record {rec.name} part {i}: {len(got)} bytes differ from the original"
        return [r.name for r in recs]


@pytest.fixture
def repo(data_dir: Path, tmp_path: Path) -> Repo:
    write_config(data_dir)
    open_store(data_dir, create=True).close()
    return Repo(data_dir, tmp_path)


@dataclass
class CliResult:
    rc: int
    out: str
    err: str


def run_aenv(data_dir: Path, *args: str) -> CliResult:
    """Run the `aenv` CLI in this process (its real argument parsing and output)."""
    from aenv_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["--data-dir", str(data_dir), *args])
        except SystemExit as e:  # argparse usage errors
            rc = int(e.code or 0)
    return CliResult(rc, out.getvalue(), err.getvalue())


PYTHON = sys.executable


@pytest.fixture
def aenv():
    """``aenv(data_dir, *args) -> CliResult``: the CLI run in-process."""
    return run_aenv


@pytest.fixture
def wl() -> ModuleType:
    """The workload module (deterministic artifact content, committer script)."""
    return workload
