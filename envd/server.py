"""The envd HTTP/1.1 server: moves bytes between sockets and the pure parts.

One asyncio task per connection; keep-alive; streamed responses are flushed
frame by frame and abandoned as soon as the client goes away.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import json
import logging
import time
from typing import Any, AsyncGenerator, AsyncIterator, cast

from . import ENVD_VERSION, VERSION_HEADER, connect, files, identity, signing, volwire
from .connect import Code, ConnectError
from .fs_service import FilesystemService
from .http11 import LAST_CHUNK, MAX_HEAD_BYTES, BodyReader, HttpError, RequestHead, encode_chunk, format_head, parse_request_head
from .metrics import MetricsSampler
from .process import ProcessManager
from .process_service import ProcessService
from .responses import Response, http_error, json_response
from .router import PUBLIC_PATHS, Kind, Route, RouteError, route
from .rpc import ClientStream, Handler, RpcContext, ServerStream, Unary
from .state import EnvdState
from .users import basic_auth_user
from .volfs import VolfsError
from .volmounts import VolumeMounts, peer_is_local

log = logging.getLogger("envd")

UNARY_BODY_LIMIT = connect.MAX_MESSAGE_BYTES
CONNECT_STREAM_CT = "application/connect+json"
# Bytes gathered into one write at most (head + body, or stream pieces ready together).
_COALESCE_MAX = 64 << 10


def _connect_error_response(
    err: ConnectError, headers: tuple[tuple[str, str], ...] = (), status: int | None = None
) -> Response:
    return Response(
        status or err.code.http_status, (("Content-Type", "application/json"), *headers), connect.unary_error_body(err)
    )


async def _one(frames: bytes) -> AsyncGenerator[bytes, None]:
    yield frames


class EnvdServer:
    def __init__(self, state: EnvdState) -> None:
        self.state = state
        self.processes = ProcessManager(state)
        self.filesystem = FilesystemService()
        self.metrics = MetricsSampler()
        self.handlers: dict[str, Handler] = {
            **ProcessService(self.processes).handlers(),
            **self.filesystem.handlers(),
        }
        self.volumes = VolumeMounts()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve_conn, host, port, limit=MAX_HEAD_BYTES, reuse_address=True)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        await self.processes.shutdown()
        self.filesystem.close()
        self.volumes.close()

    # -- connection --------------------------------------------------------

    def _close_other_connections(self) -> None:
        """Close every client connection but the current one. The node asks it in the
        /init that follows a restore from a memory snapshot: the connections the snapshot
        carried have no peer any more (the host aborted its side when the VM stopped), and
        left open they would share a 4-tuple with a new connection from the host that
        happens to get the same source port, which the guest then answers with the old
        connection's sequence numbers: a request that fails or hangs."""
        current = asyncio.current_task()
        for task in list(self._conns):
            if task is not current:
                task.cancel()

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        try:
            while True:
                try:
                    raw = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                except asyncio.LimitOverrunError:
                    await self._write(writer, reader, http_error(431, "request head too large"), False, False, "GET")
                    return
                try:
                    head = parse_request_head(raw)
                    body = BodyReader(reader, head)
                except HttpError as e:
                    await self._write(writer, reader, http_error(e.status, e.message), False, False, "GET")
                    return
                if head.path == volwire.ENDPOINT:
                    await self._volume_channel(head, reader, writer)
                    return
                if (head.header("expect") or "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                try:
                    resp = await self._dispatch(head, body)
                except HttpError as e:
                    resp = http_error(e.status, e.message)
                    head = RequestHead(head.method, head.path, head.query, head.version, (("connection", "close"),))
                # A handler that answered without reading its whole body (an
                # early error) leaves the rest unread: a small remainder is
                # skipped so the client gets to read the answer, a large one
                # closes the connection after the answer.
                keep = head.keep_alive
                if not body.finished and resp.stream is None:
                    try:
                        keep = await body.drain() and keep
                    except HttpError:
                        keep = False
                ok = await self._write(writer, reader, resp, keep, body.finished, head.method)
                log.debug("%s %s -> %d", head.method, head.path, resp.status)
                if not (ok and keep and body.finished):
                    return
        except (ConnectionError, OSError):
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must cost one connection, never the server
            log.exception("connection handler failed")
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()

    async def _write(
        self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader, resp: Response,
        keep: bool, watch_disconnect: bool, method: str,
    ) -> bool:
        """Write ``resp``; False when the client went away mid-stream."""
        headers = list(resp.headers)
        names = {k.lower() for k, _ in headers}
        chunked = resp.stream is not None and "content-length" not in names
        if resp.file is not None:
            return await self._sendfile(writer, resp, headers, keep, method)
        if resp.stream is None and resp.status not in (204, 304):
            headers.append(("Content-Length", str(len(resp.body))))
        if chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        if not keep:
            headers.append(("Connection", "close"))
        head = format_head(resp.status, headers)
        if method == "HEAD":
            writer.write(head)
            if resp.stream is not None:
                await resp.stream.aclose()
            await writer.drain()
            return True
        if resp.stream is None:
            # One write (one send, one wake-up of the reader) for head and body.
            writer.write(head + resp.body if len(resp.body) <= _COALESCE_MAX else head)
            if len(resp.body) > _COALESCE_MAX:
                writer.write(resp.body)
            await writer.drain()
            return True
        stream = resp.stream
        # Idle streams (process output, watches) learn that the client left by
        # a pending read hitting EOF. Only chunked responses are watched: after
        # the last byte of a Content-Length body the client may already send
        # its next request, which that read would swallow.
        gone = asyncio.ensure_future(reader.read(1)) if watch_disconnect and chunked else None
        # Pieces the stream produces without waiting leave in one write: the head
        # with the first frame (every stream here starts with an event at once), a
        # command's end event with the end-of-stream frame and the chunked
        # terminator. Each write is a send and a wake-up of the client (the API's
        # proxy, which relays every piece it is woken for): fewer, fuller writes
        # cost both sides less CPU. A piece that is not ready at once never waits
        # for company: what is pending goes out before the stream is awaited.
        out = [head]
        size = len(head)
        try:
            while True:
                nxt = asyncio.ensure_future(stream.__anext__())
                await asyncio.sleep(0)  # one loop turn: a piece made without waiting is done now
                if not nxt.done() or size > _COALESCE_MAX:
                    if out:
                        writer.write(b"".join(out))
                        out.clear()
                        size = 0
                        await writer.drain()
                    if gone is not None and not nxt.done():
                        await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                        if not nxt.done():
                            nxt.cancel()
                            await asyncio.gather(nxt, return_exceptions=True)
                            return False
                try:
                    chunk = await nxt
                except StopAsyncIteration:
                    break
                if chunk:
                    piece = encode_chunk(chunk) if chunked else chunk
                    out.append(piece)
                    size += len(piece)
        finally:
            if gone is not None and not gone.done():
                gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
            await stream.aclose()
        if gone is not None and gone.done() and not gone.cancelled():
            return False
        if chunked:
            out.append(LAST_CHUNK)
        if out:
            writer.write(b"".join(out))
        await writer.drain()
        return True

    async def _sendfile(self, writer: asyncio.StreamWriter, resp: Response, headers: list[tuple[str, str]],
                        keep: bool, method: str) -> bool:
        assert resp.file is not None
        try:
            if not keep:
                headers.append(("Connection", "close"))
            writer.write(format_head(resp.status, headers))
            if method != "HEAD":
                await writer.drain()
                # Zero-copy from the page cache; falls back to read+write where
                # sendfile is unavailable. Memory stays flat either way.
                await asyncio.get_running_loop().sendfile(writer.transport, resp.file)
            await writer.drain()
            return True
        finally:
            resp.file.close()

    async def _volume_channel(self, head: RequestHead, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        """The node's channel for one volume mount (envd/volfs.py): only the node opens
        it -- never a connection from inside the guest, and only with the token."""
        async def refuse(status: int, message: str) -> None:
            await self._write(writer, reader, http_error(status, message), False, False, "POST")

        unmount = head.query_value("unmount")
        if head.method != "POST" or (unmount is None and
                                     (head.header("upgrade") or "").lower() != volwire.UPGRADE_TOKEN):
            return await refuse(400, f"{volwire.ENDPOINT} takes POST with Upgrade: {volwire.UPGRADE_TOKEN}")
        peer = writer.get_extra_info("peername")
        if not peer or peer_is_local(peer[0]):
            return await refuse(403, "volume channels are opened by the node, not from inside the sandbox")
        token = self.state.access_token
        given = head.header("x-access-token")
        if token is not None and not (given is not None and hmac.compare_digest(given.encode(), token.encode())):
            return await refuse(401, "invalid access token")
        if unmount is not None:
            try:
                found = await self.volumes.unmount(unmount)
            except VolfsError as e:
                return await refuse(e.status, str(e))
            await self._write(writer, reader, Response(204 if found else 404), False, False, "POST")
            return
        switching = (f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: {volwire.UPGRADE_TOKEN}\r\n"
                     f"Connection: Upgrade\r\n\r\n").encode()
        # The socket moves to the volfs thread (volmounts.py): this loop stops reading it
        # and drops its own fd; the node sends nothing before the 101, so no byte is lost.
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport)  # a socket's: it reads as well as writes
        transport.pause_reading()
        sock = transport.get_extra_info("socket").dup()
        try:
            await self.volumes.attach(head.query_value("path") or "", head.query_value("volume") or "",
                                      sock, switching)
        except VolfsError as e:
            sock.close()
            return await refuse(e.status, str(e))
        transport.abort()

    # -- dispatch ------------------------------------------------------------

    async def _dispatch(self, head: RequestHead, body: BodyReader) -> Response:
        r = route(head.method, head.path, head.header("content-type"))
        if isinstance(r, RouteError):
            extra = (("Allow", r.allow),) if r.allow else ()
            if r.connect_code is not None:
                # Protocol-level rejections keep their HTTP status (415, 405,
                # 404) as connect-go does, with a Connect JSON body.
                return _connect_error_response(ConnectError(Code(_code(r.connect_code)), r.message), extra, r.status)
            return http_error(r.status, r.message) if not extra else Response(
                r.status, (("Content-Type", "application/json"), *extra),
                json.dumps({"code": r.status, "message": r.message}).encode(),
            )
        if not self._authorized(head, r):
            msg = "unauthorized access, please provide a valid access token" if head.header(
                "x-access-token") is None else "invalid access token"
            if r.kind is Kind.HTTP:
                return http_error(401, msg)
            return _connect_error_response(ConnectError(Code.UNAUTHENTICATED, msg))
        auth_user = basic_auth_user(head.header("authorization"))
        if r.kind is Kind.HTTP:
            return await self._http(head, body, auth_user)
        try:
            version = head.header("connect-protocol-version")
            if version is not None and version != "1":
                raise ConnectError(Code.INVALID_ARGUMENT, f"connect-protocol-version must be '1', got {version!r}")
            ctx = RpcContext(
                self.state, auth_user, connect.parse_timeout_ms(head.header("connect-timeout-ms")),
                _keepalive(head.header("keepalive-ping-interval")),
            )
        except ConnectError as e:
            if r.kind is Kind.UNARY:
                return _connect_error_response(e)
            return self._stream_response(_one(connect.encode_end_stream(e)))
        # which of the three kinds of handler a path has is the route table's word (router.py)
        handler = self.handlers[r.path]
        if r.kind is Kind.UNARY:
            return await self._unary(cast(Unary, handler), body, ctx)
        if r.kind is Kind.SERVER_STREAM:
            return await self._server_stream(cast(ServerStream, handler), body, ctx)
        # The answer of a client stream is sent only once the request body is
        # consumed: the SDK's HTTP client stops sending the body (ends it
        # empty) when response headers arrive first.
        frames = b"".join([f async for f in self._client_stream(cast(ClientStream, handler), body, ctx)])
        return Response(200, (("Content-Type", CONNECT_STREAM_CT),), frames)

    def _authorized(self, head: RequestHead, r: Route) -> bool:
        token = self.state.access_token
        if token is None or r.path in PUBLIC_PATHS or r.path in ("/init", "/files"):
            # /init checks the token itself (it may carry it in the body); /files takes
            # the token or a URL signature instead (_files_denied), as E2B's envd does.
            return True
        given = head.header("x-access-token")
        return given is not None and hmac.compare_digest(given.encode(), token.encode())

    @staticmethod
    def _stream_response(frames: AsyncGenerator[bytes, None]) -> Response:
        return Response(200, (("Content-Type", CONNECT_STREAM_CT),), stream=frames)

    async def _unary(self, handler: Unary, body: BodyReader, ctx: RpcContext) -> Response:
        try:
            msg = connect.decode_json_message(await body.read_all(UNARY_BODY_LIMIT))
            async with asyncio.timeout(ctx.timeout_s):
                out = await handler(msg, ctx)
        except HttpError as e:
            if e.status == 413:
                return _connect_error_response(ConnectError(Code.RESOURCE_EXHAUSTED, e.message))
            raise
        except ConnectError as e:
            return _connect_error_response(e)
        except TimeoutError:
            return _connect_error_response(ConnectError(Code.DEADLINE_EXCEEDED, "deadline exceeded"))
        except Exception as e:
            log.exception("unary handler failed")
            return _connect_error_response(ConnectError(Code.INTERNAL, f"internal error: {e}"))
        return Response(200, (("Content-Type", "application/json"),), json.dumps(out).encode())

    async def _server_stream(self, handler: ServerStream, body: BodyReader, ctx: RpcContext) -> Response:
        try:
            envs = connect.decode_envelopes(await body.read_all(UNARY_BODY_LIMIT + connect.HEADER_LEN))
            if len(envs) != 1:
                raise ConnectError(Code.INVALID_ARGUMENT, f"expected exactly one request message, got {len(envs)}")
            msg = connect.decode_json_message(envs[0].data)
        except HttpError as e:
            if e.status != 413:
                raise
            return self._stream_response(_one(connect.encode_end_stream(ConnectError(Code.RESOURCE_EXHAUSTED, e.message))))
        except ConnectError as e:
            return self._stream_response(_one(connect.encode_end_stream(e)))
        return self._stream_response(self._frames(handler(msg, ctx), ctx))

    async def _frames(self, messages: AsyncGenerator[dict[str, Any], None], ctx: RpcContext) -> AsyncGenerator[bytes, None]:
        loop = asyncio.get_running_loop()
        end_at = None if ctx.timeout_s is None else loop.time() + ctx.timeout_s
        error: ConnectError | None = None
        try:
            while True:
                async with asyncio.timeout_at(end_at):
                    msg = await messages.__anext__()
                yield connect.encode_message(msg)
        except StopAsyncIteration:
            pass
        except TimeoutError:
            error = ConnectError(Code.DEADLINE_EXCEEDED, "deadline exceeded")
        except ConnectError as e:
            error = e
        except Exception as e:
            log.exception("stream handler failed")
            error = ConnectError(Code.INTERNAL, f"internal error: {e}")
        finally:
            await messages.aclose()
        yield connect.encode_end_stream(error)

    async def _client_stream(self, handler: ClientStream, body: BodyReader, ctx: RpcContext) -> AsyncIterator[bytes]:
        decoder = connect.EnvelopeDecoder()

        async def messages() -> AsyncIterator[dict[str, Any]]:
            async for chunk in body:
                for env in decoder.feed(chunk):
                    yield connect.decode_json_message(env.data)
            decoder.finish()

        try:
            async with asyncio.timeout(ctx.timeout_s):
                out = await handler(messages(), ctx)
            yield connect.encode_message(out)
            yield connect.encode_end_stream()
        except ConnectError as e:
            yield connect.encode_end_stream(e)
        except TimeoutError:
            yield connect.encode_end_stream(ConnectError(Code.DEADLINE_EXCEEDED, "deadline exceeded"))
        except HttpError as e:
            yield connect.encode_end_stream(ConnectError(Code.INVALID_ARGUMENT, e.message))

    # -- plain HTTP ------------------------------------------------------------

    async def _http(self, head: RequestHead, body: BodyReader, auth_user: str | None) -> Response:
        path = head.path
        if path == "/health":
            return Response(204, ((VERSION_HEADER, ENVD_VERSION),))
        if path == "/metrics":
            return json_response(200, self.metrics.sample())
        if path == "/envs":
            return json_response(200, self.state.env_vars)
        if path == "/init":
            return await self._init(head, body)
        denied = self._files_denied(head)
        if denied is not None:
            return denied
        if head.method in ("GET", "HEAD"):
            return await files.download(head, self.state, auth_user)
        return await files.upload(head, body, self.state, auth_user)

    def _files_denied(self, head: RequestHead) -> Response | None:
        """401 with E2B's message unless the request bears the token or a valid,
        unexpired signature (signing.py)."""
        query = {k: v for k, v in reversed(head.query)}  # the first value of each name wins
        try:
            req = signing.parse(head.method, query)
        except signing.BadExpiration as e:
            return http_error(400, str(e))
        reason = signing.check(req, self.state.access_token, head.header("x-access-token"))
        return None if reason is None else http_error(401, reason)

    async def _init(self, head: RequestHead, body: BodyReader) -> Response:
        raw = await body.read_all(1 << 20)
        try:
            req = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            return http_error(400, f"invalid JSON body: {e}")
        if not isinstance(req, dict):
            return http_error(400, "body must be a JSON object")
        token = self.state.access_token
        if token is not None:
            given = head.header("x-access-token") or ""
            in_body = req.get("accessToken")
            body_token = in_body if isinstance(in_body, str) else ""
            if not (hmac.compare_digest(given.encode(), token.encode())
                    or hmac.compare_digest(body_token.encode(), token.encode())):
                return http_error(401, "invalid access token")
        try:  # validated before anything is applied
            hostname = identity.parse_hostname(req["hostname"]) if req.get("hostname") is not None else None
            seed = identity.parse_seed(req["entropy"]) if req.get("entropy") is not None else None
        except identity.IdentityError as e:
            return http_error(400, str(e))
        env = req.get("envVars")
        if env is not None:
            if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                return http_error(400, "envVars must be an object of strings")
            self.state.env_vars.update(env)
        for key, attr in (("defaultUser", "default_user"), ("defaultWorkdir", "default_workdir")):
            value = req.get(key)
            if value is not None:
                if not isinstance(value, str):
                    return http_error(400, f"{key} must be a string")
                if value:
                    setattr(self.state, attr, value)
        if "accessToken" in req:
            value = req["accessToken"]
            if value is not None and not isinstance(value, str):
                return http_error(400, "accessToken must be a string")
            self.state.access_token = value or None
        if req.get("closeConnections") is True:
            self._close_other_connections()
        ts = req.get("timestamp")
        if isinstance(ts, str) and self.state.sync_clock:
            _sync_clock(ts)
        if self.state.set_identity and (hostname or seed):
            try:
                if hostname:
                    identity.set_hostname(hostname)
                if seed:
                    identity.seed_kernel_rng(seed)
            except OSError as e:  # the host relies on it: say so rather than answer 204
                return http_error(500, f"cannot set the sandbox identity: {e}")
        return Response(204)


def _code(wire: str) -> tuple[str, int]:
    for c in Code:
        if c.wire == wire:
            return c.value
    return Code.UNKNOWN.value


def _keepalive(value: str | None) -> float | None:
    try:
        v = float(value) if value else None
    except ValueError:
        return None
    return v if v and v > 0 else None


def _sync_clock(ts: str) -> None:
    """Set the guest clock from the host's timestamp when it drifted (resume
    from a snapshot leaves the guest clock where the snapshot was taken)."""
    try:
        when = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return
    if abs(when - time.time()) > 1.0:
        try:
            time.clock_settime(time.CLOCK_REALTIME, when)
        except OSError as e:
            log.warning("cannot set the clock: %s", e)
