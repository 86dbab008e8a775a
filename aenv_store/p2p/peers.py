"""The peer table: who we ask, how it went, and what `aenv p2p status` shows.

Files under ``<data-dir>/p2p/`` (the CLI and a running node share them):
  secret.key   32 bytes, the node's iroh secret key (stable node id across restarts)
  peers.json   tickets added at run time (``aenv p2p add-peer``); running nodes
               pick up changes within a second
  status.json  written by the running node: its ticket, peers and traffic
  node.lock    flock held by the one process that runs this data dir's node
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import durable
from ..errors import StoreError

# After a failure (timeout, refused, reset) a peer is skipped for a while, so a
# dead peer costs one lookup timeout rather than one per chunk.
BACKOFF_MIN = 1.0
BACKOFF_MAX = 60.0


@dataclass
class PeerCounters:
    bytes_in: int = 0        # chunk payload bytes received from this peer
    chunks_in: int = 0
    requests: int = 0        # requests we sent it
    misses: int = 0          # chunks it did not have
    failures: int = 0        # timeouts, connection errors, protocol errors
    bad_data: int = 0        # payloads that did not match their id


@dataclass
class Peer:
    ticket: str
    node_id: str
    source: str                          # "config" | "added" | "fleet" (the node agent, from Redis)
    counters: PeerCounters = field(default_factory=PeerCounters)
    dropped: str = ""                    # why we stopped asking it ("" = active)
    backoff_until: float = 0.0           # monotonic time
    backoff: float = 0.0
    last_error: str = ""
    last_ok: float = 0.0                 # unix time of the last chunk it gave us
    # May ask us for chunks: it is in the configured or added list or the fleet's table.
    # A peer dropped for bad data stays one (we stop asking it, not answering it); one
    # that left the fleet does not.
    member: bool = True

    def usable(self, now: float) -> bool:
        return not self.dropped and now >= self.backoff_until

    def note_failure(self, error: str, now: float) -> None:
        self.counters.failures += 1
        self.last_error = error
        self.backoff = min(BACKOFF_MAX, max(BACKOFF_MIN, self.backoff * 2))
        self.backoff_until = now + self.backoff

    def note_success(self) -> None:
        self.backoff = 0.0
        self.backoff_until = 0.0
        self.last_ok = time.time()


@dataclass
class ServedCounters:
    bytes_out: int = 0
    chunks_out: int = 0
    requests: int = 0
    misses: int = 0


REFUSED_KEPT = 64      # strangers' node ids kept for the status (a total counts them all)


class PeerTable:
    """Thread-safe; the node's event loop and the Store's reader threads share it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.peers: dict[str, Peer] = {}          # node id -> peer
        self.served: dict[str, ServedCounters] = {}  # remote node id -> what we sent it
        self.refused: dict[str, int] = {}         # stranger node id -> connections refused (the first few)
        self.refused_total = 0

    def is_member(self, node_id: str) -> bool:
        """Whether ``node_id`` may ask this node for chunks (``Peer.member``)."""
        with self.lock:
            p = self.peers.get(node_id)
            return p is not None and p.member

    def note_refused(self, node_id: str) -> bool:
        """Count a refused connection of a stranger; True the first time for ``node_id``
        (among those kept), to log it once."""
        with self.lock:
            self.refused_total += 1
            if node_id in self.refused:
                self.refused[node_id] += 1
                return False
            if len(self.refused) < REFUSED_KEPT:
                self.refused[node_id] = 1
            return True

    def add(self, ticket: str, node_id: str, source: str) -> Peer:
        with self.lock:
            p = self.peers.get(node_id)
            if p is None:
                p = self.peers[node_id] = Peer(ticket, node_id, source)
            elif p.dropped and source == "added":
                # an operator re-adding a dropped peer gives it another chance
                p.dropped = ""
                p.ticket = ticket
            if source in ("added", "config"):
                p.member = True
            return p

    def candidates(self) -> list[Peer]:
        """Usable peers, the one that answered most recently first."""
        now = time.monotonic()
        with self.lock:
            ps = [p for p in self.peers.values() if p.usable(now)]
        return sorted(ps, key=lambda p: -p.last_ok)

    def served_to(self, node_id: str) -> ServedCounters:
        with self.lock:
            s = self.served.get(node_id)
            if s is None:
                s = self.served[node_id] = ServedCounters()
            return s

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            peers = []
            for p in self.peers.values():
                d = {"node_id": p.node_id, "ticket": p.ticket, "source": p.source,
                     "state": "dropped" if p.dropped else ("backoff" if now < p.backoff_until else "active"),
                     "dropped_reason": p.dropped, "last_error": p.last_error, **asdict(p.counters)}
                peers.append(d)
            served = {k: asdict(v) for k, v in self.served.items()}
            refused, refused_total = dict(self.refused), self.refused_total
        totals = {
            "bytes_in": sum(p["bytes_in"] for p in peers),
            "bytes_out": sum(s["bytes_out"] for s in served.values()),
            "requests_out": sum(p["requests"] for p in peers),
            "requests_in": sum(s["requests"] for s in served.values()),
            "failures": sum(p["failures"] for p in peers),
            "bad_data": sum(p["bad_data"] for p in peers),
            "refused_in": refused_total,
        }
        return {"peers": peers, "served": served, "refused": refused, "totals": totals}


