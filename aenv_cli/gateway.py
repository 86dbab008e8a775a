"""`aenv gateway`: a stateless fleet gateway (aenv_fleet/gateway) serving the whole E2B
API and the sandbox proxy of every node registered in the fleet's Redis. Run any
number of them; SIGTERM/SIGINT stop one cleanly."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from .common import CliError, Subcommands, common_options, config_from_args


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
    gw = cfg.gateway
    changes = {k: v for k, v in (("host", args.host), ("port", args.port), ("redis_url", args.redis_url))
               if v is not None}
    if args.port is not None and not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    gw = dataclasses.replace(gw, **changes)
    access = logging.getLogger("aenv.gateway.access")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.propagate = False
    access.setLevel(logging.WARNING if args.quiet else logging.INFO)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    return asyncio.run(_serve(gw))


async def _serve(gw) -> int:  # type: ignore[no-untyped-def]
    from aenv_fleet.coord import CoordError
    from aenv_fleet.gateway.app import Gateway

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gateway = Gateway(gw)
    try:
        try:
            await gateway.coord.ping()
        except CoordError as e:
            say(f"warning: {e}; serving, and retrying every second")
        try:
            port = await gateway.start(gw.host, gw.port)
        except OSError as e:
            raise CliError(f"cannot listen on {gw.host}:{gw.port}: {e}", 1) from None
        host = "127.0.0.1" if gw.host in ("0.0.0.0", "", "::") else gw.host
        url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        say(f"listening on {url} (fleet redis {gw.redis_url}, {len(gateway.fleet.alive())} node(s) up)")
        sys.stdout.write(f"export E2B_API_URL={url}\nexport E2B_SANDBOX_URL={url}\n")
        sys.stdout.flush()
        await stop.wait()
        say("shutting down")
        return 0
    finally:
        await gateway.close()
