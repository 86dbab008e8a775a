"""`aenv` entry point. Each command group lives in its own module in this
package, exposing ``register(subparsers)``; modules are listed in COMMANDS."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable, Sequence

from aenv_store.errors import StoreError
from aenv_vm.errors import VmError

from .common import CliError

# command-group modules (aenv_cli.<name>); a module that does not exist yet is skipped.
COMMANDS = ["repo", "cache", "image", "p2p", "doctor", "template", "sandbox", "snapshot", "files", "server", "gateway",
            "cluster", "team", "key"]


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # ~35 ms cold: only for --version
    try:
        return version("aenv")
    except PackageNotFoundError:
        return "0+unknown"


class _VersionAction(argparse.Action):
    """argparse's "version" action, with the version looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str = "show the version and exit") -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"aenv {package_version()}")
        parser.exit()


def _named_command(argv: Sequence[str]) -> str | None:
    """The command group named on the command line, if it is one of COMMANDS."""
    it = iter(argv)
    for arg in it:
        if arg in ("--data-dir", "--config"):
            next(it, None)  # its value
        elif not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The full parser; given ``argv`` naming a command group, only that group's module
    is imported (each start imports less: `aenv repo verify` need not load the VM, P2P
    or API client modules and their dependencies)."""
    parser = argparse.ArgumentParser(prog="aenv", description="aenv: microVM agent sandboxes on a snapshot store")
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("--data-dir", default=None,
                        help="node data directory (config, repository, cache, workspace); "
                             "env AENV_DATA_DIR; default ~/.local/share/aenv")
    parser.add_argument("--config", default=None, help="config TOML file (default <data-dir>/config.toml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    only = _named_command(argv) if argv is not None else None
    for name in [only] if only else COMMANDS:
        try:
            module = importlib.import_module(f"aenv_cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"aenv_cli.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(handler(args) or 0)
    except (CliError, StoreError, VmError) as e:
        print(f"aenv: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1) if isinstance(e, CliError) else 1
    except KeyboardInterrupt:
        print("aenv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
