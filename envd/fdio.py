"""Non-blocking reads and writes of raw file descriptors on the asyncio loop."""

from __future__ import annotations

import asyncio
import os


async def _wait(fd: int, writable: bool) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if writable else loop.add_reader)(fd, ready)
    try:
        await fut
    finally:
        (loop.remove_writer if writable else loop.remove_reader)(fd)


async def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
        except BlockingIOError:
            await _wait(fd, writable=True)


async def wait_readable(fd: int) -> None:
    await _wait(fd, writable=False)
