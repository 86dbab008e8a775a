"""`aenv cache ...`: inspect the node cache (<data-dir>/cache unless cache.path is set).

The cache is opened directly (no server needed); it is safe to do so while other
processes use it."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from aenv_store.cache.node_cache import CacheStats, NodeCache, validate_config

from .common import CliError, common_options, config_from_args, human_bytes, print_json, print_table


def register(sub: Any) -> None:
    common = common_options()
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--output", choices=("text", "json"), default="text", help="output format (default text)")
    cache = sub.add_parser("cache", help="the node's local chunk cache",
                           description="Inspect the bounded local cache of verified chunks.")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="SUBCOMMAND")
    cache.set_defaults(handler=lambda args: _help(cache))

    p = cache_sub.add_parser("stats", parents=[common, out], help="size, entries, pins, hit/miss/fetch/eviction counters",
                             description="Counters are lifetime totals of every process that used the cache.")
    p.set_defaults(handler=cmd_stats)

    p = cache_sub.add_parser("verify", parents=[common, out], help="check that the index and the chunk files agree",
                             description="Exact when no other process is writing to the cache.")
    p.add_argument("--read-data", action="store_true", help="also re-read every file and compare its checksum")
    p.set_defaults(handler=cmd_verify)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def cache_path(args: argparse.Namespace) -> tuple[Path, Any]:
    cfg = config_from_args(args)
    path = Path(cfg.cache.path).expanduser() if cfg.cache.path else cfg.store_settings().paths.cache
    validate_config(cfg.cache)
    return path, cfg.cache


def _open(path: Path, config: Any) -> NodeCache:
    if path.exists() and not path.is_dir():
        raise CliError(f"node cache path {path} is not a directory")
    return NodeCache(path, config)


def cmd_stats(args: argparse.Namespace) -> int:
    path, config = cache_path(args)
    if not path.exists():  # nothing cached yet: report an empty cache without creating it
        st = CacheStats(capacity=config.capacity, used_bytes=0, entries=0, pinned=0, hits=0, misses=0,
                        fetches=0, evictions=0, high_watermark=config.high_watermark,
                        low_watermark=config.low_watermark, min_free_disk=config.min_free_disk, path=str(path))
    else:
        with _open(path, config) as cache:
            st = cache.stats()
    if args.output == "json":
        print_json(dataclasses.asdict(st), sys.stdout)
        return 0
    lookups = st.hits + st.misses
    rows = [
        ("path", st.path + ("" if path.exists() else " (not created yet)")),
        ("capacity", f"{human_bytes(st.capacity)} (evict above {st.high_watermark:.0%} down to "
                     f"{st.low_watermark:.0%}; keep {human_bytes(st.min_free_disk)} free on disk)"),
        ("used", f"{human_bytes(st.used_bytes)} ({st.used_bytes / st.capacity:.1%} of capacity)"),
        ("entries", str(st.entries)),
        ("pinned", f"{st.pinned} ({human_bytes(st.pinned_bytes)})"),
        ("hits", f"{st.hits}" + (f" ({st.hits / lookups:.1%} of lookups)" if lookups else "")),
        ("misses", str(st.misses)),
        ("fetches", str(st.fetches)),
        ("evictions", f"{st.evictions} ({human_bytes(st.evicted_bytes)})"),
        ("corrupt", f"{st.corrupt} (entries dropped: file did not match its checksum)"),
        ("disk free", human_bytes(st.disk_free) if path.exists() else "-"),
    ]
    print_table([{"stat": k, "value": v} for k, v in rows], ["stat", "value"], sys.stdout)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    path, config = cache_path(args)
    if not path.exists():
        raise CliError(f"no node cache at {path}", 1)
    with _open(path, config) as cache:
        problems = cache.verify(read_data=args.read_data)
        entries = cache.stats().entries
    if args.output == "json":
        print_json({"path": str(path), "entries": entries, "problems": problems}, sys.stdout)
    else:
        for p in problems:
            print(f"problem: {p}")
        print(f"node cache {path}: {entries} entries, {len(problems)} problem(s)")
    return 1 if problems else 0