def p2p_dir(data_dir: Path) -> Path:
    return data_dir / "p2p"


class NodeBusy(StoreError):
    """Another process on this data dir already runs its P2P node."""


def take_node_lock(data_dir: Path) -> int:
    """One P2P node per data dir (one identity, one port, one status file): the
    first process to take this flock is the node; it is released when the
    process closes the node or dies. Returns the lock's file descriptor."""
    d = p2p_dir(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / "node.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise NodeBusy(f"another process on {data_dir} runs its P2P node") from None
    return fd


def load_secret(data_dir: Path) -> bytes:
    """The node's 32-byte secret key, created on first use (mode 0600)."""
    d = p2p_dir(data_dir)
    path = d / "secret.key"
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except FileNotFoundError:
        pass
    d.mkdir(parents=True, exist_ok=True)
    key = os.urandom(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def read_added_peers(data_dir: Path) -> list[str]:
    try:
        raw = json.loads((p2p_dir(data_dir) / "peers.json").read_text())
    except FileNotFoundError:
        return []
    except (json.JSONDecodeError, UnicodeDecodeError):
        return []
    return [t for t in raw.get("peers", []) if isinstance(t, str)]


def add_peer_ticket(data_dir: Path, ticket: str) -> bool:
    """Persist ``ticket`` in peers.json; False if it was already there."""
    d = p2p_dir(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    peers = read_added_peers(data_dir)
    if ticket in peers:
        return False
    peers.append(ticket)
    durable.write_file_durable(d / "peers.json", json.dumps({"peers": peers}, indent=2).encode())
    return True


def peers_mtime(data_dir: Path) -> float:
    try:
        return (p2p_dir(data_dir) / "peers.json").stat().st_mtime
    except FileNotFoundError:
        return 0.0


def write_status(data_dir: Path, status: dict[str, Any]) -> None:
    d = p2p_dir(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".status.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(status, indent=2, sort_keys=True))
    os.replace(tmp, d / "status.json")


def read_status(data_dir: Path) -> dict[str, Any] | None:
    """The last status a node wrote, or None; ``running`` says whether its process lives."""
    try:
        st: dict[str, Any] = json.loads((p2p_dir(data_dir) / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    pid = int(st.get("pid", 0) or 0)
    running = False
    if pid > 0:
        try:
            os.kill(pid, 0)
            running = True
        except ProcessLookupError:
            running = False
        except PermissionError:
            running = True
    st["running"] = running and not st.get("closed", False)
    return st
