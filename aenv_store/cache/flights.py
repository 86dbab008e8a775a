"""Single flight within one process: of the threads of one NodeCache that miss the
same chunk at the same time, the first leads its fetch and the others wait for
it. Batches may overlap in any way without deadlock: a thread takes the lead of
every chunk of its batch nobody leads yet, finishes all of those, and only then
waits for the ones another thread leads (node_cache.NodeCache.get_or_fetch_many
adds the cross-process part around the leading)."""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

from .segments import ChunkData

K = TypeVar("K", bound=bytes)   # a digest


class Flight:
    """One in-process fetch that other threads wait on. The flights of one leader's batch
    share ``done`` (set once, when the leader has finished them all: an Event per chunk
    was a tenth of a cold read's Python time)."""

    __slots__ = ("done", "data", "error")

    def __init__(self, done: threading.Event) -> None:
        self.done = done
        self.data: ChunkData | None = None
        self.error: BaseException | None = None


class Flights(Generic[K]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[K, Flight] = {}

    def run(self, missing: list[K], lead: Callable[[dict[K, Flight]], None], mapped: bool) -> dict[K, ChunkData]:
        """The data of ``missing``: ``lead(flights)`` fills in the ones this thread leads
        (raising fails them for their waiters too); the rest come from their leaders.
        ``mapped`` False: a waiter gets bytes even if its leader got a mapping."""
        leading: dict[K, Flight] = {}
        following: dict[K, Flight] = {}
        done = threading.Event()
        with self._lock:
            for digest in missing:
                flight = self._flights.get(digest)
                if flight is None:
                    leading[digest] = self._flights[digest] = Flight(done)
                else:
                    following[digest] = flight
        try:
            lead(leading)
        except BaseException as e:
            for flight in leading.values():
                if flight.error is None and flight.data is None:
                    flight.error = e
            raise
        finally:
            with self._lock:
                for digest in leading:
                    del self._flights[digest]
            done.set()
        out: dict[K, ChunkData] = {d: f.data for d, f in leading.items() if f.data is not None}
        for digest, flight in following.items():
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.data is not None
            out[digest] = flight.data if mapped or type(flight.data) is bytes else flight.data[:]
        return out
