"""The host's one client of a guest's envd (async; every host-side caller uses it).

What the node itself asks of envd: ``/health`` (with the version envd
reports), ``/init`` (identity, clock, env vars, access token), moving a file
and running a command the way the E2B SDK does (to warm pooled clones and to
build templates). The wire format is E2B envd's (docs/envd.md): Connect
over HTTP/1.1 with the JSON codec; a server-streaming response is a sequence
of ``[flags u8][length u32 BE][JSON]`` frames ending with a frame whose flags
have bit 0x02 set.

Each request is one HTTP/1.1 exchange on a fresh connection with
``Connection: close``, read to EOF and parsed by the pure functions below
(``parse_response``: Content-Length, chunked or close-delimited bodies). No
connection pool on purpose: a restored clone's first requests are paid in
code translation (TCG) far more than in connection set-up, and a fork of 16
children must not queue behind a shared pool's limit. Under user-mode
networking QEMU accepts a connection itself while nothing listens in the
guest, and closes it: "connected" is not "answered", only an HTTP status
counts (``NoAnswer`` otherwise).

A guest decides what its envd answers, and a guest may be hostile (it can replace
envd with anything listening on its port): every answer is read under a byte bound
and a deadline. A whole answer (``http_request``) is at most ``MAX_HEAD`` plus its
bound (``MAX_ANSWER`` unless the call says more: ``MAX_COMMAND_ANSWER`` for a
command's output, the caller's for a file); a streamed one (``stream_process``) is
decoded as it arrives, each Connect frame at most ``MAX_FRAME`` (envd_stream.py).
Beyond a bound the read stops and the call raises ``EnvdError``: the operation
fails, the node holds no more than the bound. Every exchange runs under
``asyncio.wait_for`` of its whole length (a resume's greeting: ``[vm]
ready_timeout``), so an envd answering a byte a minute holds nothing longer than that.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import struct
import time
import urllib.parse
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from envd import ENVD_PORT, VERSION_HEADER

from .envd_stream import MAX_FRAME, ConnectStream, StreamError
from .errors import VmError, VmTimeout

END_STREAM = 0x02
RETRY_PAUSE = 0.02          # seconds between attempts while a guest is not answering yet
MAX_HEAD = 64 << 10         # response head bytes at most
# Body bytes of an answer read whole, unless the call says otherwise: /health and /init
# answer nothing, /metrics a few hundred bytes, a file upload a short JSON list.
MAX_ANSWER = 64 << 10
# ... of a command run whole (``EnvdClient.run``: warm-up, ready and sync commands whose
# output the node only checks), as Connect frames of base64 text (4/3 of the output).
MAX_COMMAND_ANSWER = 4 << 20
READ_PIECE = 1 << 16        # bytes asked of the socket at a time

T = TypeVar("T")


class EnvdError(VmError):
    """envd answered with an error, or not in its protocol."""


class NoAnswer(ConnectionError):
    """The peer closed the connection without an HTTP answer (nothing listens yet)."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    headers: dict[str, str]     # names lower-cased; a repeated header keeps its last value
    body: bytes


# ---------------------------------------------------------------- pure codecs

