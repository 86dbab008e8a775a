"""`aenv snapshot ls|rm|fork`: snapshots known to a running `aenv server` (through its
E2B API; see apiclient.py for --url / --api-key). Snapshots are made with
`aenv sandbox snapshot` and used as templates by `aenv sandbox create SNAPSHOT`;
`aenv snapshot fork SNAPSHOT -n N` starts N sandboxes from one at once (its sandbox
may be gone), as `aenv sandbox fork` does from a running sandbox; given a paused
sandbox's id instead, from that sandbox's last pause (it stays paused)."""
from __future__ import annotations

import argparse
import urllib.parse

from .apiclient import ApiClient, client_options, emit
from .common import CliError, Subcommands
from .sandbox import emit_fork_results, key_values


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("snapshot", help="list and remove sandbox snapshots (through an aenv server's API)")
    sub = p.add_subparsers(dest="snapshot_command", metavar="COMMAND", required=True)
    ls = sub.add_parser("ls", parents=[client_options()], help="list snapshots")
    ls.add_argument("--sandbox", default=None, help="only snapshots of this sandbox")
    ls.add_argument("--name", default=None, help="only the snapshot with this id or name")
    ls.set_defaults(handler=cmd_ls)
    rm = sub.add_parser("rm", parents=[client_options()], help="delete a snapshot")
    rm.add_argument("snapshot")
    rm.set_defaults(handler=cmd_rm)
    f = sub.add_parser("fork", parents=[client_options()],
                       help="start N sandboxes from a snapshot, or from a paused sandbox's last pause, at once",
                       description="Start N sandboxes at once from a named snapshot (its sandbox may be gone) "
                                   "or from the last pause of a paused sandbox: its files and processes, each "
                                   "new sandbox with its own id and token; the paused sandbox stays paused.")
    f.add_argument("snapshot", help="a snapshot's id or name, or a paused sandbox's id")
    f.add_argument("--count", "-n", type=int, default=1)
    f.add_argument("--timeout", type=int, default=None, help="the sandboxes' time to live in seconds")
    f.add_argument("--metadata", "-m", action="append", default=[], metavar="KEY=VALUE",
                   help="metadata of every new sandbox (repeatable)")
    f.set_defaults(handler=cmd_fork)


def cmd_ls(args: argparse.Namespace) -> int:
    api = ApiClient.from_args(args)
    query = {k: v for k, v in (("sandboxID", args.sandbox), ("name", args.name)) if v}
    items: list[dict] = []
    token = None
    while True:
        q = dict(query, limit="100", **({"nextToken": token} if token else {}))
        items += api.call("GET", "/snapshots?" + urllib.parse.urlencode(q))
        token = api.last_headers.get("X-Next-Token") or api.last_headers.get("x-next-token")
        if not token:
            break
    rows = [{"snapshotID": s["snapshotID"], "names": ",".join(s["names"])} for s in items]
    emit(args, items, rows=rows, columns=["snapshotID", "names"])
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    ApiClient.from_args(args).call("DELETE", f"/templates/{urllib.parse.quote(args.snapshot, safe='')}",
                                   expect=(204,))
    emit(args, {"snapshotID": args.snapshot, "deleted": True}, text=f"deleted {args.snapshot}")
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise CliError("--count must be >= 1")
    body: dict = {"count": args.count}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    if args.metadata:
        body["metadata"] = key_values(args.metadata, "--metadata")
    results = ApiClient.from_args(args).call(
        "POST", f"/snapshots/{urllib.parse.quote(args.snapshot, safe='')}/fork", body, expect=(201,))
    return emit_fork_results(args, results)
