"""``python3 -m codeint [--port 49999] [--host H] [--cwd DIR] [--no-envd] [--no-warm]``.

Listens at once; ``/health`` answers 200 only when the default Python context is
started and warmed (the template's ready command polls it, so the frozen template
already has a warm kernel)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from . import CODEINT_PORT, DEFAULT_CWD, ENVD_PORT
from .context import ContextError
from .contexts import Contexts
from .server import CodeInterpreterServer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codeint", description="E2B-compatible code interpreter server")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=CODEINT_PORT)
    p.add_argument("--cwd", default=DEFAULT_CWD, help="cwd of the default contexts")
    p.add_argument("--log-dir", default=os.environ.get("CODEINT_LOG_DIR", "/tmp/codeint"),
                   help="kernels' own stdout/stderr go here")
    p.add_argument("--envd-port", type=int, default=ENVD_PORT)
    p.add_argument("--no-envd", action="store_true", help="no envd to take the sandbox's envs from")
    p.add_argument("--no-warm", action="store_true", help="do not start the default contexts at startup")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"invalid port {args.port}")
    logging.basicConfig(level=args.log_level.upper(), format="codeint: %(levelname)s %(message)s", stream=sys.stderr)
    try:
        asyncio.run(_serve(args))
    except OSError as e:
        print(f"codeint: error: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve(args: argparse.Namespace) -> None:
    contexts = Contexts(Path(args.log_dir), args.cwd)
    server = CodeInterpreterServer(contexts, None if args.no_envd else args.envd_port)
    bound = await server.start(args.host, args.port)
    print(f"codeint listening on {args.host}:{bound}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.no_warm:
        server.ready.set()
        warm = None
    else:
        warm = asyncio.create_task(_warm(server))
    await stop.wait()
    if warm is not None:
        warm.cancel()
    await server.close()


async def _warm(server: CodeInterpreterServer) -> None:
    t0 = asyncio.get_running_loop().time()
    try:
        py = await server.contexts.default("python")
        async with py.lock:
            await py.warm()
        await server.contexts.default("bash")
        await server.rehearse()
    except (ContextError, OSError, TimeoutError) as e:
        logging.error("the default contexts did not start: %s", e)
        return
    server.ready.set()
    logging.info("default contexts warm in %.1f s", asyncio.get_running_loop().time() - t0)


if __name__ == "__main__":
    raise SystemExit(main())