def encode_envelope(message: dict, flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def decode_envelopes(data: bytes) -> list[tuple[int, dict]]:
    """All frames of a complete server-streaming body (raises EnvdError when truncated)."""
    out = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < 5:
            raise EnvdError("truncated Connect frame header")
        flags, length = struct.unpack_from(">BI", data, pos)
        pos += 5
        if length > MAX_FRAME:
            raise EnvdError(f"a Connect frame of {length} bytes (at most {MAX_FRAME})")
        if len(data) - pos < length:
            raise EnvdError("truncated Connect frame")
        try:
            msg = json.loads(data[pos:pos + length] or b"{}")
        except ValueError as e:
            raise EnvdError(f"bad JSON in Connect frame: {e}") from None
        out.append((flags, msg if isinstance(msg, dict) else {}))
        pos += length
    return out


def decode_chunked(data: bytes) -> bytes:
    """The body of a complete ``Transfer-Encoding: chunked`` message (trailers ignored)."""
    out = bytearray()
    pos = 0
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            raise EnvdError("truncated chunked body (no chunk size line)")
        size_text = data[pos:eol].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise EnvdError(f"bad chunk size {size_text[:20]!r}") from None
        pos = eol + 2
        if size == 0:
            return bytes(out)
        if len(data) < pos + size + 2:
            raise EnvdError("truncated chunked body")
        out += data[pos:pos + size]
        pos += size + 2


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status and headers (names lower-cased) of a response head without its blank line."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise NoAnswer(f"no HTTP response: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def parse_response(data: bytes) -> HttpAnswer:
    """One complete HTTP/1.x response read to EOF. ``NoAnswer`` if it has no status line."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep or len(head) > MAX_HEAD:
        raise NoAnswer(f"no HTTP response: {data[:80]!r}")
    status, headers = parse_head(head)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = decode_chunked(rest)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise EnvdError(f"bad Content-Length {headers['content-length'][:20]!r}") from None
        if len(rest) < length:
            raise EnvdError(f"truncated body: {len(rest)} of {length} bytes")
        body = rest[:length]
    else:
        body = rest
    return HttpAnswer(status, headers, body)


def format_request(method: str, host: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    length = f"Content-Length: {len(body)}\r\n" if body or method not in ("GET", "HEAD") else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{head}{length}\r\n").encode() + body


# ---------------------------------------------------------------- transport

async def http_request(host: str, port: int, method: str, path: str, *, body: bytes = b"",
                       headers: dict[str, str] | None = None, timeout: float = 2.0,
                       max_bytes: int = MAX_ANSWER) -> HttpAnswer:
    """One HTTP exchange with a guest port, all of it within ``timeout`` seconds. Raises
    OSError / asyncio.TimeoutError / NoAnswer (nothing answered) or EnvdError (an answer
    that is not valid HTTP, or longer than its head and ``max_bytes``: the guest decides
    how much it sends, the read stops there)."""
    async def go() -> HttpAnswer:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(format_request(method, host, path, headers or {}, body))
            await writer.drain()
            buf = bytearray()
            while chunk := await reader.read(READ_PIECE):
                buf += chunk
                if len(buf) > max_bytes + MAX_HEAD:
                    raise EnvdError(f"{host}:{port} {method} {path}: answer larger than {max_bytes} bytes "
                                    f"(the bound on it)")
            data = bytes(buf)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return parse_response(data)
    return await asyncio.wait_for(go(), timeout)


async def until_answered(attempt: Callable[[float], Awaitable[T]], *, timeout: float, what: str,
                         alive: Callable[[], bool] | None = None) -> T:
    """Call ``attempt(seconds left)`` until it returns without a connection-level error
    (the guest is not listening yet); VmTimeout after ``timeout``, VmError at once when
    ``alive()`` says the VM is gone. Errors ``attempt`` raises itself pass through."""
    start = time.monotonic()
    last: object = None
    while True:
        left = timeout - (time.monotonic() - start)
        try:
            return await attempt(max(left, 0.1))
        except (OSError, asyncio.TimeoutError, NoAnswer) as e:
            last = e
        if alive is not None and not alive():
            raise VmError(f"VM exited before {what} answered (last: {last})")
        if time.monotonic() - start > timeout:
            raise VmTimeout(f"{what} did not answer within {timeout} s (last: {last})")
        await asyncio.sleep(RETRY_PAUSE)


async def wait_http_ok(host: str, port: int, path: str = "/", *, timeout: float = 60.0,
                       alive: Callable[[], bool] | None = None) -> float:
    """Poll GET ``path`` until it answers 2xx; returns the seconds waited."""
    start = time.monotonic()

    async def attempt(left: float) -> None:
        answer = await http_request(host, port, "GET", path, timeout=min(2.0, left))
        if not 200 <= answer.status < 300:
            raise NoAnswer(f"HTTP {answer.status}")
    await until_answered(attempt, timeout=timeout, what=f"GET {path} on {host}:{port}", alive=alive)
    return time.monotonic() - start


# ---------------------------------------------------------------- envd

class EnvdClient:
    """envd of one sandbox at ``host:port`` (127.0.0.1 and a forwarded port in user-mode
    networking, the namespace address and ENVD_PORT in tap mode)."""

    def __init__(self, host: str, port: int = ENVD_PORT, access_token: str | None = None) -> None:
        self.host = host
        self.port = port
        self.access_token = access_token

    def with_token(self, access_token: str | None) -> "EnvdClient":
        return EnvdClient(self.host, self.port, access_token)

    def __repr__(self) -> str:
        return f"EnvdClient({self.host}:{self.port})"

    def _headers(self, user: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Headers as the SDK sends them: no Authorization means envd's default user."""
        headers = dict(extra or {})
        if user is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        if self.access_token:
            headers["X-Access-Token"] = self.access_token
        return headers

    async def _call(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                    timeout: float = 30.0, max_bytes: int = MAX_ANSWER) -> HttpAnswer:
        try:
            return await http_request(self.host, self.port, method, path, body=body, headers=headers,
                                      timeout=timeout, max_bytes=max_bytes)
        except asyncio.TimeoutError:
            raise EnvdError(f"envd at {self.host}:{self.port}: {method} {path}: no whole answer within "
                            f"{timeout} s") from None
        except (OSError, NoAnswer) as e:
            raise EnvdError(f"envd at {self.host}:{self.port}: {method} {path}: {str(e) or type(e).__name__}") from None

    # -- health and /init ---------------------------------------------------------

    async def health(self, timeout: float = 2.0) -> str | None:
        """GET /health (no token needed); the envd version it reports (None: an envd
        that does not say). Raises the transport's errors while envd is not up."""
        answer = await http_request(self.host, self.port, "GET", "/health", timeout=timeout)
        if not 200 <= answer.status < 300:
            raise NoAnswer(f"/health answered HTTP {answer.status}")
        return answer.headers.get(VERSION_HEADER.lower())

    async def wait_healthy(self, timeout: float = 60.0, alive: Callable[[], bool] | None = None) -> str | None:
        """Poll /health until envd answers; the version it reports."""
        return await until_answered(lambda left: self.health(min(2.0, left)), timeout=timeout, alive=alive,
                                    what=f"envd /health on {self.host}:{self.port}")

    async def init(self, body: dict, timeout: float = 10.0) -> None:
        """POST /init once. ``body`` may carry aenv's ``hostname`` and ``entropy`` (docs/envd.md)."""
        answer = await self._call("POST", "/init", json.dumps(body).encode(),
                                  self._headers(extra={"Content-Type": "application/json"}), timeout)
        self._check_init(answer)

    async def init_when_ready(self, body: dict, timeout: float = 60.0,
                              alive: Callable[[], bool] | None = None) -> float:
        """POST /init until envd answers (a freshly restored clone's first and only
        request: a separate /health would cost one more round of code translation);
        returns the seconds it took. Retrying is safe: /init is idempotent, and envd
        accepts a body whose ``accessToken`` equals the token in force, so a retry
        after a lost answer still authenticates. A non-2xx answer fails at once."""
        start = time.monotonic()
        raw = json.dumps(body).encode()
        headers = self._headers(extra={"Content-Type": "application/json"})

        async def attempt(left: float) -> None:
            # one long attempt: under load the first answer can take seconds, and a
            # retry after a client-side timeout would make the guest do it twice
            self._check_init(await http_request(self.host, self.port, "POST", "/init", body=raw,
                                                headers=headers, timeout=left))
        await until_answered(attempt, timeout=timeout, alive=alive, what=f"envd /init on {self.host}:{self.port}")
        return time.monotonic() - start

    @staticmethod
    def _check_init(answer: HttpAnswer) -> None:
        if not 200 <= answer.status < 300:
            raise EnvdError(f"envd /init answered HTTP {answer.status}: {answer.body[:200]!r}")

    async def metrics(self, timeout: float = 2.0) -> dict:
        """GET /metrics: the guest's CPU (since the previous call), memory and root-fs
        use, in envd's field names (envd/metrics.py)."""
        answer = await self._call("GET", "/metrics", headers=self._headers(), timeout=timeout, max_bytes=64 << 10)
        if answer.status != 200:
            raise EnvdError(f"envd /metrics answered HTTP {answer.status}: {answer.body[:200]!r}")
        try:
            out = json.loads(answer.body)
        except ValueError:
            raise EnvdError(f"envd /metrics answered no JSON: {answer.body[:200]!r}") from None
        if not isinstance(out, dict):
            raise EnvdError(f"envd /metrics answered {type(out).__name__}, not an object")
        return out

    # -- files and commands -------------------------------------------------------

    async def write_file(self, path: str, data: bytes, *, user: str | None = None, timeout: float = 30.0) -> None:
        """Upload ``data`` to ``path`` as the SDK's ``files.write`` does for bytes (multipart/form-data)."""
        boundary = secrets.token_hex(16)
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path}\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + \
            f"\r\n--{boundary}--\r\n".encode()
        query = urllib.parse.urlencode({"path": path, **({"username": user} if user else {})})
        headers = self._headers(extra={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        answer = await self._call("POST", f"/files?{query}", body, headers, timeout)
        if answer.status != 200:
            raise EnvdError(f"envd file upload to {path} answered HTTP {answer.status}: {answer.body[:200]!r}")

    async def read_file(self, path: str, *, user: str | None = None, timeout: float = 30.0,
                        max_bytes: int = MAX_ANSWER) -> bytes:
        """``GET /files`` as the SDK's ``files.read`` does; EnvdError beyond ``max_bytes``."""
        query = urllib.parse.urlencode({"path": path, **({"username": user} if user else {})})
        answer = await self._call("GET", f"/files?{query}", b"", self._headers(), timeout, max_bytes)
        if answer.status != 200:
            raise EnvdError(f"envd file download of {path} answered HTTP {answer.status}: {answer.body[:200]!r}")
        return answer.body

    async def run(self, cmd: str, *, user: str | None = "root", timeout: float = 30.0,
                  pty: bool = False) -> CommandResult:
        """``bash -l -c cmd`` in the guest, the way the E2B SDK's ``commands.run`` does it
        (same request, same headers); ``user=None`` is the SDK's default: envd's default user.
        ``pty``: as the SDK's ``pty.create`` starts its shell instead (``bash -i -l`` on a
        terminal, with its TERM and locale), running ``cmd`` (the output is the terminal's)."""
        if pty:
            process = {"cmd": "/bin/bash", "args": ["-i", "-l", "-c", cmd],
                       "envs": {"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}}
            body = encode_envelope({"process": process, "pty": {"size": {"cols": 80, "rows": 24}}, "stdin": False})
        else:
            body = encode_envelope({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {}},
                                    "stdin": False})
        headers = self._headers(user, {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                                       "Keepalive-Ping-Interval": "50",
                                       "Connect-Timeout-Ms": str(int(timeout * 1000))})
        answer = await self._call("POST", "/process.Process/Start", body, headers, timeout, MAX_COMMAND_ANSWER)
        if answer.status != 200:
            raise EnvdError(f"envd process start answered HTTP {answer.status}: {answer.body[:200]!r}")
        return command_result(answer.body)


def command_result(stream: bytes) -> CommandResult:
    """Stdout, stderr and exit code from a complete ``process.Process/Start`` stream."""
    out, err = bytearray(), bytearray()
    exit_code: int | None = None
    for flags, msg in decode_envelopes(stream):
        if flags & END_STREAM:
            if msg.get("error"):
                raise EnvdError(f"envd process start failed: {msg['error']}")
            continue
        event = msg.get("event", {})
        if "data" in event:
            for key, buf in (("stdout", out), ("stderr", err)):
                if key in event["data"]:
                    buf += base64.b64decode(event["data"][key])
        if "end" in event:
            exit_code = int(event["end"].get("exitCode", 0))
    if exit_code is None:
        raise EnvdError("envd process stream ended without an end event")
    return CommandResult(exit_code, bytes(out), bytes(err))


# ---------------------------------------------------------------- streamed processes

@dataclass(frozen=True)
class ProcessRequest:
    """One ``process.Process/Start``: a command line run as ``user`` in ``cwd`` with ``envs``
    (envd's defaults where None)."""
    cmd: str
    args: tuple[str, ...] = ()
    user: str | None = "root"
    cwd: str | None = None
    envs: dict[str, str] | None = None

    def body(self) -> bytes:
        process: dict[str, object] = {"cmd": self.cmd, "args": list(self.args), "envs": dict(self.envs or {})}
        if self.cwd is not None:
            process["cwd"] = self.cwd
        return encode_envelope({"process": process, "stdin": False})


OutputSink = Callable[[str, bytes], None]     # ("stdout" | "stderr", bytes)


async def _read_head(reader: asyncio.StreamReader) -> HttpAnswer:
    """Status and headers of a response whose body is still to be read (body empty). The
    reader's limit (``MAX_HEAD``) bounds the head."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        raise NoAnswer(f"no HTTP response head: {e}") from None
    status, headers = parse_head(head[:-4])
    return HttpAnswer(status, headers, b"")


async def _frames(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[tuple[int, dict]]:
    """Connect frames of a streamed body as they arrive (chunked or close-delimited), each
    at most ``MAX_FRAME`` bytes (envd_stream.py)."""
    stream = ConnectStream(chunked)
    while True:
        data = await reader.read(READ_PIECE)
        try:
            if data:
                frames = stream.feed(data)
            else:
                stream.finish()
                frames = []
        except StreamError as e:
            raise EnvdError(f"envd process stream: {e}") from None
        for frame in frames:
            yield frame
        if not data or stream.done:
            return


async def stream_process(client: "EnvdClient", req: ProcessRequest, *, timeout: float | None,
                         on_output: OutputSink | None = None, detach: bool = False) -> int:
    """Run ``req`` in the guest, handing its output to ``on_output`` as it comes; the exit
    code. ``detach``: return the pid as soon as envd reports the start and leave the
    process running (envd keeps processes whose stream closed: E2B's background commands).
    ``timeout``: envd kills the process after that many seconds (Connect's deadline, as the
    SDK's command timeout) and this call raises VmTimeout; None: no deadline (a start
    command: it must outlive the stream)."""
    extra = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
             "Keepalive-Ping-Interval": "30"}
    if timeout is not None:
        extra["Connect-Timeout-Ms"] = str(int(timeout * 1000))
    headers = client._headers(req.user, extra)

    async def go() -> int:
        reader, writer = await asyncio.open_connection(client.host, client.port, limit=MAX_HEAD)
        try:
            writer.write(format_request("POST", client.host, "/process.Process/Start", headers, req.body()))
            await writer.drain()
            head = await _read_head(reader)
            if head.status != 200:
                rest = await reader.read(1024)
                raise EnvdError(f"envd process start answered HTTP {head.status}: {rest[:200]!r}")
            chunked = "chunked" in head.headers.get("transfer-encoding", "").lower()
            async for flags, msg in _frames(reader, chunked):
                if flags & END_STREAM:
                    if msg.get("error"):
                        raise EnvdError(f"envd process failed: {msg['error']}")
                    continue
                event = msg.get("event", {})
                if "start" in event and detach:
                    return int(event["start"].get("pid", 0))
                data = event.get("data")
                if data and on_output is not None:
                    for key in ("stdout", "stderr"):
                        if key in data:
                            on_output(key, base64.b64decode(data[key]))
                if "end" in event:
                    end = event["end"]
                    if end.get("error") and "exitCode" not in end:
                        raise EnvdError(f"process ended: {end['error']}")
                    return int(end.get("exitCode", 0))
            raise EnvdError("envd process stream ended without an end event")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        return await asyncio.wait_for(go(), None if timeout is None else timeout + 5.0)
    except asyncio.TimeoutError:
        raise VmTimeout(f"{req.cmd} {' '.join(req.args)[:80]} did not finish in {timeout:.0f} s") from None
    except (OSError, NoAnswer, asyncio.IncompleteReadError) as e:
        raise EnvdError(f"envd at {client.host}:{client.port}: process stream: {str(e) or type(e).__name__}") from None
