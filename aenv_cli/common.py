"""Helpers shared by the CLI command modules: config loading, output, progress."""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from .config import AenvConfig, load_config, resolve_data_dir

if TYPE_CHECKING:     # the store is imported when a command opens it (the CLI starts fast)
    from aenv_store.store import Store


class Subcommands(Protocol):
    """What a command module's ``register`` gets: ``parser.add_subparsers()``'s result
    (argparse names its class only privately)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class CliError(Exception):
    """A user-facing error: printed as 'aenv: error: …' with exit code ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StartError(CliError):
    """A node or gateway cannot start (no guest, a stale template it may not rebuild, a
    network mode the host cannot do, a port it cannot listen on): the message says which."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 1)


def local_url(host: str, port: int) -> str:
    """How this host reaches a server listening on ``host:port`` (a wildcard address: over loopback)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand also accepts (so `aenv repo verify --data-dir X` works)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--data-dir", default=argparse.SUPPRESS,
                        help="node data directory (env AENV_DATA_DIR; default ~/.local/share/aenv)")
    parent.add_argument("--config", default=argparse.SUPPRESS, help="config TOML file")
    return parent


def config_from_args(args: argparse.Namespace) -> AenvConfig:
    data_dir = resolve_data_dir(getattr(args, "data_dir", None))
    cfg = getattr(args, "config", None)
    return load_config(data_dir, Path(cfg).expanduser() if cfg else None)


def open_store(args: argparse.Namespace, create: bool = False) -> Store:
    """The node's store as the command's config names it (``create``: a new repository if none)."""
    from aenv_store.assembly import open_node_store

    return open_node_store(config_from_args(args).store_settings(), create=create)


_SIZE = re.compile(r"^(\d+)([KMGT]i?B?|B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    m = _SIZE.match(text.strip())
    if not m:
        raise CliError(f"bad size {text!r} (examples: 536870912, 512M, 2G)")
    n = int(m.group(1))
    unit = (m.group(2) or "B")[0].upper()
    return n * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]


def print_table(rows: list[dict[str, Any]], columns: list[str], out: TextIO | None = None) -> None:
    out = out or sys.stdout  # looked up per call, so redirected/captured stdout is honoured
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns}
    out.write("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip() + "\n")
    for r in rows:
        out.write("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns).rstrip() + "\n")


def print_json(value: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    out.write(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


@dataclass
class Progress:
    """A progress bar on a terminal, plain log lines (every ~2 s and at the end) otherwise.

    Use as ``with Progress("verify", total) as p: p.advance(n)``."""

    label: str
    total: int
    unit: str = ""
    out: TextIO = field(default_factory=lambda: sys.stderr)
    done: int = 0
    _last: float = 0.0
    _start: float = 0.0

    def __enter__(self) -> "Progress":
        self._start = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self._render(final=True)
        if self.out.isatty():
            self.out.write("\n")
        self.out.flush()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        interval = 0.1 if self.out.isatty() else 2.0
        if now - self._last >= interval:
            self._last = now
            self._render()

    def _text(self) -> str:
        def fmt(v: int) -> str:
            return human_bytes(v) if self.unit == "bytes" else str(v)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.label}: {fmt(self.done)}/{fmt(self.total)} ({pct:.0f}%) {time.monotonic() - self._start:.1f}s"

    def _render(self, final: bool = False) -> None:
        if self.out.isatty():
            width = 30
            filled = int(width * (self.done / self.total)) if self.total else width
            self.out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self._text()}")
        elif final or self.done:
            self.out.write(self._text() + "\n")
        self.out.flush()


def request_log_to_stderr(logger: str, *, quiet: bool) -> None:
    """A server's request log (``logger``) as plain lines on stderr (``quiet``: warnings only).
    aiohttp's own log of requests its HTTP parser rejects (NUL in a header, ...) is silenced:
    the client already got its 400, and every handler error is logged by the app itself."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger(logger)
    access.addHandler(handler)
    access.propagate = False
    access.setLevel(logging.WARNING if quiet else logging.INFO)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
