"""What verify and gc share besides the repository: progress reporting (the CLI
hands in a bar, the library default shows nothing) and byte counts for humans."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Protocol


class Advancer(Protocol):
    def advance(self, n: int = 1) -> None: ...


# (label, total, unit) -> a context manager yielding something with advance(n):
# the CLI passes aenv_cli.common.Progress; the library default shows nothing.
ProgressFactory = Callable[[str, int, str], AbstractContextManager[Advancer]]


class _Quiet:
    def advance(self, n: int = 1) -> None:
        pass


def no_progress(label: str, total: int, unit: str) -> AbstractContextManager[Advancer]:
    return nullcontext(_Quiet())


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units, one decimal; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
