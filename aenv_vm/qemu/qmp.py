"""QMP, QEMU's JSON control protocol: a sans-IO codec and an asyncio client.

Wire format: each message is one JSON object followed by CRLF; QEMU never puts a
raw newline inside a message (JSON escapes it). The server first sends a greeting
``{"QMP": {"version": ..., "capabilities": [...]}}``; the client must send
``qmp_capabilities`` before any other command. Replies are ``{"return": X,
"id": ...}`` or ``{"error": {"class": C, "desc": D}, "id": ...}``; asynchronous
events are ``{"event": NAME, "data": {...}, "timestamp": {...}}``.

``QmpCodec`` turns bytes into ``QmpMessage`` records and commands into bytes
with no I/O, so every corner of the framing is testable with plain byte
strings; ``QmpClient`` only moves bytes between a Unix socket and the codec.

``QmpClient.execute_with_fd`` sends a command together with a file descriptor
(``SCM_RIGHTS`` on the same socket, as libvirt does): QEMU keeps the fd for the
command that names it (``getfd`` → ``fd:NAME`` migration URIs, ``add-fd`` →
``/dev/fdset/N`` paths). A confined QEMU may neither spawn a process
(``exec:`` URIs) nor open files outside its jail, so files it reads or writes
on the host's behalf reach it this way.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

from ..errors import VmTimeout
from .errors import QmpConnectionError, QmpError, QmpProtocolError

# QEMU's largest replies (query-qmp-schema) are a few hundred KiB; anything far
# beyond that without a newline means the peer is not speaking QMP.
MAX_MESSAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class Greeting:
    version: dict[str, Any]
    capabilities: tuple[str, ...]

    @property
    def qemu_version(self) -> tuple[int, int, int]:
        q = self.version.get("qemu", {})
        return (int(q.get("major", 0)), int(q.get("minor", 0)), int(q.get("micro", 0)))


@dataclass(frozen=True)
class Return:
    id: Any
    value: Any


@dataclass(frozen=True)
class ErrorReply:
    id: Any
    error_class: str
    desc: str


@dataclass(frozen=True)
class Event:
    name: str
    data: dict[str, Any] = field(default_factory=dict)
    timestamp: float = 0.0


QmpMessage = Union[Greeting, Return, ErrorReply, Event]


def parse_message(obj: Any) -> QmpMessage:
    """Classify one decoded JSON value as a QMP message (raises QmpProtocolError)."""
    if not isinstance(obj, dict):
        raise QmpProtocolError(f"QMP message is not a JSON object: {obj!r:.200}")
    if "QMP" in obj:
        qmp = obj["QMP"]
        if not isinstance(qmp, dict):
            raise QmpProtocolError("QMP greeting is not an object")
        caps = qmp.get("capabilities", [])
        version = qmp.get("version", {})
        if not isinstance(caps, list) or not isinstance(version, dict):
            raise QmpProtocolError("QMP greeting has malformed version/capabilities")
        return Greeting(version=version, capabilities=tuple(str(c) for c in caps))
    if "return" in obj:
        return Return(id=obj.get("id"), value=obj["return"])
    if "error" in obj:
        err = obj["error"]
        if not isinstance(err, dict):
            raise QmpProtocolError(f"QMP error reply is not an object: {err!r:.200}")
        return ErrorReply(id=obj.get("id"), error_class=str(err.get("class", "GenericError")),
                          desc=str(err.get("desc", "")))
    if "event" in obj:
        data = obj.get("data", {})
        ts = obj.get("timestamp", {})
        when = 0.0
        if isinstance(ts, dict):
            with contextlib.suppress(TypeError, ValueError):
                when = float(ts.get("seconds", 0)) + float(ts.get("microseconds", 0)) / 1e6
        return Event(name=str(obj["event"]), data=data if isinstance(data, dict) else {}, timestamp=when)
    raise QmpProtocolError(f"unknown QMP message: {obj!r:.200}")


class QmpCodec:
    """Sans-IO QMP framing: ``feed(bytes) -> [messages]``, ``encode(command) -> bytes``."""

    def __init__(self, max_message: int = MAX_MESSAGE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_message
        self._ids = itertools.count(1)

    def feed(self, data: bytes) -> list[QmpMessage]:
        self._buf += data
        out: list[QmpMessage] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self._max:
                    raise QmpProtocolError(f"QMP message longer than {self._max} bytes")
                return out
            line = bytes(self._buf[:nl]).strip()
            del self._buf[:nl + 1]
            if not line:
                continue
            try:
                obj = json.loads(line)
            except (ValueError, UnicodeDecodeError) as e:
                raise QmpProtocolError(f"invalid JSON from QMP: {e}: {line[:200]!r}") from None
            out.append(parse_message(obj))

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)

    def encode(self, command: str, arguments: dict[str, Any] | None = None) -> tuple[int, bytes]:
        """A command with a fresh numeric id: returns ``(id, bytes)``."""
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"execute": command, "id": msg_id}
        if arguments:
            msg["arguments"] = arguments
        return msg_id, json.dumps(msg, separators=(",", ":")).encode() + b"\r\n"


class QmpClient:
    """An asyncio QMP connection over a Unix socket.

    ``await QmpClient.connect(path)`` reads the greeting and negotiates
    capabilities; ``execute`` sends a command and returns its ``return`` value;
    events are queued (bounded) for ``wait_event``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_events: int = 1000) -> None:
        self._reader = reader
        self._writer = writer
        self._codec = QmpCodec()
        self._pending: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        self._events: deque[Event] = deque(maxlen=max_events)
        self._event_cond = asyncio.Condition()
        self._greeting: asyncio.Future[Greeting] = asyncio.get_running_loop().create_future()
        self._closed: BaseException | None = None
        self._task = asyncio.create_task(self._read_loop())
        self.greeting: Greeting | None = None

    @classmethod
    async def connect(cls, path: str | Path, timeout: float = 10.0,
                      alive: Callable[[], bool] | None = None) -> "QmpClient":
        """Connect to QEMU's QMP socket, retrying while QEMU creates it.

        ``alive`` (e.g. "the QEMU process has not exited") stops the retries early."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() >= deadline or (alive is not None and not alive()):
                    raise QmpConnectionError(f"cannot connect to QMP socket {path}: {e}") from None
                await asyncio.sleep(0.005)
        client = cls(reader, writer)
        try:
            remaining = max(0.1, deadline - time.monotonic())
            client.greeting = await asyncio.wait_for(asyncio.shield(client._greeting), remaining)
            await asyncio.wait_for(client.execute("qmp_capabilities"), max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            await client.close()
            raise QmpConnectionError(f"no QMP greeting on {path} within {timeout} s") from None
        except BaseException:
            await client.close()
            raise
        return client

    async def _read_loop(self) -> None:
        error: BaseException = QmpConnectionError("QMP connection closed by QEMU")
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    break
                for msg in self._codec.feed(data):
                    await self._dispatch(msg)
        except QmpProtocolError as e:
            error = e
        except (ConnectionError, OSError) as e:
            error = QmpConnectionError(f"QMP connection lost: {e}")
        except asyncio.CancelledError:
            error = QmpConnectionError("QMP connection closed")
        self._fail_all(error)

    async def _dispatch(self, msg: QmpMessage) -> None:
        if isinstance(msg, Greeting):
            if not self._greeting.done():
                self._greeting.set_result(msg)
        elif isinstance(msg, Event):
            async with self._event_cond:
                self._events.append(msg)
                self._event_cond.notify_all()
        else:
            entry = self._pending.pop(msg.id, None) if isinstance(msg.id, int) else None
            if entry is None:
                return  # a reply nobody waits for (its caller timed out): drop it
            command, fut = entry
            if fut.done():
                return
            if isinstance(msg, Return):
                fut.set_result(msg.value)
            else:
                fut.set_exception(QmpError(command, msg.error_class, msg.desc))

    def _fail_all(self, error: BaseException) -> None:
        self._closed = error
        if not self._greeting.done():
            self._greeting.set_exception(error)
            self._greeting.exception()  # mark retrieved: connect() may not be waiting
        for _command, fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        # Wake event waiters so they see the closed connection.
        async def _wake() -> None:
            async with self._event_cond:
                self._event_cond.notify_all()
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(_wake())

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float | None = 30.0) -> Any:
        return await self._call(command, arguments, timeout, None)

    async def execute_with_fd(self, command: str, arguments: dict[str, Any] | None, fd: int,
                              timeout: float | None = 30.0) -> Any:
        """``execute`` with ``fd`` passed along (SCM_RIGHTS); QEMU gets its own copy
        (the caller still owns ``fd``)."""
        return await self._call(command, arguments, timeout, fd)

    async def _call(self, command: str, arguments: dict[str, Any] | None, timeout: float | None,
                    fd: int | None) -> Any:
        if self._closed is not None:
            raise QmpConnectionError(f"QMP {command}: connection is closed ({self._closed})")
        msg_id, data = self._codec.encode(command, arguments)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = (command, fut)
        try:
            if fd is None:
                self._writer.write(data)
                await self._writer.drain()
            else:
                await self._send_with_fd(data, fd, timeout)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise VmTimeout(f"QMP {command}: no reply within {timeout} s") from None
        except (ConnectionError, OSError) as e:
            raise QmpConnectionError(f"QMP {command}: {e}") from None
        finally:
            self._pending.pop(msg_id, None)

    async def _send_with_fd(self, data: bytes, fd: int, timeout: float | None) -> None:
        # The stream writer cannot carry ancillary data: the bytes go out through a
        # duplicate of its socket, once the writer's own buffer is empty (commands
        # never interleave: everything runs on the event loop's thread).
        transport = self._writer.transport
        deadline = None if timeout is None else time.monotonic() + timeout
        while transport.get_write_buffer_size() > 0:
            await self._writer.drain()
            await asyncio.sleep(0)
        raw = transport.get_extra_info("socket")
        if raw is None:
            raise QmpConnectionError("QMP transport has no socket to pass a file descriptor on")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(raw.fileno())) as sock:
            sent = 0
            while sent == 0:
                try:
                    sent = socket.send_fds(sock, [data], [fd])
                except BlockingIOError:   # QEMU is not reading: its socket buffer is full
                    if deadline is not None and time.monotonic() > deadline:
                        raise VmTimeout("QMP: QEMU does not read its socket") from None
                    await asyncio.sleep(0.001)
        if sent < len(data):   # the fd went with the first bytes; the rest is plain data
            self._writer.write(data[sent:])
            await self._writer.drain()

    def events(self) -> list[Event]:
        """Events received and not yet consumed by wait_event (oldest first)."""
        return list(self._events)

    async def wait_event(self, name: str, timeout: float = 30.0,
                         match: Callable[[Event], bool] | None = None) -> Event:
        """Wait for (and consume) the first queued or future event called ``name``."""
        async def _wait() -> Event:
            async with self._event_cond:
                while True:
                    for ev in list(self._events):
                        if ev.name == name and (match is None or match(ev)):
                            self._events.remove(ev)
                            return ev
                    if self._closed is not None:
                        raise QmpConnectionError(f"waiting for {name}: {self._closed}")
                    await self._event_cond.wait()
        try:
            return await asyncio.wait_for(_wait(), timeout)
        except asyncio.TimeoutError:
            raise VmTimeout(f"QMP event {name} not seen within {timeout} s") from None

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    async def __aenter__(self) -> "QmpClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
