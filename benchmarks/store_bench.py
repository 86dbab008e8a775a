"""aenv's store against restic and borg on a real, evolving ext4 disk image.

One run: builds v1 (``mkfs.ext4 -d`` over a tree of real files from /usr) and v2
(a copy of v1, loop-mounted, ~5% of its files changed in place), then for each
tool measures ingest throughput of v1, the repository growth from ingesting
v2, full read-back throughput of v1, and a verify that re-reads every byte of
data. Then a chunk-size study of aenv (v1 ingest speed and v2 added bytes per
chunk size). Prints tables with ratios against restic and borg; ``--json`` and
``--markdown`` write them for docs/benchmarks.md.

Needs root (loop mount, dropping the page cache between phases). Installs
restic and borgbackup from Debian if missing.

``--aenv-tree LABEL=DIR`` adds a subject ``aenv@LABEL``: the same store-API phases
run by the aenv checkout in DIR (a subprocess with PYTHONPATH=DIR, see
_aenv_tree.py), e.g. the tree before a change beside this one in one run.
``--readback-rounds N`` then reads v1 back N more times per tool, round-robin
(each round in a rotated order), and reports the percentiles of those cold reads.

    .venv/bin/python benchmarks/store_bench.py                 # 1 GiB tree, all tools
    .venv/bin/python benchmarks/store_bench.py --size 64M --chunk-sizes 64K
    .venv/bin/python benchmarks/store_bench.py --tools aenv,restic --chunk-sizes '' \
        --aenv-tree before=../aenv-main --readback-rounds 7
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import blake3

from _common import (KiB, MiB, BenchError, Stopwatch, drop_caches, dir_bytes, ensure_debian_packages,
                     format_table, human_bytes, is_root, machine_info, markdown_table, parse_size, percentile,
                     run, throughput_mb_s, tool_version)
from _ext4_images import ChangeStats, build_tree, copy_image, evolve_in_place, image_size_for, make_ext4

REPO_ROOT = Path(__file__).resolve().parent.parent
DEBIAN_PEERS = {"restic": "restic", "borgbackup": "borg", "e2fsprogs": "mkfs.ext4"}
READ_BLOCK = 4 * MiB
BORG_COMPRESSION = "zstd,1"   # the codec and level aenv packs with (StoreConfig.compression_level=1)


def file_digest(path: Path) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- the tools

class Subject(Protocol):
    """One tool under test, driven through its normal interface. A subject whose
    phases run in a process of their own may time them itself (``timed``: the
    seconds of its last ingest/restore/verify), else the caller's stopwatch counts."""

    name: str
    notes: list[str]
    timed: float | None

    def version(self) -> str: ...
    def init(self) -> None: ...
    def ingest(self, image: Path, label: str) -> None: ...
    def restore(self, label: str, dest_dir: Path) -> Path: ...
    def verify(self) -> str: ...
    def repo_bytes(self) -> int: ...
    def remove(self) -> None: ...


class Restic:
    name = "restic"
    timed = None

    def __init__(self, work: Path) -> None:
        self.repo = work / "restic-repo"
        self.env = {"RESTIC_REPOSITORY": str(self.repo), "RESTIC_PASSWORD": "bench",
                    "RESTIC_CACHE_DIR": str(work / "restic-cache"), "RESTIC_PROGRESS_FPS": "0.1"}
        self.snapshots: dict[str, tuple[str, Path]] = {}
        self.notes = ["repository v2, compression auto (zstd); always encrypted (AES-256-CTR + Poly1305)",
                      "content-defined chunks (512 KiB..8 MiB, ~1 MiB avg)"]

    def version(self) -> str:
        return tool_version(["restic", "version"]).split(" compiled")[0]

    def init(self) -> None:
        run(["restic", "init", "-q", "--repository-version", "2"], env=self.env)

    def ingest(self, image: Path, label: str) -> None:
        out = run(["restic", "backup", "--json", "--host", "bench", "--tag", label, str(image)], env=self.env)
        for line in reversed(out.splitlines()):
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("message_type") == "summary":
                self.snapshots[label] = (msg["snapshot_id"], image)
                return
        raise BenchError("restic backup printed no summary")

    def restore(self, label: str, dest_dir: Path) -> Path:
        sid, image = self.snapshots[label]
        run(["restic", "restore", "-q", sid, "--target", str(dest_dir)], env=self.env)
        return dest_dir / image.relative_to(image.anchor)

    def verify(self) -> str:
        run(["restic", "check", "-q", "--read-data"], env=self.env)
        return "restic check --read-data"

    def repo_bytes(self) -> int:
        return dir_bytes(self.repo)

    def remove(self) -> None:
        shutil.rmtree(self.repo, ignore_errors=True)
        shutil.rmtree(self.env["RESTIC_CACHE_DIR"], ignore_errors=True)


