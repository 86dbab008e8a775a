"""`aenv snapshot ls|rm`: snapshots known to a running `aenv server` (through its
E2B API; see apiclient.py for --url / --api-key). Snapshots are made with
`aenv sandbox snapshot` and used as templates by `aenv sandbox create SNAPSHOT`."""
from __future__ import annotations

import argparse
import urllib.parse

from .apiclient import ApiClient, client_options, emit
from .common import Subcommands


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
