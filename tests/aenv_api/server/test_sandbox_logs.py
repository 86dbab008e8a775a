"""A sandbox's log files (aenv_api/server/sandbox_logs.py) stay bounded and are queried
without being loaded whole: what is kept is the newest part of what was written, never
more than the bound (plus one append); a query forward or backward, filtered, answers
exactly what a filter over the kept entries would, up to its limit."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from aenv_api.server import sandbox_logs
from aenv_api.server.sandbox_logs import LEVELS, LogEntry, SandboxLogs

entry = st.builds(LogEntry, st.integers(0, 10_000), st.sampled_from(LEVELS),
                  st.text(alphabet="abc \u00e9", min_size=0, max_size=300))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(entry, min_size=1, max_size=5), max_size=40), st.integers(0, 10_000),
       st.integers(0, 50), st.booleans(), st.sampled_from((None,) + LEVELS), st.sampled_from((None, "a", "bc")))
def test_kept_entries_are_the_newest_and_queries_match_a_filter(
        tmp_path_factory: pytest.TempPathFactory, appends: list[list[LogEntry]], since: int, limit: int,
        forward: bool, level: str | None, search: str | None) -> None:
    logs = SandboxLogs(tmp_path_factory.mktemp("logs"), max_bytes=4096)
    written: list[LogEntry] = []
    for batch in appends:
        logs._append("sbx-1", batch)
        written += batch
        size = sum(p.stat().st_size for p in logs.root.iterdir())
        assert size <= 4096 + sum(len(e.to_json()) + 1 for e in batch)
    kept = list(logs.entries("sbx-1"))
    assert kept == written[len(written) - len(kept):]
    assert list(logs.entries_backward("sbx-1")) == kept[::-1]
    floor = LEVELS.index(level) if level else 0
    want = [e for e in (kept if forward else kept[::-1])
            if LEVELS.index(e.level) >= floor and (search is None or search in e.message)
            and (e.timestamp_ms >= since if forward else e.timestamp_ms <= since)]
    assert logs.query("sbx-1", since_ms=since, limit=limit, forward=forward, min_level=level,
                      search=search) == want[:limit]


def test_a_backward_query_reads_only_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The newest 10 entries of a large log come from its last block, not from reading it all."""
    logs = SandboxLogs(tmp_path, max_bytes=64 << 20)
    for i in range(2000):
        logs._append("sbx-1", [LogEntry(i, "info", f"line {i} " + "x" * 1000)])
    read: list[int] = []
    real = sandbox_logs._lines_backward

    def counting(path: Path):  # type: ignore[no-untyped-def]
        for line in real(path):
            read.append(len(line))
            yield line
    monkeypatch.setattr(sandbox_logs, "_lines_backward", counting)
    got = logs.query("sbx-1", limit=10, forward=False)
    assert [e.timestamp_ms for e in got] == list(range(1999, 1989, -1)) and len(read) == 10
    forward = list(itertools.islice(logs.entries("sbx-1"), 3))
    assert [e.timestamp_ms for e in forward] == [0, 1, 2]


def test_removal_and_restart_drop_both_files(tmp_path: Path) -> None:
    logs = SandboxLogs(tmp_path, max_bytes=2048)
    for sid in ("sbx-a", "sbx-b"):
        for i in range(50):
            logs.event(sid, f"event {i}" + "y" * 100)
    assert (tmp_path / "sbx-a.jsonl.1").exists() and (tmp_path / "sbx-b.jsonl.1").exists()
    logs.keep_only({"sbx-b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sbx-b.jsonl", "sbx-b.jsonl.1"]
    logs.remove("sbx-b")
    assert list(tmp_path.iterdir()) == []