class Borg:
    name = "borg"
    timed = None

    def __init__(self, work: Path) -> None:
        self.repo = work / "borg-repo"
        self.env = {"BORG_REPO": str(self.repo), "BORG_PASSPHRASE": "", "BORG_BASE_DIR": str(work / "borg-base"),
                    "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
                    "BORG_RELOCATED_REPO_ACCESS_IS_OK": "yes"}
        self.archives: dict[str, str] = {}
        self.notes = [f"--encryption none (aenv stores plaintext too), --compression {BORG_COMPRESSION}",
                      "default buzhash chunker (19,23,21,4095: ~2 MiB avg chunks)"]

    def version(self) -> str:
        return tool_version(["borg", "--version"])

    def init(self) -> None:
        run(["borg", "init", "--encryption", "none"], env=self.env)

    def ingest(self, image: Path, label: str) -> None:
        run(["borg", "create", "--compression", BORG_COMPRESSION, f"::{label}", image.name],
            env=self.env, cwd=image.parent)
        self.archives[label] = image.name

    def restore(self, label: str, dest_dir: Path) -> Path:
        run(["borg", "extract", f"::{label}"], env=self.env, cwd=dest_dir)
        return dest_dir / self.archives[label]

    def verify(self) -> str:
        run(["borg", "check", "--verify-data"], env=self.env)
        return "borg check --verify-data"

    def repo_bytes(self) -> int:
        return dir_bytes(self.repo)

    def remove(self) -> None:
        shutil.rmtree(self.repo, ignore_errors=True)
        shutil.rmtree(self.env["BORG_BASE_DIR"], ignore_errors=True)


