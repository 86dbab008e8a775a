"""Per-sandbox logs as E2B's ``GET /sandboxes/{id}/logs`` serves them.

Two sources, merged in one append-only JSON-lines file per sandbox
(``<data-dir>/sandbox-logs/<id>.jsonl``):

* lifecycle events the API layer records (created, paused, resumed, snapshot,
  forked, timeout, ...) with structured fields;
* the guest's serial console (kernel messages, ``aenv-init``, envd's stderr),
  read through the sandbox service whenever the logs are asked for and before
  the VM goes away (pause). A console line carries the time aenv read it,
  which is at most one request late: QEMU's console has no timestamps.

The log lives as long as the sandbox's record (paused sandboxes keep theirs;
a kill deletes it). A sandbox's console contributes at most
``MAX_CONSOLE_BYTES`` per read, so a guest printing in a loop cannot make one
request read gigabytes; what is skipped is said in the log.

Bounded (issue 28): a sandbox's log is two files, ``<id>.jsonl`` and the older
``<id>.jsonl.1``; when an append would take the newer past half of
``[server] sandbox_log_mib`` it becomes the older one (the oldest entries go). A
query streams the files -- forward from the oldest line, backward from the end in
blocks -- and stops at its ``limit``: it never holds more than ``limit`` entries
and a block, whatever the log's size.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

LEVELS = ("debug", "info", "warn", "error")
MAX_CONSOLE_BYTES = 1 << 20
MAX_LINE = 4096
LOG_BYTES = 8 << 20         # default bound of one sandbox's log files together ([server] sandbox_log_mib)
OLDER = ".1"                # suffix of a sandbox's older log file
BLOCK = 64 << 10            # bytes read at a time backward


@dataclass(frozen=True)
class LogEntry:
    timestamp_ms: int
    level: str
    message: str
    fields: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"t": self.timestamp_ms, "l": self.level, "m": self.message, "f": self.fields},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "LogEntry":
        d = json.loads(line)
        return cls(int(d["t"]), str(d["l"]), str(d["m"]), {str(k): str(v) for k, v in d.get("f", {}).items()})


def _lines_forward(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from f
    except FileNotFoundError:
        return


def _lines_backward(path: Path) -> Iterator[str]:
    """The lines of ``path``, last first, read from the end ``BLOCK`` bytes at a time."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        rest = b""      # the start of a line whose beginning is in an earlier block
        while end > 0:
            start = max(0, end - BLOCK)
            f.seek(start)
            block = f.read(end - start) + rest
            end = start
            lines = block.split(b"\n")
            rest = lines.pop(0) if start > 0 else b""
            for raw in reversed(lines):
                if raw:
                    yield raw.decode("utf-8", errors="replace")
            if len(rest) > 4 * MAX_CONSOLE_BYTES:   # no line of ours is that long: not our file
                return
        if rest:
            yield rest.decode("utf-8", errors="replace")


def _parsed(lines: Iterator[str]) -> Iterator[LogEntry]:
    for line in lines:
        try:
            yield LogEntry.from_json(line)
        except (ValueError, KeyError, TypeError):
            continue        # a torn last line after a crash


class SandboxLogs:
    """The node's sandbox log files. Single writer: the server's event loop; queries
    may run on other threads (a rotation renames, an open file reads on)."""

    def __init__(self, root: Path, max_bytes: int = LOG_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, sid: str) -> Path:
        if not sid or "/" in sid or sid.startswith("."):
            raise ValueError(f"bad sandbox id {sid!r}")
        return self.root / f"{sid}.jsonl"

    def _older(self, sid: str) -> Path:
        return self.root / f"{sid}.jsonl{OLDER}"

    def _append(self, sid: str, entries: list[LogEntry]) -> None:
        if not entries:
            return
        text = "".join(e.to_json() + "\n" for e in entries).encode()
        path = self._path(sid)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(text) > self.max_bytes // 2:
            os.replace(path, self._older(sid))      # the older half goes
        with open(path, "ab") as f:
            f.write(text)

    def event(self, sid: str, message: str, level: str = "info", **fields: object) -> None:
        self._append(sid, [LogEntry(int(time.time() * 1000), level, message,
                                    {k: str(v) for k, v in fields.items() if v is not None})])

    def console_position(self, sid: str) -> tuple[str | None, int]:
        """Where the next console read of ``sid`` starts: (console name, byte offset)."""
        try:
            source, _, offset = (self.root / f"{sid}.console").read_text().rpartition(" ")
            return source or None, int(offset)
        except (OSError, ValueError):
            return None, 0

    def add_console(self, sid: str, source: str, start: int, data: bytes, skipped: int = 0) -> None:
        """Append the complete console lines of ``data`` (console ``source`` from byte
        ``start``) and remember where the next read starts: a partial last line waits for
        its newline, unless it alone fills a whole read."""
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) >= MAX_CONSOLE_BYTES:   # one line longer than a read: cut it
            end = len(data)
        now = int(time.time() * 1000)
        entries = []
        if skipped:
            entries.append(LogEntry(now, "warn", f"{skipped} bytes of console output skipped",
                                    {"source": "console"}))
        for raw in data[:end].splitlines():
            line = raw.decode("utf-8", errors="replace").rstrip("\r")[:MAX_LINE]
            if line.strip():
                entries.append(LogEntry(now, "info", line, {"source": "console"}))
        self._append(sid, entries)
        pos_file = self.root / f"{sid}.console"
        tmp = pos_file.with_suffix(".console.tmp")
        tmp.write_text(f"{source} {start + end}")
        os.replace(tmp, pos_file)

    def entries(self, sid: str) -> Iterator[LogEntry]:
        """Every entry kept, oldest first."""
        path = self._path(sid)
        return _parsed(itertools.chain(_lines_forward(self._older(sid)), _lines_forward(path)))

    def entries_backward(self, sid: str) -> Iterator[LogEntry]:
        """Every entry kept, newest first."""
        path = self._path(sid)
        return _parsed(itertools.chain(_lines_backward(path), _lines_backward(self._older(sid))))

    def query(self, sid: str, *, since_ms: int | None = None, limit: int = 1000, forward: bool = True,
              min_level: str | None = None, search: str | None = None) -> list[LogEntry]:
        """Entries at or after ``since_ms`` (forward) or at or before it (backward,
        newest first), at ``min_level`` or above, containing ``search``; ``limit`` at most.
        Streams the files and stops at ``limit``."""
        floor = LEVELS.index(min_level) if min_level else 0

        def wanted(e: LogEntry) -> bool:
            return (LEVELS.index(e.level if e.level in LEVELS else "info") >= floor
                    and (search is None or search in e.message)
                    and (since_ms is None or (e.timestamp_ms >= since_ms if forward else e.timestamp_ms <= since_ms)))
        source = self.entries(sid) if forward else self.entries_backward(sid)
        return list(itertools.islice(filter(wanted, source), limit))

    def remove(self, sid: str) -> None:
        for p in (self._path(sid), self._older(sid), self.root / f"{sid}.console"):
            p.unlink(missing_ok=True)

    def keep_only(self, sids: set[str]) -> None:
        """Drop the logs of sandboxes that no longer exist (after a restart)."""
        for p in self.root.iterdir():
            name = p.name.removesuffix(OLDER)
            for suffix in (".jsonl", ".console"):
                if name.endswith(suffix) and name[:-len(suffix)] not in sids:
                    p.unlink(missing_ok=True)
