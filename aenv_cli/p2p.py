"""`aenv p2p status | add-peer | ticket | serve`: peer-to-peer chunk sharing.

A node's P2P endpoint runs inside whatever process opened its Store (the API
server, `aenv p2p serve`); these commands talk to it through files in
<data-dir>/p2p/ (aenv_store.p2p.peers), so they work while it runs."""
from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any

from aenv_store.errors import ConfigError
from aenv_store.p2p import peers as peerfile
from aenv_store.p2p.node import offline_ticket, parse_ticket

from .common import CliError, common_options, config_from_args, human_bytes, print_json, print_table


def register(sub: Any) -> None:
    common = common_options()
    p = sub.add_parser("p2p", help="peer-to-peer sharing of committed chunks (iroh)")
    p2p_sub = p.add_subparsers(dest="p2p_command", metavar="SUBCOMMAND")
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])

    st = p2p_sub.add_parser("status", parents=[common], help="this node's peers and traffic")
    st.add_argument("--output", choices=("text", "json"), default="text")
    st.set_defaults(handler=cmd_status)

    ap = p2p_sub.add_parser("add-peer", parents=[common], help="add a peer by its ticket (a running node picks it up)")
    ap.add_argument("ticket", help="the peer's ticket (`aenv p2p ticket` on that node)")
    ap.set_defaults(handler=cmd_add_peer)

    tk = p2p_sub.add_parser("ticket", parents=[common], help="print this node's ticket for its peers")
    tk.set_defaults(handler=cmd_ticket)

    sv = p2p_sub.add_parser("serve", parents=[common], help="open the store with P2P on and serve peers until interrupted")
    sv.add_argument("--seconds", type=float, default=0, help="stop after this long (default: run until SIGINT/SIGTERM)")
    sv.set_defaults(handler=cmd_serve)


def cmd_status(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    st = peerfile.read_status(cfg.data_dir)
    added = peerfile.read_added_peers(cfg.data_dir)
    if args.output == "json":
        print_json({"enabled": cfg.p2p.enabled, "node": st, "config_peers": list(cfg.p2p.peers),
                    "added_peers": added})
        return 0
    print(f"p2p: {'enabled' if cfg.p2p.enabled else 'disabled'} ([p2p] enabled in config)")
    if st is None:
        print("node: never ran on this data dir")
    else:
        state = "running" if st["running"] else "not running (last status shown)"
        print(f"node: {st.get('node_id', '')[:16]}… pid {st.get('pid')} {state}")
        print(f"ticket: {st.get('ticket', '')}")
        t = st.get("totals", {})
        print(f"traffic: in {human_bytes(t.get('bytes_in', 0))}, out {human_bytes(t.get('bytes_out', 0))}, "
              f"requests sent {t.get('requests_out', 0)}, served {t.get('requests_in', 0)}, "
              f"failures {t.get('failures', 0)}, bad data {t.get('bad_data', 0)}, "
              f"strangers refused {t.get('refused_in', 0)}")
    rows: list[dict[str, Any]] = []
    known = set()
    for p in (st or {}).get("peers", []):
        known.add(p["ticket"])
        rows.append({"peer": p["node_id"][:16], "source": p["source"], "state": p["state"],
                     "in": human_bytes(p["bytes_in"]), "chunks": p["chunks_in"], "requests": p["requests"],
                     "misses": p["misses"], "failures": p["failures"], "bad": p["bad_data"],
                     "note": p["dropped_reason"] or p["last_error"]})
    for source, tickets in (("config", cfg.p2p.peers), ("added", added)):
        for t in tickets:
            if t in known:
                continue
            known.add(t)
            try:
                node_id = parse_ticket(t)[1][:16]
            except ConfigError:
                node_id = "(bad ticket)"
            rows.append({"peer": node_id, "source": source, "state": "not contacted"})
    if rows:
        print_table(rows, ["peer", "source", "state", "in", "chunks", "requests", "misses", "failures", "bad", "note"])
    else:
        print("peers: none (add one with `aenv p2p add-peer TICKET`)")
    return 0


def cmd_add_peer(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        _, node_id = parse_ticket(args.ticket)
    except ConfigError as e:
        raise CliError(str(e)) from None
    added = peerfile.add_peer_ticket(cfg.data_dir, args.ticket.strip())
    print(f"peer {node_id[:16]}… {'added' if added else 'was already added'}"
          + ("" if cfg.p2p.enabled else " (p2p is disabled: set [p2p] enabled = true)"))
    return 0


def cmd_ticket(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    st = peerfile.read_status(cfg.data_dir)
    if st is not None and st["running"] and st.get("ticket"):
        print(st["ticket"])
        return 0
    if cfg.p2p.port:
        print(offline_ticket(cfg.data_dir, cfg.p2p.port, cfg.store_settings().p2p.bind_host()))
        return 0
    raise CliError("no P2P node is running on this data dir and p2p.port = 0 (a random port): "
                   "start one (`aenv p2p serve`) or set a fixed [p2p] port", exit_code=1)


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from aenv_store.assembly import open_node_store, peer_source

    cfg = config_from_args(args)
    settings = cfg.store_settings()
    settings = dataclasses.replace(settings, p2p=dataclasses.replace(settings.p2p, enabled=True))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with open_node_store(settings) as store:
        peers = peer_source(store)
        if peers is None:
            raise CliError("the P2P endpoint did not start (see the log)", exit_code=1)
        print(peers.ticket, flush=True)
        deadline = time.monotonic() + args.seconds if args.seconds > 0 else None
        while not stop.wait(0.2):
            if deadline is not None and time.monotonic() >= deadline:
                break
    return 0