class Aenv:
    """aenv, either through its public store API (``mode="api"``: Workspace.blob_writer
    -> commit, Store.open_blob; every byte of the image goes through the writer) or
    through its CLI (``mode="cli"``: `aenv image import` / `aenv image export`, which
    skip the holes of a sparse image file)."""

    MEDIA_TYPE = "application/vnd.aenv.disk-layer"

    def __init__(self, work: Path, chunk_size: int | None = None, tag: str = "", mode: str = "api") -> None:
        self.mode = mode
        self.name = "aenv" + ("-cli" if mode == "cli" else "") + tag
        self.work = work
        self.data_dir = work / f"{self.name}-data"
        self.chunk_size = chunk_size
        self.blobs: dict[str, Any] = {}
        self.commits: dict[str, Any] = {}
        self.notes: list[str] = (["`aenv image import` / `aenv image export` (sparse-aware: holes not read)"]
                                 if mode == "cli" else
                                 ["API: BlobWriter.append of every byte; BlobReader.read_parts from a cold node cache "
                                  "(filling it), written by aenv_store.export.write_parts"])
        self._cold = 0
        self._verify_cli = False
        self.timed: float | None = None

    def _settings(self, data_dir: Path) -> Any:
        from aenv_store.config import RepositoryConfig, StoreConfig, StorePaths, StoreSettings
        store = StoreConfig() if self.chunk_size is None else StoreConfig(chunk_size=self.chunk_size)
        # Every Store shares one repository; each data dir has its own node cache and workspace.
        return StoreSettings(paths=StorePaths(data_dir), store=store,
                             repository=RepositoryConfig(path=str(self.data_dir / "repo")))

    def _open(self, data_dir: Path | None = None, create: bool = False) -> Any:
        from aenv_store.store import Store
        return Store.open(self._settings(data_dir or self.data_dir), create=create)

    def _cli(self, data_dir: Path, *args: str) -> str:
        aenv = REPO_ROOT / ".venv" / "bin" / "aenv"
        cmd = [str(aenv) if aenv.exists() else "aenv", "--data-dir", str(data_dir)]
        if data_dir != self.data_dir:
            # a second node: own cache and workspace, the same repository
            data_dir.mkdir(parents=True, exist_ok=True)
            (data_dir / "config.toml").write_text(f"[repository]\npath = {json.dumps(str(self.data_dir / 'repo'))}\n")
        return run(cmd + list(args))

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def cli_has(*words: str) -> bool:
        """Does this build's CLI have `aenv <words>`? (asked once per run: a start costs ~1 s)"""
        aenv = REPO_ROOT / ".venv" / "bin" / "aenv"
        probe = subprocess.run([str(aenv) if aenv.exists() else "aenv", *words, "--help"],
                               capture_output=True, text=True)
        return probe.returncode == 0

    def version(self) -> str:
        from importlib.metadata import version
        from aenv_store.config import StoreConfig
        cs = self.chunk_size or StoreConfig().chunk_size
        return f"aenv {version('aenv')} (git {_git_rev()}), chunk {cs // KiB} KiB, zstd {StoreConfig().compression_level}"

    def init(self) -> None:
        if self.mode == "cli" and self.chunk_size is not None:
            raise BenchError("the CLI subject uses the configured chunk size")
        self._open(create=True).close()
        # probed here, outside the timed phases
        self._verify_cli = self.cli_has("repo", "verify")

    def ingest(self, image: Path, label: str) -> None:
        if self.mode == "cli":
            self._cli(self.data_dir, "image", "import", str(image), f"bench-{label}")
            return
        from aenv_store.formats.catalog import CatalogRecord
        size = image.stat().st_size
        store = self._open()
        try:
            with store.workspace() as ws:
                writer = ws.blob_writer(self.MEDIA_TYPE, size=size)
                with open(image, "rb") as f:
                    while block := f.read(READ_BLOCK):
                        writer.append(block)
                mid = writer.close()
                self.commits[label] = ws.commit(CatalogRecord(
                    name=f"bench-{label}", kind="image", manifests=(("disk", mid),), created=time.time()))
            self.blobs[label] = mid
        finally:
            store.close()

    def restore(self, label: str, dest_dir: Path) -> Path:
        # A fresh data dir = an empty node cache: every chunk comes from the repository.
        self._cold += 1
        cold_dir = self.work / f"{self.name}-cold-{self._cold}"
        out = dest_dir / f"{label}.img"
        # (the filled cold cache is removed by remove(), outside the timed phase)
        if self.mode == "cli":
            self._cli(cold_dir, "image", "export", f"bench-{label}", str(out))
            return out
        store = self._open(cold_dir)
        try:
            from aenv_store.export import write_parts
            reader = store.open_blob(self.blobs[label])
            write_parts(reader.read_parts, reader.size, out)
        finally:
            store.close()
        return out

    def verify(self) -> str:
        if self._verify_cli:
            self._cli(self.data_dir, "repo", "verify", "--read-data")
            return "aenv repo verify --read-data"
        # `aenv repo` is not registered yet: the same checker, called in-process
        from aenv_store.admin.verify import format_report, verify
        store = self._open()
        try:
            report = verify(store.repository, read_data=True)
        finally:
            store.close()
        if not report.ok:
            raise BenchError(f"{self.name}: verify found problems: " + " | ".join(format_report(report, True)))
        return "aenv_store.admin.verify.verify(read_data=True) in-process (no `aenv repo verify` CLI yet)"

    def repo_bytes(self) -> int:
        return dir_bytes(self.data_dir / "repo")

    def remove(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)
        for n in range(1, self._cold + 1):
            shutil.rmtree(self.work / f"{self.name}-cold-{n}", ignore_errors=True)


