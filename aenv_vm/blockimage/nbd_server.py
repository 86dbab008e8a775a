"""asyncio NBD server on a Unix socket: several named exports, requests of one
connection processed concurrently (replies pipelined, handles echoed).

The protocol lives in nbd_protocol.py; this module only moves bytes and runs
export operations. Reads whose data is already in memory are answered on the
event loop (``read_nowait``); everything that may block (chunk fetches, file
I/O, fsync) runs on a thread pool so one slow export never stalls the others.
A protocol error closes that client only.

Besides the node-wide socket, an export may have a socket of its own
(``listen``) that offers that one export and nothing else: a confined QEMU
gets only its own disk's socket in its jail, owned by its uid, and cannot even
name the other sandboxes' exports.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Protocol, TypeVar

from .nbd_protocol import (EINVAL, EIO, ENOSPC, EPERM, NEED_DATA, Closed, Cmd, ExportDirectory, ExportInfo,
                           ExportSelected, NbdServerConnection, Request)

log = logging.getLogger(__name__)

BATCH_REPLY_MAX = 64 * 1024   # read replies up to this size are coalesced per event-loop pass
# Bytes of requests a connection may have in the worker threads at once (each up to the
# export's max_block, 32 MiB): beyond, the connection stops reading until half of them
# are answered. 64 requests of 32 MiB would otherwise be 2 GiB of node memory that
# one guest's disk reads (or an escaped QEMU) can ask for.
MAX_INFLIGHT_BYTES = 32 << 20


class BlockExport(Protocol):
    """What the server needs from an export (BlockImage implements it)."""

    @property
    def info(self) -> ExportInfo: ...

    def read_nowait(self, offset: int, length: int) -> bytes | None:
        """The data if it can be produced without blocking, else None."""

    def read(self, offset: int, length: int) -> bytes: ...

    def write(self, offset: int, data: bytes, fua: bool = False) -> None: ...

    def write_zeroes(self, offset: int, length: int, fua: bool = False) -> None: ...

    def trim(self, offset: int, length: int) -> None: ...

    def flush(self) -> None: ...


class MemoryExport:
    """A bytearray-backed export: the reference peer for protocol tests."""

    def __init__(self, name: str, data: bytes | bytearray, read_only: bool = False) -> None:
        self._data = bytearray(data)
        self._info = ExportInfo(name=name, size=len(self._data), read_only=read_only, can_multi_conn=True)
        self.flushes = 0

    @property
    def info(self) -> ExportInfo:
        return self._info

    @property
    def data(self) -> bytes:
        return bytes(self._data)

    def read_nowait(self, offset: int, length: int) -> bytes | None:
        return bytes(self._data[offset:offset + length])

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._data[offset:offset + length])

    def write(self, offset: int, data: bytes, fua: bool = False) -> None:
        self._data[offset:offset + len(data)] = data

    def write_zeroes(self, offset: int, length: int, fua: bool = False) -> None:
        self._data[offset:offset + length] = bytes(length)

    def trim(self, offset: int, length: int) -> None:
        self.write_zeroes(offset, length)

    def flush(self) -> None:
        self.flushes += 1


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, PermissionError):
        return EPERM
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return ENOSPC
    if isinstance(exc, ValueError):
        return EINVAL
    return EIO


class _Connection(asyncio.Protocol):
    def __init__(self, server: "NbdServer", only: str | None = None) -> None:
        self._server = server
        if only is None:
            directory = ExportDirectory(server._lookup_info, server.export_names)
        else:   # an export's own socket: the handshake finds that export alone
            directory = ExportDirectory(lambda name: server._lookup_info(name) if name == only else None,
                                        lambda: [only] if only in server._exports else [])
        self._proto = NbdServerConnection(directory)
        self._transport: asyncio.Transport | None = None
        self._export: BlockExport | None = None
        self._inflight = 0
        self._inflight_bytes = 0      # of READ/WRITE requests in the worker threads
        self._paused = False          # reading paused: too many requests (or bytes) in flight
        self._write_paused = False    # the transport's send buffer is above its high-water mark
        self._closing = False
        self._batch: list[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        # room for a few large read replies before pause_writing kicks in
        transport.set_write_buffer_limits(high=4 << 20, low=1 << 20)
        self._server._connections.add(self)
        transport.write(self._proto.data_to_send())

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._server._connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self._proto.receive_data(data)
        self._pump()

    # Flow control: while the client does not drain our replies, stop taking
    # requests (they stay parsed-later in the protocol buffer) instead of
    # growing the transport's send buffer without bound.
    def pause_writing(self) -> None:
        self._write_paused = True
        if self._transport is not None and not self._paused:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._paused and not self._closing:
            self._transport.resume_reading()
            self._pump()

    def _pump(self) -> None:
        # Small replies produced while handling one batch of requests go out in
        # one write (one send syscall) instead of two writes per request.
        self._batch = []
        try:
            self._pump_requests()
        finally:
            batch, self._batch = self._batch, None
            if batch and not self._closing and self._transport is not None:
                self._transport.write(b"".join(batch))

    def _pump_requests(self) -> None:
        t = self._transport
        assert t is not None
        while not self._closing and not self._write_paused:
            ev = self._proto.next_event()
            out = self._proto.data_to_send()
            if out:
                t.write(out)
            if ev is NEED_DATA:
                return
            if isinstance(ev, Closed):
                if ev.error:
                    log.info("nbd: closing client: %s", ev.error)
                self._close()
                return
            if isinstance(ev, ExportSelected):
                self._export = self._server._exports.get(ev.export.name)
                if self._export is None:     # removed between lookup and selection
                    self._close()
                    return
                continue
            assert isinstance(ev, Request)
            self._dispatch(ev)
            if (self._inflight >= self._server.max_inflight
                    or self._inflight_bytes >= self._server.max_inflight_bytes) and not self._paused:
                # Bounded memory: stop reading until replies drain.
                self._paused = True
                t.pause_reading()
                return

    def _close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def _send(self, handle: int, err: int, data: bytes = b"") -> None:
        if self._closing or self._transport is None:
            return
        header = self._proto.reply_header(handle, err)
        if err:
            data = b""
        if self._batch is not None and len(data) <= BATCH_REPLY_MAX:
            self._batch.append(header)
            if data:
                self._batch.append(data)
            return
        # header and payload as two writes: no 1 MiB concatenation per read reply
        self._transport.write(header)
        if data:
            self._transport.write(data)

    def _dispatch(self, req: Request) -> None:
        export = self._export
        assert export is not None
        if req.cmd == Cmd.READ:
            try:
                data = export.read_nowait(req.offset, req.length)
            except Exception as e:   # noqa: BLE001 - any failure becomes an NBD error for this request
                log.warning("nbd: read %s@%d failed: %s", req.length, req.offset, e)
                self._send(req.handle, _errno_of(e))
                return
            if data is not None:
                self._send(req.handle, 0, data)
                return
        self._inflight += 1
        self._inflight_bytes += _bytes_of(req)
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._server.executor, _run, export, req)
        fut.add_done_callback(lambda f, r=req: self._done(r, f))

    def _done(self, req: Request, fut: "asyncio.Future[bytes]") -> None:
        self._inflight -= 1
        self._inflight_bytes -= _bytes_of(req)
        if fut.cancelled():          # server shutting down
            return
        exc = fut.exception()
        if exc is not None:
            log.warning("nbd: %s %d@%d failed: %s", req.cmd.name, req.length, req.offset, exc)
            self._send(req.handle, _errno_of(exc))
        else:
            self._send(req.handle, 0, fut.result())
        if (self._paused and self._inflight < self._server.max_inflight // 2
                and self._inflight_bytes < self._server.max_inflight_bytes // 2 and not self._closing):
            self._paused = False
            assert self._transport is not None
            if not self._write_paused:
                self._transport.resume_reading()
                self._pump()


def _bytes_of(req: Request) -> int:
    """The node memory a request holds while it is worked on: its data (a read's answer,
    a write's payload); other commands carry none."""
    return req.length if req.cmd in (Cmd.READ, Cmd.WRITE) else 0


def _run(export: BlockExport, req: Request) -> bytes:
    if req.cmd == Cmd.READ:
        return export.read(req.offset, req.length)
    if req.cmd == Cmd.WRITE:
        export.write(req.offset, req.data, req.fua)
    elif req.cmd == Cmd.WRITE_ZEROES:
        export.write_zeroes(req.offset, req.length, req.fua)
    elif req.cmd == Cmd.TRIM:
        export.trim(req.offset, req.length)
        if req.fua:
            export.flush()
    elif req.cmd == Cmd.FLUSH:
        export.flush()
    return b""


class NbdServer:
    """Serves named exports on one Unix socket."""

    def __init__(self, socket_path: str | Path, executor: ThreadPoolExecutor | None = None,
                 max_inflight: int = 64, workers: int = 8, max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> None:
        self.socket_path = Path(socket_path)
        self._own_executor = executor is None
        self.executor = executor or ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nbd-io")
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self._exports: dict[str, BlockExport] = {}
        self._connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._own: dict[str, tuple[asyncio.AbstractServer, Path]] = {}   # export -> its own socket

    # exports may be added/removed while serving (from the loop's thread)
    def add_export(self, export: BlockExport) -> None:
        name = export.info.name
        if name in self._exports:
            raise ValueError(f"export {name!r} already served")
        self._exports[name] = export

    def remove_export(self, name: str) -> BlockExport | None:
        own = self._own.pop(name, None)
        if own is not None:
            server, path = own
            server.close()
            path.unlink(missing_ok=True)
        return self._exports.pop(name, None)

    async def listen(self, name: str, path: Path, owner: int | None = None) -> Path:
        """A socket of ``name``'s own at ``path`` (mode 0600, owned by uid ``owner`` if
        given) offering only that export; it goes with ``remove_export``."""
        if name not in self._exports:
            raise ValueError(f"export {name!r} is not served")
        old = self._own.pop(name, None)
        if old is not None:
            old[0].close()
        path.unlink(missing_ok=True)
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(lambda: _Connection(self, only=name), path=str(path))
        os.chmod(path, 0o600)
        if owner is not None:
            os.chown(path, owner, owner)
        self._own[name] = (server, path)
        return path

    def socket_of(self, name: str) -> Path:
        """Where a client reaches export ``name``: its own socket, else the node-wide one."""
        own = self._own.get(name)
        return own[1] if own is not None else self.socket_path

    def export_names(self) -> list[str]:
        return sorted(self._exports)

    def _lookup_info(self, name: str) -> ExportInfo | None:
        export = self._exports.get(name)
        return export.info if export is not None else None

    async def start(self) -> None:
        if self.socket_path.exists():
            self.socket_path.unlink()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path=str(self.socket_path))
        os.chmod(self.socket_path, 0o600)

    async def close(self) -> None:
        for name in list(self._own):
            server, path = self._own.pop(name)
            server.close()
            path.unlink(missing_ok=True)
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                conn._close()
            await self._server.wait_closed()
            self._server = None
        if self._own_executor:
            self.executor.shutdown(wait=True)
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass

    @property
    def connection_count(self) -> int:
        return len(self._connections)


T = TypeVar("T")


class BackgroundNbdServer:
    """An NbdServer on its own event-loop thread (CLI `serve`, tests with
    subprocess clients). Use as a context manager."""

    def __init__(self, socket_path: str | Path, exports: list[BlockExport] | tuple[BlockExport, ...] = (),
                 *, max_inflight: int = 64, workers: int = 8) -> None:
        self.server = NbdServer(socket_path, max_inflight=max_inflight, workers=workers)
        for e in exports:
            self.server.add_export(e)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nbd-loop", daemon=True)

    def __enter__(self) -> "BackgroundNbdServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the loop thread (e.g. add_export while serving)."""
        async def _c() -> T:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(_c(), self._loop).result(10)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
