"""``python -m envd --port N [--host H] [--user NAME]``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from . import ENVD_PORT
from .server import EnvdServer
from .state import EnvdState


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="envd", description="E2B-compatible in-sandbox daemon")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=ENVD_PORT)
    p.add_argument("--user", default="user", help="default user for commands and files (falls back to the user envd runs as if missing)")
    p.add_argument("--access-token", default=None, help="require this X-Access-Token from the start")
    p.add_argument("--sync-clock", action="store_true", help="let /init set the system clock (guest only)")
    p.add_argument("--set-identity", action="store_true",
                   help="let /init set the hostname and reseed the kernel RNG (guest only)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"invalid port {args.port}")
    logging.basicConfig(level=args.log_level.upper(), format="envd: %(levelname)s %(message)s", stream=sys.stderr)
    state = EnvdState(default_user=args.user, access_token=args.access_token, sync_clock=args.sync_clock,
                       set_identity=args.set_identity)
    try:
        asyncio.run(_serve(state, args.host, args.port))
    except OSError as e:
        print(f"envd: error: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve(state: EnvdState, host: str, port: int) -> None:
    server = EnvdServer(state)
    bound = await server.start(host, port)
    print(f"envd listening on {host}:{bound}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()


if __name__ == "__main__":
    sys.exit(main())
