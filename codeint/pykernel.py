"""A Python context's kernel process: IPython's ``InteractiveShell`` (the core of
ipykernel, from Debian's ``python3-ipython``) driven over kernel_wire's channel.

Started by kernel.py as ``python3 -c BOOT FD STARTUP`` in the context's cwd, in a
session of its own (an interrupt is SIGINT to its process group). What it keeps of
ipykernel's behaviour: the display hook and display publisher send MIME bundles (the
cell's value ``main``, ``display()`` and matplotlib's inline figures not), tracebacks
go out as errors with IPython's own text (no colours), ``sys.stdout``/``sys.stderr``
are streams flushed every 0.2 s, at 1 MiB and before any result, and what processes
write to file descriptors 1 and 2 (``os.system``, C code) is read from pipes and sent
as the same streams. ``input()`` reads an empty stdin (EOFError), as ipykernel with
``allow_stdin=False`` refuses it.

Interrupts: SIGINT raises KeyboardInterrupt only while a cell runs and never in the
middle of writing a frame (the channel would be cut mid-message); one that arrives in
between cells is dropped."""
from __future__ import annotations

import datetime as dt
import os
import select
import signal
import socket
import sys
import threading
from typing import Any

from . import kernel_wire as wire

FLUSH_SECONDS = 0.2
STREAM_LIMIT = 1 << 20    # characters buffered per stream before a flush (and per message)


class Interrupts:
    """SIGINT → KeyboardInterrupt in the main thread, but only inside user code and
    outside a frame write (``critical``)."""

    def __init__(self) -> None:
        self.in_cell = False
        self.critical = 0
        self.pending = False
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if not self.in_cell:
            return
        if self.critical:
            self.pending = True
            return
        raise KeyboardInterrupt

    def leave_critical(self) -> None:
        self.critical -= 1
        if not self.critical and self.pending and self.in_cell:
            self.pending = False
            raise KeyboardInterrupt


class Channel:
    """The socket to the server; sends from any thread, whole frames only."""

    def __init__(self, sock: socket.socket, interrupts: Interrupts) -> None:
        self.sock = sock
        self.lock = threading.RLock()
        self.interrupts = interrupts
        self._buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        frame = wire.encode(msg)
        main = threading.current_thread() is threading.main_thread()
        with self.lock:
            if main:
                self.interrupts.critical += 1
            try:
                self.sock.sendall(frame)
            finally:
                if main:
                    self.interrupts.leave_critical()

    def recv(self) -> dict[str, Any] | None:
        """The next message, None when the server closed the channel."""
        while True:
            if len(self._buf) >= wire.HEADER.size:
                n = wire.frame_length(self._buf[:wire.HEADER.size])
                if len(self._buf) >= wire.HEADER.size + n:
                    body = self._buf[wire.HEADER.size:wire.HEADER.size + n]
                    self._buf = self._buf[wire.HEADER.size + n:]
                    return wire.decode(body)
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self._buf += data


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()


class Streams:
    """stdout and stderr of the kernel: Python-level writes buffered here, descriptor-level
    writes read from pipes by a thread; both sent under one lock, so their order is the
    order they were flushed in."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.lock = threading.RLock()
        self.bufs: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.sizes = {"stdout": 0, "stderr": 0}
        self.pipes: dict[int, str] = {}

    def write(self, name: str, text: str) -> None:
        with self.lock:
            for i in range(0, len(text), STREAM_LIMIT):
                piece = text[i:i + STREAM_LIMIT]
                self.bufs[name].append(piece)
                self.sizes[name] += len(piece)
                if self.sizes[name] >= STREAM_LIMIT:
                    self._flush(name)

    def _flush(self, name: str) -> None:
        if self.bufs[name]:
            text = "".join(self.bufs[name])
            self.bufs[name].clear()
            self.sizes[name] = 0
            self.channel.send({"t": "stream", "name": name, "text": text, "ts": _now()})

    def flush(self) -> None:
        with self.lock:
            self._drain_pipes()
            self._flush("stdout")
            self._flush("stderr")

    def capture_fds(self) -> None:
        """Descriptors 1 and 2 become pipes read here (the originals, the kernel's log, stay
        on ``sys.__stderr__``)."""
        log = os.dup(2)
        # typeshed declares them Final (the interpreter's own streams); here they are rebound on
        # purpose: what wants the real terminal (tracebacks of the kernel itself) writes the log
        sys.__stderr__ = sys.__stdout__ = open(log, "w", buffering=1, closefd=True)  # type: ignore[misc]
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self.pipes[r] = name
        threading.Thread(target=self._pump, name="codeint-streams", daemon=True).start()

    def _drain_pipes(self) -> None:
        for r, name in self.pipes.items():
            while True:
                try:
                    data = os.read(r, 1 << 16)
                except BlockingIOError:
                    break
                if not data:
                    break
                self.write(name, data.decode("utf-8", "replace"))

    def _pump(self) -> None:
        while True:
            select.select(list(self.pipes), [], [], FLUSH_SECONDS)
            self.flush()


class StreamFile:
    """``sys.stdout`` / ``sys.stderr`` of user code."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, streams: Streams, name: str) -> None:
        self.streams, self.name = streams, name

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        self.streams.write(self.name, s)
        return len(s)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.streams.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 1 if self.name == "stdout" else 2

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False


