"""Per-client limits of what the gateway does for requests no credential vouches for
(a signed URL no sandbox is known for, an API key no team has): a token bucket per
client address, a bounded number of addresses kept."""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

MAX_CLIENTS = 10_000        # client addresses whose buckets are kept (the least recent go)


class ClientBuckets:
    """``rate`` tokens a second per client address, at most ``burst`` saved up."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def wait(self, client: str) -> float:
        """The seconds until ``client`` has a token (0: now), taking none."""
        now = self.clock()
        tokens, stamp = self.buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - stamp) * self.rate)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate

    def take(self, client: str) -> float:
        """0 if ``client`` may go on now (a token is taken), else the seconds until it may."""
        now = self.clock()
        tokens, stamp = self.buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - stamp) * self.rate)
        wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
        self.buckets[client] = (tokens - 1 if tokens >= 1 else tokens, now)
        self.buckets.move_to_end(client)
        while len(self.buckets) > MAX_CLIENTS:
            self.buckets.popitem(last=False)
        return wait
