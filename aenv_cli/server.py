"""`aenv server`: one node — store, sandbox manager (with its warm pool), the
E2B-compatible API and the sandbox proxy on one port (assembled by ``Node.open``,
aenv_cli/node.py).

First start on an empty data dir: the repository is created (posix_fs under
the data dir unless configured otherwise), the guest image is built if needed
and the default template is booted once and committed, with progress lines on
stderr. Then the E2B_* variables a client sets are printed on stdout.

SIGTERM/SIGINT: stop accepting connections, pause every running sandbox when
the node can (else kill it), close the proxy, the manager (no QEMU is left
behind) and the store.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import signal
import sys
from typing import TYPE_CHECKING, Any

from .common import CliError, Subcommands, common_options, config_from_args, request_log_to_stderr
from .config import AenvConfig
from .node_secrets import private_data_dir

if TYPE_CHECKING:
    from aenv_api.server.auth import Credentials


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("server", parents=[common_options()],
                              help="run the E2B-compatible API server and sandbox proxy of this node")
    p.add_argument("--host", default=None, help="listen address (default: [server] host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: [server] port, 8000; 0 = any)")
    p.add_argument("--log-format", choices=("text", "json"), default=None,
                   help="request log on stderr: text or JSON lines (default: [server] log_format)")
    p.add_argument("--quiet", action="store_true", help="no request log")
    p.set_defaults(handler=cmd_server)


def say(msg: str) -> None:
    print(f"aenv server: {msg}", file=sys.stderr, flush=True)


def cmd_server(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    changes: dict[str, Any] = {}
    if args.host is not None:
        changes["host"] = args.host
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            raise CliError(f"--port must be in 0..65535, got {args.port}")
        changes["port"] = args.port
    if args.log_format is not None:
        changes["log_format"] = args.log_format
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, **changes))
    request_log_to_stderr("aenv.server.access", quiet=args.quiet)
    from .node import node_credentials
    from .malloc_arenas import limit_malloc_arenas
    from .node_secrets import forget_secret_env
    # every secret is in ``cfg`` and ``creds`` now: none stays in this process's
    # environment (nor in /proc/<pid>/environ), before any thread or child starts
    private_data_dir(cfg.data_dir)
    creds = node_credentials(cfg)
    forgotten = forget_secret_env()
    if forgotten:
        say(f"secrets read from the environment and removed from it: {', '.join(forgotten)} "
            "(give them as files: docs/config.md)")
    limit_malloc_arenas()    # before the node's worker threads start
    return asyncio.run(_serve(cfg, creds))


async def _serve(cfg: AenvConfig, creds: Credentials) -> int:
    from .node import Node   # the node's parts are imported when it starts (the CLI starts fast)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):   # from the start: a signal during the start stops after it
        loop.add_signal_handler(sig, stop.set)
    async with Node.open(cfg, report=say, credentials=creds) as node:
        # one write (PYTHONUNBUFFERED would make print's end a second one): a reader that
        # stops after the lines it wants and closes the pipe never breaks a later write
        sys.stdout.write("".join(f"export {name}={value}\n" for name, value in node.sdk_env().items()))
        sys.stdout.flush()
        settle = asyncio.ensure_future(_settle(node.warmed))
        await stop.wait()
        settle.cancel()
        say("shutting down: no new connections; stopping sandboxes")
        await node.stop_accepting()
    return 0


async def _settle(warmed: asyncio.Future[None]) -> None:
    """Once the node is warm (its pool's first fill ended), the heap it has built so far
    (modules, the default template's manifests and stack maps: ~110 000 objects) is taken
    out of the garbage collector's full collections. A full collection walks every tracked
    object with the GIL held (50-120 ms for that heap here, the event loop answering
    nothing meanwhile) and falls due whenever the heap has grown by a quarter, as during a
    burst of creates. Frozen objects are still freed by reference counting; only cycles
    among them would stay. No collection first (it would be such a pause): the garbage
    cycles of the start that are frozen with the rest are few and made once."""
    with contextlib.suppress(Exception):
        await asyncio.shield(warmed)
    gc.freeze()