def make_shell(channel: Channel, streams: Streams) -> Any:
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets import Type
    from traitlets.config import Config

    class CellDisplayHook(DisplayHook):
        """The cell's value (``Out[n]``) as the main result."""

        def start_displayhook(self) -> None:
            streams.flush()

        def write_output_prompt(self) -> None:
            pass

        def write_format_data(self, format_dict: dict[str, Any], md_dict: Any = None) -> None:
            channel.send({"t": "result", "data": format_dict, "main": True})

        def finish_displayhook(self) -> None:
            pass

    class CellDisplayPublisher(DisplayPublisher):
        """``display()`` and matplotlib's inline figures: results that are not the main one."""

        def publish(self, data: dict[str, Any], metadata: Any = None, source: Any = None, *,
                    transient: Any = None, update: bool = False, **kwargs: Any) -> None:
            streams.flush()
            channel.send({"t": "result", "data": data, "main": False})

        def clear_output(self, wait: bool = False) -> None:
            pass     # the SDKs have no way to take back a result

    class CellShell(InteractiveShell):
        displayhook_class = Type(CellDisplayHook)
        display_pub_class = Type(CellDisplayPublisher)

        def _showtraceback(self, etype: Any, evalue: Any, stb: list[str]) -> None:
            streams.flush()
            channel.send({"t": "error", "ename": getattr(etype, "__name__", str(etype)),
                          "evalue": _safe_str(evalue), "traceback": list(stb)})

        def enable_gui(self, gui: Any = None) -> None:
            pass     # no display here; `%matplotlib inline` needs none

    config = Config()
    config.InteractiveShell.colors = "NoColor"
    config.PlainTextFormatter.max_seq_length = 0
    config.HistoryManager.enabled = False
    return CellShell.instance(config=config)


def _safe_str(value: Any) -> str:
    try:
        return str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def _str_map(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def run(shell: Any, channel: Channel, streams: Streams, interrupts: Interrupts, msg: dict[str, Any]) -> None:
    """One cell. ``envs`` are set for good first (the sandbox's own, before a context's
    first cell), ``cell_envs`` only for this cell: afterwards a variable that existed gets
    its old value back and a new one is removed. Both in this process, so a cell with envs
    costs no extra round trip."""
    silent = bool(msg.get("silent"))
    os.environ.update(_str_map(msg.get("envs")))
    cell_envs = _str_map(msg.get("cell_envs"))
    saved = {k: os.environ.get(k) for k in cell_envs}
    os.environ.update(cell_envs)
    if not silent:
        channel.send({"t": "count", "n": shell.execution_count})
    try:
        interrupts.in_cell = True
        try:
            shell.run_cell(str(msg.get("code", "")), store_history=not silent, silent=silent)
        finally:
            interrupts.in_cell = False
            interrupts.pending = False
    except KeyboardInterrupt:    # arrived outside the user's code (IPython's own steps)
        shell.showtraceback()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    streams.flush()
    channel.send({"t": "done"})


def main(fd: int, startup: str) -> None:
    interrupts = Interrupts()
    os.set_inheritable(fd, False)     # the cell's own processes (os.system) get no channel
    channel = Channel(socket.socket(fileno=fd), interrupts)
    streams = Streams(channel)
    streams.capture_fds()
    sys.stdout = StreamFile(streams, "stdout")
    sys.stderr = StreamFile(streams, "stderr")
    sys.argv = [""]
    # matplotlib's figures as inline PNGs (what ipykernel sets unless the user did)
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    shell = make_shell(channel, streams)
    ns = shell.user_ns
    ns["__file__"] = startup
    try:
        exec(compile(open(startup, encoding="utf-8").read(), startup, "exec"), ns)
    finally:
        ns.pop("__file__", None)
    streams.flush()
    channel.send({"t": "ready"})
    while True:
        try:
            msg = channel.recv()
        except KeyboardInterrupt:
            continue
        if msg is None:     # the server closed the channel: this kernel is done
            return
        if msg.get("t") == "exec":
            run(shell, channel, streams, interrupts, msg)
