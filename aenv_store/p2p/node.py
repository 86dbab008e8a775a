"""One iroh endpoint per node: serves committed chunks to peers and asks peers
for chunks, on ALPN ``aenv/chunks/1`` (protocol.py).

The endpoint is bound to ``[p2p] host`` (loopback unless set: a single node's
endpoint leaves nothing reachable from elsewhere) with relays and discovery off
(the minimal preset): peers are reached by the direct addresses in their
tickets, which come from the config, ``aenv p2p add-peer`` or, in a fleet, the
node agent (``sync_peers``, from the tickets live nodes publish in Redis). All iroh calls run on a private asyncio loop
thread; the Store's reader threads call the blocking ``fetch``/``fetch_many``.

Serving is for peers only: a connection from a node id that is not in the peer
table as a member (the configured ``[p2p] peers``, ``aenv p2p add-peer``, the
fleet's published tickets) is closed before any request is read, so a stranger
gets neither chunks nor ``HAVE`` answers (which would tell it which memory
pages this node committed). The node id is the QUIC handshake's authenticated
key, whichever socket the stranger reached (iroh also listens on an
unadvertised IPv6 wildcard socket). Peering is therefore mutual: both sides list
each other (a fleet's nodes all do, from Redis).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Coroutine, Protocol, TypeVar

import iroh

from ..config import P2PConfig
from ..errors import ConfigError
from ..formats.ids import Digest
from . import _iroh_fast, peers as peerfile
from .peers import Peer, PeerTable
from .protocol import (ALPN, MAX_IDS, BadData, Frame, GetResponseParser, Op, ProtocolError, Status,
                       decode_have, decode_request, encode_frame_head, encode_have, encode_request, request_size)

log = logging.getLogger(__name__)

T = TypeVar("T")

READ_SIZE = 1 << 20          # bytes asked of one RecvStream.read
WRITE_BATCH = 1 << 20        # frames gathered before one write_all
SERVE_WINDOW = 4             # chunk-read groups in flight while answering one GET
SERVE_GROUP = 8              # chunks read per thread hop
IDLE_TIMEOUT = 2.0           # a started transfer that stalls this long is abandoned
FIRST_BYTE_TIMEOUT = 5.0     # a peer that said it has a chunk must start sending by then
CONNECT_TIMEOUT = 2.0
STATUS_INTERVAL = 1.0
BIND_HOST = "127.0.0.1"      # the default of [p2p] host


def _socket_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _addr_host(addr: str) -> str:
    """The host part of an iroh direct address ("1.2.3.4:5", "[::1]:5")."""
    return addr.rsplit(":", 1)[0].strip("[]")


class ChunkProvider(Protocol):
    """What a node may serve: committed, verified chunks only."""

    def has(self, cid: Digest) -> bool: ...

    def get(self, cid: Digest) -> bytes | None: ...


async def _cancel(task: "asyncio.Future[Any]") -> None:
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled or already failed: either way unused
        pass


def parse_ticket(ticket: str) -> tuple[Any, str]:
    """(EndpointAddr, node id) of a ticket; ConfigError if it is not one."""
    try:
        addr = iroh.EndpointTicket.from_string(ticket.strip()).endpoint_addr()
    except Exception as e:  # IrohError or ValueError from the bindings
        detail = str(e) or type(e).__name__
        raise ConfigError(f"not an iroh endpoint ticket: {ticket[:40]!r} ({detail})") from None
    return addr, str(addr.id())


@dataclass
class _Conn:
    conn: Any = None
    lock: asyncio.Lock | None = None


class P2PNode:
    def __init__(self, data_dir: Path, config: P2PConfig, provider: ChunkProvider | None = None,
                 write_status: bool = True) -> None:
        _iroh_fast.apply()
        self.data_dir = data_dir
        self.config = config
        self.provider = provider
        self.write_status_file = write_status
        self.table = PeerTable()
        self.lookup_timeout = config.lookup_timeout_ms / 1000.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aenv-p2p", daemon=True)
        self._endpoint: Any = None
        self._conns: dict[str, _Conn] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._peers_mtime = -1.0
        self._closed = False
        self._lock_fd: int | None = None
        self._serve_pool = ThreadPoolExecutor(SERVE_WINDOW, thread_name_prefix="aenv-p2p-serve")
        self.ticket = ""
        self.node_id = ""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "P2PNode":
        """Bind and serve. ``NodeBusy`` if another process on this data dir runs the node."""
        self._lock_fd = peerfile.take_node_lock(self.data_dir)
        self._thread.start()
        self._run(self._bind(), timeout=30)
        for t in self.config.peers:
            self._add_quietly(t, "config")
        self._sync_added_peers()
        self._spawn(self._accept_loop())
        if self.write_status_file:
            self._spawn(self._status_loop())
        log.info("p2p node %s listening on %s", self.node_id[:12], self._endpoint.addr().direct_addresses())
        return self

    async def _bind(self) -> None:
        host = self.config.bind_host()
        opts = iroh.EndpointOptions(preset=iroh.preset_minimal(), relay_mode=iroh.RelayMode.disabled(),
                                    bind_addr=_socket_addr(host, self.config.port), alpns=[ALPN],
                                    secret_key=peerfile.load_secret(self.data_dir))
        self._endpoint = await iroh.Endpoint.bind(opts)
        addr = self._endpoint.addr()
        # Only the bound address goes into the ticket (the endpoint also opens an
        # IPv6 wildcard socket it does not advertise here).
        addr = iroh.EndpointAddr(addr.id(), None, [a for a in addr.direct_addresses() if _addr_host(a) == host])
        self.ticket = str(iroh.EndpointTicket.from_addr(addr))
        self.node_id = str(addr.id())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            try:
                self._run(self._shutdown(), timeout=10)
            except Exception as e:  # noqa: BLE001 - closing must not fail the caller
                log.debug("p2p shutdown: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._serve_pool.shutdown(wait=False, cancel_futures=True)
        if self.write_status_file and self.ticket:
            st = self.status()
            st["closed"] = True
            peerfile.write_status(self.data_dir, st)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for c in self._conns.values():
            if c.conn is not None:
                try:
                    c.conn.close(0, b"bye")
                except Exception:  # noqa: BLE001
                    pass
        self._conns.clear()
        if self._endpoint is not None:
            await self._endpoint.close()
            # the UDP socket is released only when the last handle to the endpoint goes
            self._endpoint = None

    def __enter__(self) -> "P2PNode":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()
            raise

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        def create() -> None:
            task = self._loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._loop.call_soon_threadsafe(create)

    # ---------------------------------------------------------------------- peers
    def add_peer(self, ticket: str, source: str = "added") -> Peer:
        _, node_id = parse_ticket(ticket)
        if node_id == self.node_id:
            raise ConfigError("that ticket is this node's own")
        peer = self.table.add(ticket.strip(), node_id, source)
        return peer

    def _add_quietly(self, ticket: str, source: str) -> None:
        try:
            self.add_peer(ticket, source)
        except ConfigError as e:
            log.warning("ignoring p2p peer: %s", e)

    def _sync_added_peers(self) -> None:
        """Pick up tickets `aenv p2p add-peer` wrote since we last looked."""
        m = peerfile.peers_mtime(self.data_dir)
        if m == self._peers_mtime:
            return
        self._peers_mtime = m
        for t in peerfile.read_added_peers(self.data_dir):
            self._add_quietly(t, "added")

    def sync_peers(self, tickets: dict[str, str], source: str = "fleet") -> tuple[list[str], list[str]]:
        """Make the peers from ``source`` exactly ``tickets`` (a name -> ticket, e.g.
        fleet node id -> its published ticket): new ones are added (or revived), ones
        no longer there are dropped. Peers from other sources are left alone. Returns
        the (added, dropped) node ids. A bad or own ticket is skipped with a log line."""
        want: dict[str, str] = {}
        for name, ticket in tickets.items():
            try:
                _, node_id = parse_ticket(ticket)
            except ConfigError as e:
                log.warning("p2p: ignoring the ticket of %s: %s", name, e)
                continue
            if node_id != self.node_id:
                want[node_id] = ticket.strip()
        added: list[str] = []
        gone: list[Peer] = []
        with self.table.lock:
            for node_id, ticket in want.items():
                p = self.table.peers.get(node_id)
                if p is None:
                    self.table.peers[node_id] = Peer(ticket, node_id, source)
                    added.append(node_id)
                elif p.source == source and (p.dropped or p.ticket != ticket or not p.member):
                    # back in the fleet (perhaps on a new port): ask it again, afresh
                    p.dropped, p.ticket, p.backoff, p.backoff_until = "", ticket, 0.0, 0.0
                    p.member = True
                    added.append(node_id)
            for p in self.table.peers.values():
                if p.source == source and not p.dropped and p.node_id not in want:
                    gone.append(p)
        for p in gone:
            with self.table.lock:
                p.member = False      # out of the fleet: no longer served either
            self.drop_peer(p, f"no longer published ({source})")
        for node_id in added:
            # a connection to an old address of a peer that moved must not be reused
            c = self._conns.pop(node_id, None)
            if c is not None and c.conn is not None:
                self._loop.call_soon_threadsafe(c.conn.close, 0, b"moved")
        if added:
            log.info("p2p: %d peer(s) from %s: %s", len(added), source, ", ".join(n[:12] for n in added))
        return added, [p.node_id for p in gone]

    def drop_peer(self, peer: Peer, reason: str) -> None:
        with self.table.lock:
            peer.dropped = reason
        log.warning("p2p: dropped peer %s: %s", peer.node_id[:12], reason)
        c = self._conns.pop(peer.node_id, None)
        if c is not None and c.conn is not None:
            self._loop.call_soon_threadsafe(c.conn.close, 1, b"bad data")

    def status(self) -> dict[str, Any]:
        snap = self.table.snapshot()
        snap.update({"node_id": self.node_id, "ticket": self.ticket, "pid": os.getpid(),
                     "updated": time.time(), "lookup_timeout_ms": self.config.lookup_timeout_ms})
        return snap

    async def _status_loop(self) -> None:
        while True:
            try:
                self._sync_added_peers()
                peerfile.write_status(self.data_dir, self.status())
            except Exception as e:  # noqa: BLE001 - status is best effort
                log.debug("p2p status: %s", e)
            await asyncio.sleep(STATUS_INTERVAL)

    # -------------------------------------------------------------------- serving
    async def _accept_loop(self) -> None:
        while True:
            try:
                incoming = await self._endpoint.accept_next()
            except Exception as e:  # noqa: BLE001
                log.debug("p2p accept: %s", e)
                return
            if incoming is None:
                return
            self._spawn(self._serve_connection(incoming))

    async def _serve_connection(self, incoming: Any) -> None:
        try:
            conn = await (await incoming.accept()).connect()
        except Exception as e:  # noqa: BLE001
            log.debug("p2p handshake failed: %s", e)
            return
        if conn.alpn() != ALPN:
            conn.close(2, b"unknown alpn")
            return
        remote = str(conn.remote_id())
        while True:
            if not self._admits(remote):    # checked per request too: a peer may leave the fleet
                conn.close(3, b"not a peer of this node")
                return
            try:
                bi = await conn.accept_bi()
            except Exception:  # connection closed
                return
            if not self._admits(remote):
                conn.close(3, b"not a peer of this node")
                return
            self._spawn(self._serve_stream(bi, remote))

    def _admits(self, remote: str) -> bool:
        """Whether ``remote`` (an authenticated node id) may be served; a stranger is
        counted and logged once. The added-peers file is looked at again first, so a
        peer added by ``aenv p2p add-peer`` a moment ago is not refused."""
        if self.table.is_member(remote):
            return True
        self._sync_added_peers()
        if self.table.is_member(remote):
            return True
        if self.table.note_refused(remote):
            log.warning("p2p: refused node %s: not a peer of this node (neither configured, added nor in the "
                        "fleet)", remote[:12])
        return False

    async def _serve_stream(self, bi: Any, remote: str) -> None:
        send = bi.send()
        try:
            req = decode_request(await bi.recv().read_to_end(request_size(MAX_IDS)))
        except (ProtocolError, Exception) as e:  # noqa: BLE001 - a bad request only costs its stream
            log.info("p2p: bad request from %s: %s", remote[:12], e)
            try:
                await send.reset(1)
            except Exception:  # noqa: BLE001
                pass
            return
        served = self.table.served_to(remote)
        with self.table.lock:
            served.requests += 1
        loop = asyncio.get_running_loop()
        provider = self.provider
        try:
            if req.op == Op.HAVE:
                flags = [False] * len(req.ids) if provider is None else \
                    await loop.run_in_executor(None, lambda: [provider.has(c) for c in req.ids])
                await send.write_all(encode_have(flags))
            else:
                await self._serve_get(send, req.ids, served)
            await send.finish()
        except Exception as e:  # noqa: BLE001 - the peer went away
            log.debug("p2p: serving %s failed: %s", remote[:12], e)

    async def _serve_get(self, send: Any, ids: tuple[Digest, ...], served: Any) -> None:
        """Answer a GET in request order. Chunk reads run on the serve pool in groups
        (one thread hop per group, not per chunk), SERVE_WINDOW groups in flight (a
        chunk may come from the repository: a range read each). Frames are gathered
        into ~1 MiB writes, but whatever is ready goes out before we wait on a slow
        read, and the first group is a single chunk, so the first frame is quick."""
        loop = asyncio.get_running_loop()
        provider = self.provider

        def read_group(group: tuple[Digest, ...]) -> list[bytes | None]:
            return [None if provider is None else provider.get(c) for c in group]

        groups = [ids[:1]] + [ids[i:i + SERVE_GROUP] for i in range(1, len(ids), SERVE_GROUP)]
        pending: deque[asyncio.Future[list[bytes | None]]] = deque()
        todo = iter(groups)

        def refill() -> None:
            for group in todo:
                pending.append(loop.run_in_executor(self._serve_pool, read_group, group))
                if len(pending) >= SERVE_WINDOW:
                    return

        refill()
        try:
            await self._send_groups(send, pending, refill, served)
        finally:
            # the asker went away (or we are closing): do not read what nobody will get
            for fut in pending:
                fut.cancel()

    async def _send_groups(self, send: Any, pending: "deque[asyncio.Future[list[bytes | None]]]",
                           refill: Any, served: Any) -> None:
        batch = bytearray()
        while pending:
            fut = pending.popleft()
            if batch and not fut.done():
                await send.write_all(bytes(batch))
                batch.clear()
            datas = await fut
            refill()
            ok = sum(1 for d in datas if d is not None)
            nbytes = 0
            for data in datas:
                if data is None:
                    batch += encode_frame_head(Status.MISSING, 0)
                else:
                    batch += encode_frame_head(Status.OK, len(data))
                    batch += data
                    nbytes += len(data)
            with self.table.lock:
                served.misses += len(datas) - ok
                served.chunks_out += ok
                served.bytes_out += nbytes
            if len(batch) >= WRITE_BATCH:
                await send.write_all(bytes(batch))
                batch.clear()
        if batch:
            await send.write_all(bytes(batch))

    # ------------------------------------------------------------------- fetching
    async def _connection(self, peer: Peer, timeout: float) -> Any:
        c = self._conns.get(peer.node_id)
        if c is None:
            c = self._conns[peer.node_id] = _Conn(lock=asyncio.Lock())
        assert c.lock is not None
        async with c.lock:
            if c.conn is not None and c.conn.close_reason() is None:
                return c.conn
            addr, _ = parse_ticket(peer.ticket)
            c.conn = await asyncio.wait_for(self._endpoint.connect(addr, ALPN), timeout)
            return c.conn

    async def _request(self, peer: Peer, op: Op, cids: list[Digest], first_byte_deadline: float) -> Any:
        """Send one request to one peer; returns the stream its answer comes on."""
        loop = asyncio.get_running_loop()
        conn = await self._connection(peer, max(0.01, min(CONNECT_TIMEOUT, first_byte_deadline - loop.time())))
        bi = await conn.open_bi()
        send = bi.send()
        await send.write_all(encode_request(op, cids))
        await send.finish()
        recv = bi.recv()
        with self.table.lock:
            peer.counters.requests += 1
        return recv

    async def _have(self, peer: Peer, cids: list[Digest], first_byte_deadline: float) -> list[bool]:
        """Ask one peer which of ``cids`` it holds; the answer must come by ``first_byte_deadline``."""
        loop = asyncio.get_running_loop()
        recv = await self._request(peer, Op.HAVE, cids, first_byte_deadline)
        data = await asyncio.wait_for(recv.read_to_end((len(cids) + 7) // 8),
                                      max(0.001, first_byte_deadline - loop.time()))
        return decode_have(data, len(cids))

    async def _get(self, peer: Peer, cids: list[Digest], first_byte_deadline: float) -> list[Frame]:
        """Get ``cids`` from one peer; the first answer byte must come by ``first_byte_deadline``."""
        loop = asyncio.get_running_loop()
        recv = await self._request(peer, Op.GET, cids, first_byte_deadline)
        parser = GetResponseParser(cids)
        frames: list[Frame] = []
        try:
            while not parser.done:
                wait = IDLE_TIMEOUT if parser.started else max(0.001, first_byte_deadline - loop.time())
                data = await asyncio.wait_for(recv.read(READ_SIZE), wait)
                if not data:
                    break
                frames += parser.feed(data)
            parser.finish()
        except BaseException:
            try:
                await recv.stop(1)
            except Exception:  # noqa: BLE001
                pass
            raise
        return frames

    async def _lookup_and_get(self, peer: Peer, cids: list[Digest], lookup_deadline: float) -> list[Frame]:
        """'have?' must be answered by ``lookup_deadline`` (the lookup timeout). The GET
        goes out at the same time, so a yes costs no extra round trip; a peer that said
        yes then gets FIRST_BYTE_TIMEOUT (it may be reading its repository) and
        IDLE_TIMEOUT between reads."""
        loop = asyncio.get_running_loop()
        await self._connection(peer, max(0.01, min(CONNECT_TIMEOUT, lookup_deadline - loop.time())))
        get = asyncio.ensure_future(self._get(peer, cids, loop.time() + FIRST_BYTE_TIMEOUT))
        try:
            have = await self._have(peer, cids, lookup_deadline)
        except BaseException:
            await _cancel(get)
            raise
        if not any(have):
            await _cancel(get)
            return [Frame(c, Status.MISSING) for c in cids]
        return await get

    async def _fetch_async(self, cids: list[Digest]) -> dict[Digest, bytes]:
        loop = asyncio.get_running_loop()
        lookup_deadline = loop.time() + self.lookup_timeout
        want = list(dict.fromkeys(cids))
        got: dict[Digest, bytes] = {}
        for peer in self.table.candidates():
            if not want:
                break
            if loop.time() >= lookup_deadline:
                break
            try:
                frames: list[Frame] = []
                for i in range(0, len(want), MAX_IDS):
                    frames += await self._lookup_and_get(peer, want[i:i + MAX_IDS], lookup_deadline)
            except BadData as e:
                with self.table.lock:
                    peer.counters.bad_data += 1
                self.drop_peer(peer, str(e))
                continue
            except (asyncio.TimeoutError, ProtocolError, Exception) as e:  # noqa: BLE001
                with self.table.lock:
                    peer.note_failure(f"{type(e).__name__}: {e}".rstrip(": "), time.monotonic())
                self._conns.pop(peer.node_id, None)
                log.info("p2p: peer %s failed: %s", peer.node_id[:12], type(e).__name__)
                continue
            ok = 0
            with self.table.lock:
                for f in frames:
                    if f.status == Status.OK:
                        got[f.chunk] = f.data
                        peer.counters.chunks_in += 1
                        peer.counters.bytes_in += len(f.data)
                        ok += 1
                    else:
                        peer.counters.misses += 1
                if ok:
                    peer.note_success()
            want = [c for c in want if c not in got]
        return got

    def fetch_many(self, cids: list[Digest]) -> dict[Digest, bytes]:
        """Chunks peers gave us (verified against their ids); absent ones are missing
        everywhere, timed out, or came from a peer that is now dropped."""
        if self._closed or not cids:
            return {}
        self._sync_added_peers()
        if not self.table.candidates():
            return {}
        try:
            return self._run(self._fetch_async(list(cids)), timeout=self.lookup_timeout + 60 + FIRST_BYTE_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - P2P never fails a read: the repository is the fallback
            log.info("p2p fetch failed: %s", e)
            return {}

    def fetch(self, cid: Digest) -> bytes | None:
        return self.fetch_many([cid]).get(cid)

    def have(self, ticket: str, cids: list[Digest]) -> list[bool]:
        """Ask one peer which of ``cids`` it holds (diagnostics, tests)."""
        _, node_id = parse_ticket(ticket)
        peer = self.table.add(ticket, node_id, "added")

        async def ask() -> list[bool]:
            deadline = asyncio.get_running_loop().time() + max(self.lookup_timeout, 2.0)
            return await self._have(peer, cids, deadline)

        return self._run(ask(), timeout=10)


def offline_ticket(data_dir: Path, port: int, host: str = BIND_HOST) -> str:
    """The ticket a node on ``data_dir`` will have when it listens on ``host:port``
    (needs a fixed ``p2p.port``; with port 0 only a running node knows its ticket)."""
    key = iroh.SecretKey.from_bytes(peerfile.load_secret(data_dir))
    addr = iroh.EndpointAddr(key.public(), None, [_socket_addr(host, port)])
    return str(iroh.EndpointTicket.from_addr(addr))
