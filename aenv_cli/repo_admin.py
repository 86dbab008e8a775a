"""`aenv repo verify | gc | unlock`: repository administration commands.

Registered into the `aenv repo` group by aenv_cli.repo (``register_admin``);
thin shells over aenv_store.admin.verify, aenv_store.admin.gc and aenv_store.repository.locks."""
from __future__ import annotations

import argparse
import re
import sys
from contextlib import AbstractContextManager
from typing import Any

from aenv_store.admin.gc import DEFAULT_GRACE, DEFAULT_REPACK_THRESHOLD, format_report as format_gc, gc
from aenv_store.admin.verify import Subset, format_report as format_verify, verify
from aenv_store.repository.backends.factory import open_backend_for
from aenv_store.repository.locks import LockKind, acquire, list_locks
from aenv_store.repository.repository import Repository
from aenv_store.store import describe_location

from .common import CliError, Progress, common_options, config_from_args, print_json

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '1h', '2d', '1h30m' -> seconds."""
    raw = text.strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd]?)", raw)
    if not raw or "".join(n + u for n, u in parts) != raw or (len(parts) > 1 and any(u == "" for _, u in parts)):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 0, 90s, 30m, 1h, 2d)")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return v


def _subset(text: str) -> Subset:
    try:
        return Subset.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _threads(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"threads must be 1..64, got {text!r}")
    return int(text)


def register_admin(repo_sub: Any) -> None:
    """Add verify, gc and unlock to the `aenv repo` subparsers."""
    common = common_options()
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--output", choices=("text", "json"), default="text", help="report format (default text)")

    p = repo_sub.add_parser(
        "verify", parents=[common, out], help="check the repository's structure (and data)",
        description="Check every catalog record's manifests, chunks, index entries and pack trailers; "
                    "with --read-data re-read and re-hash every chunk. Lists each problem with the "
                    "snapshots it affects; exits 1 if any problem is found.")
    p.add_argument("--read-data", action="store_true", help="re-read every pack and re-hash every chunk")
    p.add_argument("--read-data-subset", type=_subset, metavar="N%|n/t",
                   help="re-read only a subset of packs: a random N%%, or group n of t (deterministic)")
    p.add_argument("--rebuild-index", action="store_true",
                   help="first rebuild the index from the pack trailers (exclusive lock), then verify")
    p.add_argument("--threads", type=_threads, default=0, help="read/hash threads (default: CPUs)")
    p.add_argument("--wait", type=parse_duration, default=0.0, metavar="DURATION",
                   help="wait this long for a running gc's exclusive lock to go (default: fail at once)")
    p.set_defaults(handler=cmd_verify)

    p = repo_sub.add_parser(
        "gc", parents=[common, out], help="delete data no catalog record reaches",
        description="Mark everything reachable from the catalog, delete unreferenced packs and manifests, "
                    "repack mostly-garbage packs. Takes the exclusive repository lock.")
    p.add_argument("--grace", type=parse_duration, default=DEFAULT_GRACE, metavar="DURATION",
                   help="never delete anything younger than this (default 1h; e.g. 0, 30m, 2d)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be freed")
    p.add_argument("--repack-threshold", type=_fraction, default=DEFAULT_REPACK_THRESHOLD, metavar="FRACTION",
                   help="repack a pack when more than this share of its bytes is garbage (default 0.5)")
    p.add_argument("--wait", type=parse_duration, default=0.0, metavar="DURATION",
                   help="wait this long for the exclusive lock (default: fail at once)")
    p.set_defaults(handler=cmd_gc)

    p = repo_sub.add_parser("unlock", parents=[common], help="remove stale repository locks",
                            description="Remove locks whose owner process is gone or that timed out.")
    p.add_argument("--remove-all", action="store_true",
                   help="remove every lock, live ones too (only when you know no aenv process uses the repository)")
    p.set_defaults(handler=cmd_unlock)


def _open(args: argparse.Namespace) -> tuple[Repository, Any]:
    cfg = config_from_args(args)
    settings = cfg.store_settings()
    backend = open_backend_for(settings)
    try:
        return Repository.open(backend, describe_location(settings), load_index=False), settings
    except BaseException:
        backend.close()
        raise


def _progress(label: str, total: int, unit: str) -> AbstractContextManager[Any]:
    return Progress(label, total, unit=unit)


def cmd_verify(args: argparse.Namespace) -> int:
    if args.read_data_subset is not None:
        args.read_data = True
    repo, _settings = _open(args)
    try:
        if args.rebuild_index:
            with acquire(repo.backend, LockKind.EXCLUSIVE, purpose="aenv repo verify --rebuild-index",
                         wait=args.wait):
                iid, entries = repo.rebuild_index()
            if args.output == "text":
                print(f"rebuilt the index from pack trailers: {entries} entries"
                      + (f" in index/{iid.hex()}" if iid is not None else ""))
        with acquire(repo.backend, LockKind.SHARED, purpose="aenv repo verify", wait=args.wait):
            report = verify(repo, read_data=args.read_data, subset=args.read_data_subset, threads=args.threads,
                            progress=_progress if args.output == "text" else _no_bar)
    finally:
        repo.close()
    if args.output == "json":
        print_json(report.to_json(), sys.stdout)
    else:
        for line in format_verify(report, args.read_data):
            print(line)
    return 0 if report.ok else 1


def _no_bar(label: str, total: int, unit: str) -> AbstractContextManager[Any]:
    from aenv_store.admin.progress import no_progress

    return no_progress(label, total, unit)


def cmd_gc(args: argparse.Namespace) -> int:
    repo, settings = _open(args)
    try:
        report = gc(repo, grace=args.grace, dry_run=args.dry_run, repack_threshold=args.repack_threshold,
                    pack_target_size=settings.store.pack_target_size,
                    progress=_progress if args.output == "text" else _no_bar,
                    tmp_dir=None, lock_wait=args.wait)
    finally:
        repo.close()
    if args.output == "json":
        print_json(report.to_json(), sys.stdout)
    else:
        for line in format_gc(report):
            print(line)
    return 0


def cmd_unlock(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    backend = open_backend_for(cfg.store_settings())
    try:
        if not backend.exists("config"):
            raise CliError(f"no repository at {describe_location(cfg.store_settings())}; run `aenv repo init`", 1)
        removed = 0
        for entry in list_locks(backend):
            if entry.stale is None and not args.remove_all:
                print(f"kept live {entry.describe()}")
                continue
            backend.delete(entry.key)
            removed += 1
            print(f"removed {entry.describe()}" + (f" (stale: {entry.stale})" if entry.stale else ""))
        print(f"{removed} lock(s) removed")
    finally:
        backend.close()
    return 0


__all__ = ["register_admin", "parse_duration"]
