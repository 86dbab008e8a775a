"""A build's log: timestamped entries (level, message, the step they belong to), read
by offset as the SDK polls them (``logsOffset``). Guest output is split into lines;
a line is cut at 8 KiB and the log keeps at most ``MAX_ENTRIES`` (older ones are
dropped and counted, the offsets stay stable)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_LINE = 8 << 10
MAX_ENTRIES = 20_000


@dataclass(frozen=True)
class LogEntry:
    timestamp: float
    level: str              # debug | info | warn | error
    message: str
    step: str | None = None


@dataclass
class BuildLog:
    entries: list[LogEntry] = field(default_factory=list)
    dropped: int = 0                      # entries before ``entries[0]`` that are gone
    _partial: dict[str, bytearray] = field(default_factory=dict, repr=False)

    def add(self, level: str, message: str, step: str | None = None) -> None:
        for line in message.splitlines() or [""]:
            self.entries.append(LogEntry(time.time(), level, line[:MAX_LINE], step))
        if len(self.entries) > MAX_ENTRIES:
            cut = len(self.entries) - MAX_ENTRIES
            del self.entries[:cut]
            self.dropped += cut

    def info(self, message: str, step: str | None = None) -> None:
        self.add("info", message, step)

    def error(self, message: str, step: str | None = None) -> None:
        self.add("error", message, step)

    def output(self, step: str | None, stream: str, data: bytes) -> None:
        """Guest output: whole lines become entries, the rest waits for its newline."""
        buf = self._partial.setdefault(stream, bytearray())
        buf += data
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > MAX_LINE:
                    nl = MAX_LINE
                else:
                    break
            line = bytes(buf[:nl]).decode(errors="replace").rstrip("\r")
            del buf[:nl + 1]
            self.add("info" if stream == "stdout" else "warn", line, step)

    def flush(self, step: str | None) -> None:
        for stream, buf in self._partial.items():
            if buf:
                self.add("info" if stream == "stdout" else "warn", bytes(buf).decode(errors="replace"), step)
                buf.clear()

    def since(self, offset: int, limit: int = 100) -> list[LogEntry]:
        start = max(0, offset - self.dropped)
        return self.entries[start:start + limit]

    def tail(self, n: int = 20, step: str | None = None) -> list[LogEntry]:
        picked = [e for e in self.entries if step is None or e.step == step]
        return picked[-n:]
