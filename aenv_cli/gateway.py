"""`aenv gateway`: a stateless fleet gateway (aenv_fleet/gateway) serving the whole E2B
API and the sandbox proxy of every node registered in the fleet's Redis (assembled by
``FleetGateway.open``, aenv_cli/fleet_gateway.py). Run any number of them;
SIGTERM/SIGINT stop one cleanly."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .common import CliError, Subcommands, common_options, config_from_args, request_log_to_stderr
from .node_secrets import forget_secret_env

if TYPE_CHECKING:
    from aenv_fleet.config import GatewayConfig


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("gateway", parents=[common_options()],
                              help="run a fleet gateway: the E2B API and sandbox proxy over every node")
    p.add_argument("--host", default=None, help="listen address (default: [gateway] host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: [gateway] port, 8080; 0 = any)")
    p.add_argument("--redis-url", default=None, help="the fleet's Redis (default: [gateway] redis_url)")
    p.add_argument("--quiet", action="store_true", help="no request log")
    p.set_defaults(handler=cmd_gateway)


def say(msg: str) -> None:
    print(f"aenv gateway: {msg}", file=sys.stderr, flush=True)


def cmd_gateway(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    changes = {k: v for k, v in (("host", args.host), ("port", args.port), ("redis_url", args.redis_url))
               if v is not None}
    if args.port is not None and not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    gw = dataclasses.replace(cfg.gateway, **changes)
    forgotten = forget_secret_env()     # everything is read: no secret stays in the environment
    if forgotten:
        say(f"secrets removed from the environment: {', '.join(forgotten)}")
    request_log_to_stderr("aenv.gateway.access", quiet=args.quiet)
    return asyncio.run(_serve(gw, cfg.data_dir))


async def _serve(gw: GatewayConfig, data_dir: Path) -> int:
    from .fleet_gateway import FleetGateway   # imported when it starts (the CLI starts fast)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with FleetGateway.open(gw, data_dir, report=say) as gateway:
        sys.stdout.write("".join(f"export {name}={value}\n" for name, value in gateway.sdk_env().items()))
        sys.stdout.flush()
        await stop.wait()
        say("shutting down")
    return 0