class AenvTree:
    """aenv's store API as another checkout of aenv runs it (``--aenv-tree LABEL=DIR``):
    each phase is ``_aenv_tree.py`` in a subprocess with PYTHONPATH=DIR, timed inside
    it like the in-process subject (Store.open to close), so imports do not count."""

    def __init__(self, work: Path, label: str, tree: Path) -> None:
        self.name = f"aenv@{label}"
        self.tree = tree
        self.data_dir = work / f"aenv-{label}-data"
        self.repo = self.data_dir / "repo"
        self.work = work
        self.blobs: dict[str, str] = {}
        self.notes = [f"the store API of the checkout {label} (git {_git_rev(tree)}), in a subprocess"]
        self.timed: float | None = None
        self._cold = 0

    def _call(self, *args: str) -> dict[str, Any]:
        import os
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("_aenv_tree.py")), *args],
                             capture_output=True, text=True, env=env, cwd=str(self.tree))
        if out.returncode != 0:
            raise BenchError(f"{self.name} {args[0]}: {out.stderr.strip()[-2000:]}")
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        self.timed = result.get("seconds")
        return result

    def version(self) -> str:
        return f"aenv (git {_git_rev(self.tree)}) from {self._call('version')['path']}"

    def init(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def ingest(self, image: Path, label: str) -> None:
        self.blobs[label] = self._call("ingest", str(self.data_dir), str(self.repo), str(image),
                                       f"bench-{label}")["mid"]

    def restore(self, label: str, dest_dir: Path) -> Path:
        self._cold += 1
        cold_dir = self.work / f"{self.name}-cold-{self._cold}"
        out = dest_dir / f"{label}.img"
        self._call("restore", str(cold_dir), str(self.repo), self.blobs[label], str(out))
        return out

    def drop_cold(self) -> None:
        shutil.rmtree(self.work / f"{self.name}-cold-{self._cold}", ignore_errors=True)

    def verify(self) -> str:
        problems = self._call("verify", str(self.data_dir), str(self.repo))["problems"]
        if problems:
            raise BenchError(f"{self.name}: verify found problems: " + " | ".join(problems))
        return "aenv_store.admin.verify.verify(read_data=True) in the subprocess"

    def repo_bytes(self) -> int:
        return dir_bytes(self.repo)

    def drop_cold(self) -> None:
        shutil.rmtree(self.work / f"{self.name}-cold-{self._cold}", ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)
        for n in range(1, self._cold + 1):
            shutil.rmtree(self.work / f"{self.name}-cold-{n}", ignore_errors=True)


def _git_rev(tree: Path = REPO_ROOT) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


# ---------------------------------------------------------------- measuring

@dataclass
class Measured:
    tool: str
    version: str
    notes: list[str]
    ingest_v1_s: float = 0.0
    ingest_v2_s: float = 0.0
    repo_after_v1: int = 0
    repo_after_v2: int = 0
    readback_s: float = 0.0
    readback_identical: bool = False
    verify_s: float = 0.0
    verify_how: str = ""

    @property
    def v2_added(self) -> int:
        return self.repo_after_v2 - self.repo_after_v1


@dataclass
class Images:
    v1: Path
    v2: Path
    size: int
    v1_digest: str
    tree_files: int
    tree_bytes: int
    changes: ChangeStats


@dataclass
class Report:
    machine: dict[str, str]
    images: dict[str, Any]
    cache_dropped: bool
    results: list[Measured] = field(default_factory=list)
    runs: dict[str, list[Measured]] = field(default_factory=dict)  # every repeat, for the record
    chunk_study: list[dict[str, Any]] = field(default_factory=list)
    readback: dict[str, list[float]] = field(default_factory=dict)  # --readback-rounds: seconds per round


def phase(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_images(work: Path, size: int, fraction: float, seed: int) -> Images:
    tree = work / "tree"
    phase(f"copying {human_bytes(size)} of real files into a tree")
    stats, holdout = build_tree(tree, size, holdout_bytes=max(MiB, int(size * fraction * 0.1)))
    img_size = image_size_for(stats)
    v1, v2 = work / "v1.img", work / "v2.img"
    phase(f"mkfs.ext4 -d: {stats.files} files, {human_bytes(stats.bytes)} -> {human_bytes(img_size)} image")
    make_ext4(tree, v1, img_size)
    shutil.rmtree(tree)
    copy_image(v1, v2)
    changes = evolve_in_place(v2, fraction, holdout, seed)
    phase(f"v2: {changes.changed} of {changes.files_before} files changed in place "
          f"({human_bytes(changes.bytes_written)} written)")
    return Images(v1, v2, img_size, file_digest(v1), stats.files, stats.bytes, changes)


def _seconds(subject: Subject, sw: Stopwatch) -> float:
    """The phase's time: the subject's own if it timed itself, else the stopwatch's."""
    timed, subject.timed = subject.timed, None
    return sw.seconds if timed is None else timed


def read_back(subject: Subject, images: Images, work: Path) -> tuple[float, bool]:
    """(seconds, identical) of one cold read-back of v1; its output and (aenv) its
    filled node cache are removed afterwards, outside the timing."""
    dest = work / f"restore-{subject.name}"
    dest.mkdir()
    drop_caches()
    subject.timed = None
    with Stopwatch() as sw:
        out = subject.restore("v1", dest)
    seconds = _seconds(subject, sw)
    identical = file_digest(out) == images.v1_digest
    shutil.rmtree(dest)
    drop_cold = getattr(subject, "drop_cold", None)
    if drop_cold is not None:
        drop_cold()
    return seconds, identical


def measure(subject: Subject, images: Images, work: Path) -> Measured:
    m = Measured(subject.name, subject.version(), list(subject.notes))
    subject.init()
    phase(f"{subject.name}: ingest v1")
    drop_caches()
    subject.timed = None
    with Stopwatch() as sw:
        subject.ingest(images.v1, "v1")
    m.ingest_v1_s, m.repo_after_v1 = _seconds(subject, sw), subject.repo_bytes()
    phase(f"{subject.name}: ingest v2")
    drop_caches()
    with Stopwatch() as sw:
        subject.ingest(images.v2, "v2")
    m.ingest_v2_s, m.repo_after_v2 = _seconds(subject, sw), subject.repo_bytes()
    phase(f"{subject.name}: read back v1")
    m.readback_s, m.readback_identical = read_back(subject, images, work)
    if not m.readback_identical:
        # keep measuring the rest; main() fails the run after printing the table
        phase(f"{subject.name}: ERROR: read-back of v1 differs from the image")
    phase(f"{subject.name}: verify (read all data)")
    drop_caches()
    with Stopwatch() as sw:
        m.verify_how = subject.verify()
    m.verify_s = _seconds(subject, sw)
    return m


def readback_rounds(subjects: list[Subject], images: Images, work: Path, rounds: int) -> dict[str, list[float]]:
    """``rounds`` more cold read-backs of v1 per subject, round-robin; round r starts at
    subject r (mod n), so no tool always follows the same one. Seconds per subject."""
    times: dict[str, list[float]] = {s.name: [] for s in subjects}
    for r in range(rounds):
        for k in range(len(subjects)):
            subject = subjects[(r + k) % len(subjects)]
            phase(f"read-back round {r + 1}/{rounds}: {subject.name}")
            seconds, identical = read_back(subject, images, work)
            if not identical:
                raise BenchError(f"{subject.name}: read-back of v1 differs from the image (round {r + 1})")
            times[subject.name].append(seconds)
    return times


def best_of(runs: list[Measured]) -> Measured:
    """Fastest of each timed phase across repeated runs; sizes from the last run
    (they do not depend on timing); read-back must have been right every time."""
    last = runs[-1]
    return Measured(
        last.tool, last.version, last.notes + ([f"best of {len(runs)} runs"] if len(runs) > 1 else []),
        ingest_v1_s=min(m.ingest_v1_s for m in runs), ingest_v2_s=min(m.ingest_v2_s for m in runs),
        repo_after_v1=last.repo_after_v1, repo_after_v2=last.repo_after_v2,
        readback_s=min(m.readback_s for m in runs),
        readback_identical=all(m.readback_identical for m in runs),
        verify_s=min(m.verify_s for m in runs), verify_how=last.verify_how)


def chunk_study(images: Images, work: Path, sizes: list[int], reuse: Measured | None,
                reuse_size: int) -> list[dict[str, Any]]:
    rows = []
    for cs in sizes:
        if reuse is not None and cs == reuse_size:
            m = reuse
        else:
            subject = Aenv(work, chunk_size=cs, tag=f"-{cs // KiB}k")
            m = Measured(subject.name, "", [])
            subject.init()
            phase(f"chunk study {cs // KiB} KiB: ingest v1, v2")
            drop_caches()
            with Stopwatch() as sw:
                subject.ingest(images.v1, "v1")
            m.ingest_v1_s, m.repo_after_v1 = sw.seconds, subject.repo_bytes()
            drop_caches()
            with Stopwatch() as sw:
                subject.ingest(images.v2, "v2")
            m.ingest_v2_s, m.repo_after_v2 = sw.seconds, subject.repo_bytes()
            subject.remove()
        rows.append({"chunk_size": cs, "ingest_v1_mb_s": throughput_mb_s(images.size, m.ingest_v1_s),
                     "ingest_v2_mb_s": throughput_mb_s(images.size, m.ingest_v2_s),
                     "repo_after_v1": m.repo_after_v1, "v2_added": m.v2_added})
    return rows


# ---------------------------------------------------------------- reporting

TARGETS = {"ingest": 1.5, "v2_added": 1.0, "verify": 1.5}


def _factor(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def result_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    """One row per metric: each tool's value, each aenv variant's ratio to each peer
    (its value over the peer's: higher is better for speeds, lower for bytes), and
    whether each aenv variant meets the issue's target against restic."""
    by = {m.tool: m for m in report.results}
    tools = [m.tool for m in report.results]
    subjects = [t for t in tools if t.startswith("aenv")]
    peers = [t for t in tools if not t.startswith("aenv")]
    size = report.images["image_bytes"]
    verified = size * 2  # both versions' logical bytes are behind each verify
    metrics: list[tuple[str, str, Any, str]] = [
        # label, kind, value(m), target key
        ("ingest v1 (MB/s)", "speed", lambda m: throughput_mb_s(size, m.ingest_v1_s), "ingest"),
        ("ingest v2 (MB/s)", "speed", lambda m: throughput_mb_s(size, m.ingest_v2_s), ""),
        ("repo after v1", "bytes", lambda m: m.repo_after_v1, ""),
        ("v2 added bytes", "bytes", lambda m: m.v2_added, "v2_added"),
        ("read-back v1 (MB/s)", "speed", lambda m: throughput_mb_s(size, m.readback_s), ""),
        ("read-back identical", "flag", lambda m: m.readback_identical, ""),
        ("verify all data (s)", "time", lambda m: m.verify_s, ""),
        ("verify (MB/s of image data)", "speed", lambda m: throughput_mb_s(verified, m.verify_s), "verify"),
    ]
    pairs = [(s, p) for s in subjects for p in peers]
    header = (["metric"] + tools + [f"{s}/{p}" for s, p in pairs] + ["target"]
              + [f"met:{s}" for s in subjects] if "restic" in peers else [])
    if "restic" not in peers:
        header = ["metric"] + tools + [f"{s}/{p}" for s, p in pairs]
    rows = []
    for label, kind, value, target in metrics:
        vals = {t: value(by[t]) for t in tools}
        row = [label] + [human_bytes(vals[t]) if kind == "bytes" else ("yes" if vals[t] else "NO: WRONG DATA")
                         if kind == "flag" else f"{vals[t]:.1f}" for t in tools]
        for s, p in pairs:
            row.append(f"{vals[s] / vals[p]:.2f}x" if kind in ("speed", "bytes") and vals[p] else "")
        if "restic" in peers:
            if target:
                want = TARGETS[target]
                row.append(("<= " if kind == "bytes" else ">= ") + f"{want}x restic")
                for s in subjects:
                    r = vals[s] / vals["restic"] if vals["restic"] else float("nan")
                    row.append("yes" if (r <= want if kind == "bytes" else r >= want) else "NO")
            else:
                row += [""] * (1 + len(subjects))
        rows.append(row)
    return header, rows


def readback_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    """The --readback-rounds table: per tool the p50 / p10 / p90 / best of its cold
    read-backs (MB/s), and for each aenv subject the ratio of its p50 to restic's and
    the median of its per-round ratios (the tools of one round saw about the same load)."""
    size = report.images["image_bytes"]
    restic = report.readback.get("restic")
    header = ["tool", "rounds", "p50 MB/s", "p10 MB/s", "p90 MB/s", "best MB/s", "p50 s"]
    if restic:
        header += ["p50 / restic p50", "median of round ratios"]
    rows = []
    for tool, secs in report.readback.items():
        speeds = [throughput_mb_s(size, t) for t in secs]
        row = [tool, str(len(secs)), f"{percentile(speeds, 50):.1f}", f"{percentile(speeds, 10):.1f}",
               f"{percentile(speeds, 90):.1f}", f"{max(speeds):.1f}", f"{percentile(secs, 50):.2f}"]
        if restic:
            if tool == "restic":
                row += ["", ""]
            else:
                ratios = [r / t for t, r in zip(secs, restic)]  # speed ratio = inverse time ratio
                row += [f"{percentile(restic, 50) / percentile(secs, 50):.2f}x", f"{percentile(ratios, 50):.2f}x"]
        rows.append(row)
    return header, rows


def chunk_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    header = ["chunk size", "ingest v1 (MB/s)", "ingest v2 (MB/s)", "repo after v1", "v2 added bytes"]
    rows = [[f"{r['chunk_size'] // KiB} KiB", f"{r['ingest_v1_mb_s']:.1f}", f"{r['ingest_v2_mb_s']:.1f}",
             human_bytes(r["repo_after_v1"]), human_bytes(r["v2_added"])] for r in report.chunk_study]
    return header, rows


def render(report: Report, markdown: bool) -> str:
    table = markdown_table if markdown else format_table
    im, ch = report.images, report.images["changes"]
    lines = [
        f"machine: {report.machine['cpus']} vCPU {report.machine['cpu']}, {report.machine['memory']} RAM, "
        f"kernel {report.machine['kernel']}, Python {report.machine['python']}, {report.machine['date']}, "
        f"load at start {report.machine['loadavg']}",
        f"image: ext4 {human_bytes(im['image_bytes'])} from {im['tree_files']} real files "
        f"({human_bytes(im['tree_bytes'])}); v2 changed {ch['changed']} files in place "
        f"({ch['overwritten']} overwritten regions, {ch['appended']} appends, {ch['rewritten']} rewrites, "
        f"{ch['deleted']} deletes, {ch['created']} new; {human_bytes(ch['bytes_written'])} written)",
        "page cache dropped before every phase" if report.cache_dropped
        else "page cache NOT dropped (not root): reads may come from memory",
        "",
    ]
    if report.results:
        header, rows = result_rows(report)
        lines += [table(rows, header), ""]
        lines += [f"- {m.tool}: {m.version}; verify = `{m.verify_how}`; " + "; ".join(m.notes)
                  for m in report.results]
        lines.append("")
    if report.readback:
        header, rows = readback_rows(report)
        lines += ["cold read-back of v1, rounds after the phases above (round-robin, page cache dropped "
                  "before each):", "", table(rows, header), ""]
    if report.chunk_study:
        header, rows = chunk_rows(report)
        lines += ["aenv chunk-size study:", "", table(rows, header)]
    return "\n".join(lines)


def to_json(report: Report) -> dict[str, Any]:
    out = asdict(report)
    for r, m in zip(out["results"], report.results):
        r["v2_added"] = m.v2_added
    return out


# ---------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("1G"),
                   help="bytes of real files in the v1 tree (image is ~12%% larger); default 1G")
    p.add_argument("--change-fraction", type=float, default=0.05, help="fraction of files changed in v2")
    p.add_argument("--tools", default="aenv,aenv-cli,restic,borg",
                   help="comma list of aenv (store API), aenv-cli (`aenv image import/export`), restic, borg")
    p.add_argument("--chunk-sizes", default="16K,32K,64K,128K,256K",
                   help="aenv chunk sizes for the study (comma list; '' skips it)")
    p.add_argument("--work-dir", type=Path, default=None, help="where images and repositories go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1,
                   help="measure every tool N times (round-robin, fresh repositories) and keep the best")
    p.add_argument("--aenv-tree", action="append", default=[], metavar="LABEL=DIR",
                   help="also measure the aenv checkout in DIR as subject aenv@LABEL (repeatable)")
    p.add_argument("--readback-rounds", type=int, default=0,
                   help="then read v1 back N more times per tool, round-robin, and report percentiles")
    p.add_argument("--no-install", action="store_true", help="do not apt-get install missing peers")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--markdown", type=Path, default=None, help="write the tables as Markdown here")
    args = p.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = sorted(set(args.tools) - {"aenv", "aenv-cli", "restic", "borg"})
    if bad:
        p.error(f"unknown tool {bad[0]} (choose from aenv, aenv-cli, restic, borg)")
    try:
        args.chunk_sizes = [parse_size(s) for s in args.chunk_sizes.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.readback_rounds < 0:
        p.error("--readback-rounds must be >= 0")
    trees: dict[str, Path] = {}
    for spec in args.aenv_tree:
        label, sep, tree = spec.partition("=")
        if not sep or not label or not (Path(tree) / "aenv_store").is_dir():
            p.error(f"--aenv-tree wants LABEL=DIR with an aenv checkout in DIR, got {spec!r}")
        trees[label] = Path(tree).resolve()
    args.aenv_tree = trees
    if not 0 < args.change_fraction < 1:
        p.error("--change-fraction must be between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not is_root():
        raise BenchError("needs root (loop-mounting the image for v2, dropping the page cache)")
    if not args.no_install:
        installed = ensure_debian_packages(DEBIAN_PEERS)
        if installed:
            phase(f"installed {', '.join(installed)}")
    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="aenv-store-bench-", dir=args.work_dir))
    try:
        machine = machine_info()  # before our own work raises the load average
        images = make_images(work, args.size, args.change_fraction, args.seed)
        report = Report(machine=machine, cache_dropped=drop_caches(), images={
            "image_bytes": images.size, "tree_files": images.tree_files, "tree_bytes": images.tree_bytes,
            "changes": {**asdict(images.changes), "changed": images.changes.changed}})
        makers: dict[str, Any] = {"aenv": lambda: Aenv(work), "aenv-cli": lambda: Aenv(work, mode="cli"),
                                  "restic": lambda: Restic(work), "borg": lambda: Borg(work)}
        for label, tree in args.aenv_tree.items():
            makers[f"aenv@{label}"] = functools.partial(AenvTree, work, label, tree)
        tools = list(args.tools) + [f"aenv@{label}" for label in args.aenv_tree]
        if "aenv-cli" in tools and not Aenv.cli_has("image", "import"):
            phase("aenv-cli: no `aenv image import` in this build; skipped")
            tools.remove("aenv-cli")
        # Round-robin repeats, best of each: on a shared machine, load from others
        # hits whichever tool runs at that moment; the best run is the tool's own speed.
        runs: dict[str, list[Measured]] = {t: [] for t in tools}
        kept: list[Subject] = []  # the last repeat's subjects, for --readback-rounds
        try:
            for rep in range(args.repeat):
                for tool in tools:
                    subject = makers[tool]()
                    try:
                        runs[tool].append(measure(subject, images, work))
                    finally:
                        if rep == args.repeat - 1 and args.readback_rounds:
                            kept.append(subject)
                        else:
                            subject.remove()
            report.results = [best_of(runs[t]) for t in tools]
            report.runs = runs
            if args.readback_rounds:
                report.readback = readback_rounds(kept, images, work, args.readback_rounds)
        finally:
            for subject in kept:
                subject.remove()
        if args.chunk_sizes:
            from aenv_store.config import StoreConfig
            aenv = next((m for m in report.results if m.tool == "aenv"), None)
            report.chunk_study = chunk_study(images, work, args.chunk_sizes, aenv, StoreConfig().chunk_size)
        print(render(report, markdown=False))
        if args.markdown:
            args.markdown.write_text(render(report, markdown=True) + "\n")
        if args.json:
            args.json.write_text(json.dumps(to_json(report), indent=2, default=str) + "\n")
        wrong = [m.tool for m in report.results if not m.readback_identical]
        if wrong:
            raise BenchError(f"read-back differs from the image for: {', '.join(wrong)}")
    finally:
        if args.keep:
            phase(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM: unwind so the work dir (GiBs) and mounts are cleaned up


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"store_bench: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("store_bench: interrupted", file=sys.stderr)
        sys.exit(130)
