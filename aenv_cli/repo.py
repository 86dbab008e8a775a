"""`aenv repo ...`: create and inspect the repository.

This module owns the `repo` command group: init, stats, ls, cat. The
administration commands (verify, gc, unlock) live in repo_admin.py and are
added to the same group by ``register_admin`` (see ``register``)."""
from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from typing import Any

from aenv_store.errors import StoreNotFound
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Manifest, check_chunk_size
from aenv_store.repository.backends.factory import open_backend_for
from aenv_store.repository.repository import Repository
from aenv_store.store import Store, describe_location

from .common import CliError, common_options, config_from_args, human_bytes, print_json, print_table

_SIZE = re.compile(r"(\d+)\s*([kKmM]?)(i?[bB])?\Z")
_HEX_ID = re.compile(r"[0-9a-fA-F]{64}\Z")


def parse_size(text: str) -> int:
    """'65536', '64K', '64KiB', '1M' -> bytes."""
    m = _SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 4K, 64KiB, 1M, 65536)")
    n = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]
    try:
        return check_chunk_size(n)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub: Any) -> None:
    common = common_options()
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--output", choices=("text", "json"), default="text", help="output format (default text)")
    repo = sub.add_parser("repo", help="the snapshot/image repository",
                          description="Create, inspect, verify and garbage-collect the repository.")
    repo_sub = repo.add_subparsers(dest="repo_command", metavar="SUBCOMMAND")
    repo.set_defaults(handler=lambda args: _help(repo))

    p = repo_sub.add_parser("init", parents=[common], help="create an empty repository",
                            description="Create a repository at the configured location "
                                        "(posix_fs: <data-dir>/repo unless repository.path is set).")
    p.add_argument("--chunk-size", type=parse_size, default=None,
                   help="chunk size for new artifacts, a power of two 4K..4M (default: store.chunk_size, 64K)")
    p.set_defaults(handler=cmd_init)

    p = repo_sub.add_parser("stats", parents=[common, out], help="packs, chunks, manifests and records")
    p.set_defaults(handler=cmd_stats)

    p = repo_sub.add_parser("ls", parents=[common, out], help="list catalog records")
    p.add_argument("--kind", default=None, help="only records of this kind (snapshot, template, layer, alias...)")
    p.set_defaults(handler=cmd_ls)

    p = repo_sub.add_parser("cat", parents=[common, out],
                            help="show a catalog record (by name) or a manifest (by 64-hex id)")
    p.add_argument("what", help="record name or manifest id")
    p.add_argument("--extents", action="store_true", help="list every extent of a manifest")
    p.set_defaults(handler=cmd_cat)

    # --- administration: verify / gc / unlock (aenv_cli/repo_admin.py) ---
    try:
        from .repo_admin import register_admin
    except ModuleNotFoundError as e:
        if e.name not in ("aenv_cli.repo_admin", "aenv_store.admin.gc", "aenv_store.admin.verify"):
            raise
    else:
        register_admin(repo_sub)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _open_repo(args: argparse.Namespace, load_index: bool) -> Repository:
    settings = config_from_args(args).store_settings()
    backend = open_backend_for(settings)
    try:
        return Repository.open(backend, describe_location(settings), load_index=load_index)
    except BaseException:
        backend.close()
        raise


def cmd_init(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    settings = cfg.store_settings()
    if args.chunk_size is not None:
        from dataclasses import replace
        settings = replace(settings, store=replace(settings.store, chunk_size=args.chunk_size))
    store = Store.init(settings)
    try:
        print(f"initialised repository at {describe_location(settings)} "
              f"(chunk size {human_bytes(store.chunk_size)}, id {store.repository.config.id})")
    finally:
        store.close()
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    repo = _open_repo(args, load_index=True)
    try:
        st = repo.stats()
        info: dict[str, Any] = {
            "location": repo.where, "id": repo.config.id, "chunk_size": repo.config.chunk_size,
            "packs": st.packs, "pack_bytes": st.pack_bytes, "index_files": st.index_files,
            "chunks": st.index_entries, "chunk_bytes": st.raw_bytes, "manifests": st.manifests,
            "records": st.records, "bad_index_files": sorted(repo.bad_index_files),
        }
    finally:
        repo.close()
    if args.output == "json":
        print_json(info, sys.stdout)
        return 0
    ratio = st.raw_bytes / st.pack_bytes if st.pack_bytes else 0.0
    print(f"repository   {info['location']} (id {info['id']})")
    print(f"chunk size   {human_bytes(info['chunk_size'])}")
    print(f"packs        {st.packs} ({human_bytes(st.pack_bytes)})")
    print(f"chunks       {st.index_entries} ({human_bytes(st.raw_bytes)} uncompressed, {ratio:.2f}x)")
    print(f"index files  {st.index_files}")
    print(f"manifests    {st.manifests}")
    print(f"records      {st.records}")
    for key in info["bad_index_files"]:
        print(f"warning: unreadable index file {key}: {repo.bad_index_files[key]} "
              "(run `aenv repo verify --rebuild-index`)")
    return 0


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds") if t else "-"


def cmd_ls(args: argparse.Namespace) -> int:
    repo = _open_repo(args, load_index=False)
    try:
        records = repo.list_records(args.kind)
    finally:
        repo.close()
    if args.output == "json":
        print_json([r.to_json() for r in records], sys.stdout)
        return 0
    rows = [{"name": r.name, "kind": r.kind, "created": _when(r.created),
             "manifests": r.target and f"-> {r.target}" or " ".join(f"{role}={bytes(m).hex()[:12]}"
                                                                   for role, m in r.manifests)}
            for r in records]
    print_table(rows, ["name", "kind", "created", "manifests"], sys.stdout)
    return 0


def manifest_json(m: Manifest, extents: bool) -> dict[str, Any]:
    data = [e for e in m.extents if e.chunk is not None]
    out: dict[str, Any] = {
        "id": m.id.hex(), "media_type": m.media_type, "size": m.size, "chunk_size": m.chunk_size,
        "parent": m.parent.hex() if m.parent else None, "meta": dict(m.meta),
        "extents": len(m.extents), "data_extents": len(data), "data_bytes": sum(e.length for e in data),
        "unique_chunks": len({bytes(e.chunk) for e in data if e.chunk is not None}),
    }
    if extents:
        out["extent_list"] = [[e.offset, e.length, e.chunk.hex() if e.chunk else None] for e in m.extents]
    return out


def cmd_cat(args: argparse.Namespace) -> int:
    repo = _open_repo(args, load_index=False)
    try:
        if _HEX_ID.match(args.what):
            try:
                value = manifest_json(repo.get_manifest(Digest.from_hex(args.what.lower())), args.extents)
            except StoreNotFound:
                raise CliError(f"no manifest {args.what.lower()} in {repo.where}", 1) from None
        else:
            try:
                value = repo.get_record(args.what).to_json()
            except ValueError as e:
                raise CliError(str(e)) from None
    finally:
        repo.close()
    print_json(value, sys.stdout)
    return 0
