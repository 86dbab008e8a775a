"""A small asyncio NBD client (newstyle fixed, NBD_OPT_GO, simple replies) with
pipelining: used by the benchmark (same client for every server measured) and
by tests that need requests in flight at queue depth > 1."""
from __future__ import annotations

import asyncio
import struct

from .nbd_protocol import (FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, INFO_BLOCK_SIZE, INFO_EXPORT, NBDMAGIC,
                           REP_ACK, REP_INFO, REPLY_MAGIC_OPT, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, Cmd, Opt)


class NbdError(Exception):
    def __init__(self, message: str, errno_: int = 0) -> None:
        super().__init__(message)
        self.errno = errno_


class NbdClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._r = reader
        self._w = writer
        self.size = 0
        self.flags = 0
        self.block_sizes: tuple[int, int, int] | None = None
        self._next = 1
        self._pending: dict[int, tuple[asyncio.Future[bytes], int]] = {}
        self._reader_task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, socket_path: str, export: str) -> "NbdClient":
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=64 * 1024 * 1024)
        c = cls(reader, writer)
        await c._handshake(export)
        c._reader_task = asyncio.create_task(c._read_replies())
        return c

    async def _handshake(self, export: str) -> None:
        magic, opt_magic, _flags = struct.unpack(">QQH", await self._r.readexactly(18))
        if magic != NBDMAGIC or opt_magic != IHAVEOPT:
            raise NbdError("not a newstyle NBD server")
        self._w.write(struct.pack(">I", FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
        name = export.encode()
        payload = struct.pack(">I", len(name)) + name + struct.pack(">HH", 1, INFO_BLOCK_SIZE)
        self._w.write(struct.pack(">QII", IHAVEOPT, Opt.GO, len(payload)) + payload)
        while True:
            rmagic, _opt, rtype, rlen = struct.unpack(">QIII", await self._r.readexactly(20))
            if rmagic != REPLY_MAGIC_OPT:
                raise NbdError("bad option reply magic")
            data = await self._r.readexactly(rlen)
            if rtype == REP_ACK:
                return
            if rtype == REP_INFO:
                (itype,) = struct.unpack_from(">H", data)
                if itype == INFO_EXPORT:
                    self.size, self.flags = struct.unpack_from(">QH", data, 2)
                elif itype == INFO_BLOCK_SIZE:
                    self.block_sizes = struct.unpack_from(">III", data, 2)
            elif rtype & (1 << 31):
                raise NbdError(f"export {export!r} refused: {rtype:#x} {data!r}")

    async def _read_replies(self) -> None:
        try:
            while True:
                magic, err, handle = struct.unpack(">IIQ", await self._r.readexactly(16))
                if magic != SIMPLE_REPLY_MAGIC:
                    raise NbdError(f"bad reply magic {magic:#x}")
                fut, rlen = self._pending.pop(handle)
                if err:
                    fut.set_exception(NbdError(f"NBD error {err}", err))
                    continue
                fut.set_result(await self._r.readexactly(rlen) if rlen else b"")
        except (asyncio.IncompleteReadError, ConnectionError, NbdError) as e:
            for fut, _ in self._pending.values():
                if not fut.done():
                    fut.set_exception(NbdError(f"connection lost: {e}"))
            self._pending.clear()

    def _submit(self, cmd: Cmd, offset: int, length: int, data: bytes = b"", flags: int = 0,
                reply_len: int = 0) -> "asyncio.Future[bytes]":
        handle = self._next
        self._next += 1
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[handle] = (fut, reply_len)
        self._w.write(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, handle, offset, length) + data)
        return fut

    async def read(self, offset: int, length: int) -> bytes:
        return await self._submit(Cmd.READ, offset, length, reply_len=length)

    async def write(self, offset: int, data: bytes, fua: bool = False) -> None:
        await self._submit(Cmd.WRITE, offset, len(data), data, flags=1 if fua else 0)

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self._submit(Cmd.WRITE_ZEROES, offset, length)

    async def trim(self, offset: int, length: int) -> None:
        await self._submit(Cmd.TRIM, offset, length)

    async def flush(self) -> None:
        await self._submit(Cmd.FLUSH, 0, 0)

    async def close(self) -> None:
        try:
            self._w.write(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, Cmd.DISC, 0, 0, 0))
            await self._w.drain()
        except ConnectionError:
            pass
        self._w.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except asyncio.CancelledError:
                pass
