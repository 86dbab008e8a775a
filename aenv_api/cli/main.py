"""`aenv` entry point. Each command group lives in its own module in this
package, exposing ``register(subparsers)``; modules are listed in COMMANDS."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Callable, Sequence

from aenv_store.errors import StoreError

from .common import CliError

# command-group modules (aenv_api.cli.<name>); a module that does not exist yet is skipped.
COMMANDS = ["repo", "cache", "image", "p2p", "doctor", "template", "sandbox", "snapshot", "files", "server"]


def _version() -> str:
    try:
        return version("aenv")
    except PackageNotFoundError:
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aenv", description="aenv: microVM agent sandboxes on a snapshot store")
    parser.add_argument("--version", action="version", version=f"aenv {_version()}")
    parser.add_argument("--data-dir", default=None,
                        help="node data directory (config, repository, cache, workspace); "
                             "env AENV_DATA_DIR; default ~/.local/share/aenv")
    parser.add_argument("--config", default=None, help="config TOML file (default <data-dir>/config.toml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"aenv_api.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"aenv_api.cli.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(handler(args) or 0)
    except (CliError, StoreError) as e:
        print(f"aenv: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1) if isinstance(e, CliError) else 1
    except KeyboardInterrupt:
        print("aenv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
