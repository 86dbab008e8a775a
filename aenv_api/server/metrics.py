"""Prometheus text exposition (format 0.0.4) of the node: ``GET /metrics``.

Counters and histograms are recorded in-process by the HTTP layer and the
lifecycle glue; gauges (sandboxes by state, node cache, store bytes) are read
at scrape time through callbacks. No client library: the format is a few
lines of text and the values are all owned here."""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

# Lifecycle operations take from ~10 ms (pooled create on KVM) to tens of seconds (cold paths under TCG).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


@dataclass
class Metrics:
    counters: dict[tuple[str, Labels], float] = field(default_factory=dict)
    histograms: dict[tuple[str, Labels], Histogram] = field(default_factory=dict)
    help: dict[str, str] = field(default_factory=dict)
    # name -> callback returning (labels, value) samples, evaluated at scrape time
    gauges: dict[str, Callable[[], Iterable[tuple[Labels, float]]]] = field(default_factory=dict)
    # name -> callback returning (labels, value) of a counter kept elsewhere (another thread's)
    counter_sources: dict[str, Callable[[], Iterable[tuple[Labels, float]]]] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def inc(self, name: str, labels: Labels = (), value: float = 1.0, help: str = "") -> None:
        key = (name, labels)
        self.counters[key] = self.counters.get(key, 0.0) + value
        if help:
            self.help.setdefault(name, help)

    def observe(self, name: str, seconds: float, labels: Labels = (), help: str = "") -> None:
        key = (name, labels)
        h = self.histograms.get(key)
        if h is None:
            h = self.histograms[key] = Histogram()
        h.observe(seconds)
        if help:
            self.help.setdefault(name, help)

    def gauge(self, name: str, fn: Callable[[], Iterable[tuple[Labels, float]]], help: str = "") -> None:
        self.gauges[name] = fn
        if help:
            self.help[name] = help

    def counter(self, name: str, fn: Callable[[], Iterable[tuple[Labels, float]]], help: str = "") -> None:
        """A counter whose values ``fn`` reads at scrape time (it only ever grows)."""
        self.counter_sources[name] = fn
        if help:
            self.help[name] = help

    def render(self) -> str:
        lines: list[str] = []

        def head(name: str, kind: str) -> None:
            if name in self.help:
                lines.append(f"# HELP {name} {self.help[name]}")
            lines.append(f"# TYPE {name} {kind}")

        for name in sorted({n for n, _ in self.counters}):
            head(name, "counter")
            for (n, labels), v in sorted(self.counters.items()):
                if n == name:
                    lines.append(f"{name}{_labels(labels)} {_num(v)}")
        for name in sorted({n for n, _ in self.histograms}):
            head(name, "histogram")
            for (n, labels), h in sorted(self.histograms.items(), key=lambda kv: kv[0]):
                if n != name:
                    continue
                acc = 0
                for bound, count in zip(h.buckets + (math.inf,), h.counts):
                    acc += count
                    lines.append(f"{name}_bucket{_labels(labels, (('le', _num(bound)),))} {acc}")
                lines.append(f"{name}_sum{_labels(labels)} {_num(h.total)}")
                lines.append(f"{name}_count{_labels(labels)} {h.n}")
        for kind, sources in (("counter", self.counter_sources), ("gauge", self.gauges)):
            for name, fn in sorted(sources.items()):
                try:
                    samples = list(fn())
                except Exception as e:  # a broken source must not break the scrape
                    lines.append(f"# {name} unavailable: {_escape(str(e))[:200]}")
                    continue
                head(name, kind)
                for labels, v in samples:
                    lines.append(f"{name}{_labels(labels)} {_num(v)}")
        return "\n".join(lines) + "\n"
