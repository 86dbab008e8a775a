"""`aenv cluster nodes|drain|undrain|events`: operate a fleet through a gateway
(``--gateway URL`` or env AENV_GATEWAY_URL; the deployment's API key)."""
from __future__ import annotations

import argparse
import os
import time
import urllib.parse

from .apiclient import ApiClient, client_options, emit
from .common import CliError, Subcommands


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("cluster", help="fleet nodes through a gateway: list, drain, undrain")
    sub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)
    parent = argparse.ArgumentParser(add_help=False, parents=[client_options()])
    parent.add_argument("--gateway", default=None, help="gateway URL (env AENV_GATEWAY_URL; default --url)")
    n = sub.add_parser("nodes", parents=[parent], help="the fleet's nodes: lease, capacity, drained")
    n.set_defaults(handler=cmd_nodes)
    d = sub.add_parser("drain", parents=[parent], help="no more creates on NODE (--migrate: move its sandboxes)")
    d.add_argument("node")
    d.add_argument("--migrate", action="store_true",
                   help="pause its sandboxes and release them: their next connect resumes them on another node")
    d.set_defaults(handler=cmd_drain, drained=True)
    u = sub.add_parser("undrain", parents=[parent], help="NODE takes creates again")
    u.add_argument("node")
    u.set_defaults(handler=cmd_drain, drained=False, migrate=False)
    e = sub.add_parser("events", parents=[parent], help="the fleet's recent events, newest first")
    e.set_defaults(handler=cmd_events)


def _client(args: argparse.Namespace) -> ApiClient:
    gateway = args.gateway or os.environ.get("AENV_GATEWAY_URL")
    if gateway:
        args.url = gateway
    client = ApiClient.from_args(args)
    client.timeout = 3600.0     # drain --migrate pauses sandboxes one by one
    return client


def cmd_nodes(args: argparse.Namespace) -> int:
    nodes = _client(args).call("GET", "/nodes")
    now = time.time()
    rows = [{"node": n["nodeID"], "state": n["state"] + (" (drained)" if n["drained"] else ""), "url": n["url"],
             "free": "-" if n["freeSlots"] is None else n["freeSlots"], "max": n["maxSandboxes"],
             "running": n["running"], "paused": n["paused"], "mem_avail": f"{n['memAvailableMiB']} MiB",
             "lease": f"{n['leaseDeadline'] - now:+.1f} s"} for n in nodes]
    emit(args, nodes, rows, ["node", "state", "url", "free", "max", "running", "paused", "mem_avail", "lease"])
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    if not args.node or "/" in args.node:
        raise CliError(f"not a node id: {args.node!r}")
    op = "drain" if args.drained else "undrain"
    out = _client(args).call("POST", f"/nodes/{urllib.parse.quote(args.node, safe='')}/{op}",
                             {"migrate": bool(args.migrate)})
    text = f"node {args.node}: {'drained' if args.drained else 'undrained'}"
    if args.migrate:
        text += f"; migrated {len(out['migrated'])}, failed {len(out['failed'])}"
        for f in out["failed"]:
            text += f"\n  {f['sandboxID']}: {f['error']}"
    emit(args, out, text=text)
    return 1 if out.get("failed") else 0


def cmd_events(args: argparse.Namespace) -> int:
    events = _client(args).call("GET", "/cluster/events")
    emit(args, events, events, ["eventID", "type", "id", "detail"])
    return 0
