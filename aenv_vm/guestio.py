"""The node's event loop for what guests feed it, on a thread of its own.

Every guest-facing service of the node -- each sandbox's DNS forwarder and egress
proxy (aenv_vm/net) and every QEMU's serial console reader (aenv_vm/qemu/console.py)
-- runs here, not on the event loop that serves the API, heartbeats and lifecycle
operations. A guest decides how much work these get (a DNS flood is ~6,000 datagrams a
second from one TCG guest, far more under KVM); on the API's loop each datagram's
callback, task and timer sit in the same ready queue as every API request, so a flood
stretches every loop iteration (measured in issue 28: /health p99 211 ms). Here the
API's loop shares only the GIL with them, which CPython hands over every 5 ms
(``sys.getswitchinterval``), and the per-sandbox bounds (aenv_vm/net/bounds.py) keep
the work itself small. docs/security.md has the measurements.

``guest_loop()`` is the one loop of this process (made on first use, like the
launcher's spawner thread; a forked child makes its own). ``on_guest_loop`` runs a
coroutine there and awaits it from another loop.
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_loop: tuple[int, asyncio.AbstractEventLoop] | None = None
_lock = threading.Lock()


def guest_loop() -> asyncio.AbstractEventLoop:
    """The running guest-facing loop of this process (started here the first time)."""
    global _loop
    with _lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()
            threading.Thread(target=run, name="aenv-guest-io", daemon=True).start()
            started.wait()
            _loop = (os.getpid(), loop)
        return _loop[1]


async def on_guest_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the guest-facing loop and wait for it from the caller's loop (or
    directly, when the caller is that loop)."""
    loop = guest_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

