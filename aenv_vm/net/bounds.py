"""What one sandbox may ask of the node's DNS forwarder and egress proxy (issue 28).

A guest is hostile or merely broken: it may send DNS datagrams as fast as its vCPU
allows and open connections to the egress proxy without end. Per sandbox:

* DNS: a token bucket (``dns_rate`` queries a second, ``dns_burst`` at once) and at
  most ``dns_queue`` queries outstanding (sent upstream, not answered yet); a query
  beyond either is dropped as a lost datagram would be (the guest's resolver retries);
* TCP (egress proxy and DNS over TCP together): at most ``connections`` open; one
  more is closed at once;
* each relayed connection holds about ``buffer`` bytes per direction in the node
  (a read buffer that pauses its socket at ``buffer``, a write buffer that makes the
  relay wait at half of it), so one sandbox holds at most about
  ``connections`` × 2 × 2 × ``buffer`` (8 MiB by default).

What was dropped is counted (``Drops``, the node's ``aenv_guest_dropped_total``). Pure:
the bucket takes the time it is given (hypothesis-tested)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from aenv_store.errors import ConfigError


@dataclass(frozen=True)
class EgressLimits:
    """Per-sandbox bounds of the node's egress services ([vm] dns_*, egress_*; docs/config.md)."""
    dns_rate: float = 200.0         # queries a second, sustained
    dns_burst: int = 400            # queries at once after a quiet spell
    dns_queue: int = 64             # queries outstanding upstream
    connections: int = 64           # proxy + DNS-over-TCP connections open
    buffer: int = 32 << 10          # bytes held per direction of a relayed connection (about)

    def __post_init__(self) -> None:
        if not 0 < self.dns_rate <= 1_000_000 or not 1 <= self.dns_burst <= 1_000_000:
            raise ConfigError("vm.dns_rate must be in (0, 1000000] and vm.dns_burst in 1..1000000")
        if not 1 <= self.dns_queue <= 100_000 or not 1 <= self.connections <= 100_000:
            raise ConfigError("vm.dns_queue and vm.egress_connections must be in 1..100000")
        if not 4 << 10 <= self.buffer <= 16 << 20:
            raise ConfigError("vm.egress_buffer_kib must be in 4..16384")


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; ``take(now)`` spends one if there is one."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass
class Drops:
    """What the node's egress services turned away, all sandboxes (counters)."""
    dns_rate: int = 0               # over the sandbox's query rate
    dns_queue: int = 0              # over its outstanding queries
    connections: int = 0            # over its open connections
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, what: str) -> None:
        with self._lock:        # incremented on the guest loop, read by /metrics on another
            setattr(self, what, getattr(self, what) + 1)

    def samples(self) -> list[tuple[tuple[tuple[str, str], ...], float]]:
        with self._lock:
            return [((("service", "dns"), ("reason", "rate")), float(self.dns_rate)),
                    ((("service", "dns"), ("reason", "queue")), float(self.dns_queue)),
                    ((("service", "egress"), ("reason", "connections")), float(self.connections))]
