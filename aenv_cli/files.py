"""`aenv files put|get`: copy files into and out of a sandbox through a running
`aenv server`'s proxy (see apiclient.py for --url / --api-key)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .apiclient import ApiClient, client_options, emit
from .common import CliError, Subcommands


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("files", help="copy files into and out of sandboxes (through an aenv server)")
    sub = p.add_subparsers(dest="files_command", metavar="COMMAND", required=True)
    put = sub.add_parser("put", parents=[client_options()], help="upload a local file (- = stdin)")
    put.add_argument("sandbox")
    put.add_argument("local")
    put.add_argument("remote", help="absolute path in the sandbox")
    put.add_argument("--user", default="user")
    put.set_defaults(handler=cmd_put)
    get = sub.add_parser("get", parents=[client_options()], help="download a file (to LOCAL, or stdout)")
    get.add_argument("sandbox")
    get.add_argument("remote")
    get.add_argument("local", nargs="?", default="-")
    get.add_argument("--user", default="user")
    get.set_defaults(handler=cmd_get)


def cmd_put(args: argparse.Namespace) -> int:
    try:
        data = sys.stdin.buffer.read() if args.local == "-" else Path(args.local).read_bytes()
    except OSError as e:
        raise CliError(f"cannot read {args.local}: {e.strerror}", 1) from None
    ApiClient.from_args(args).write_file(args.sandbox, args.remote, data, user=args.user)
    emit(args, {"path": args.remote, "bytes": len(data)}, text=f"{len(data)} bytes -> {args.sandbox}:{args.remote}")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    data = ApiClient.from_args(args).read_file(args.sandbox, args.remote, user=args.user)
    if args.local == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return 0
    try:
        Path(args.local).write_bytes(data)
    except OSError as e:
        raise CliError(f"cannot write {args.local}: {e.strerror}", 1) from None
    emit(args, {"path": args.local, "bytes": len(data)}, text=f"{args.sandbox}:{args.remote} -> {args.local}")
    return 0
