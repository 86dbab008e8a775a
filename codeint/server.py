"""The code interpreter's HTTP API (what ``e2b-code-interpreter`` 2.11 calls):

| call | answer |
|---|---|
| ``GET /health`` | 200 ``"OK"`` once the default Python context is up, else 503 |
| ``POST /execute`` ``{code, context_id?, language?, env_vars?}`` | 200, NDJSON stream (protocol.py) |
| ``POST /contexts`` ``{language?, cwd?}`` | 200 ``{id, language, cwd}`` |
| ``GET /contexts`` | 200 ``[{id, language, cwd}]`` |
| ``DELETE /contexts/{id}`` | 204 |
| ``POST /contexts/{id}/restart`` | 204 |

Errors are JSON ``{"error", "code"}`` with 400 (bad body, unknown language), 404
(unknown context or path), 405, 413, 415, 500 (a kernel that cannot start).

Who may call: the port is reached only through aenv's proxy, which routes by sandbox
id and demands the sandbox's traffic token when the sandbox was created without public
traffic (docs/code-interpreter.md). ``/execute`` runs code, so it demands what envd
demands: the ``X-Access-Token`` the SDK sends with it is checked by envd itself (its
``GET /envs``, which also gives the sandbox's envs: envs.py) before anything else is
done; a secured sandbox answers 401 without it. The context calls carry no token (the
SDK sends none with them) and run no code."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator

from . import protocol
from .context import INTERRUPT_GRACE_SECONDS, CodeContext, ContextError
from .contexts import Contexts, UnknownContext
from .envs import EnvdUnreachable, fetch_envs
from .http import MAX_HEAD, Connection, HttpError, Request, serve_connection

log = logging.getLogger(__name__)


class CodeInterpreterServer:
    def __init__(self, contexts: Contexts, envd_port: int | None = None) -> None:
        self.contexts = contexts
        self.envd_port = envd_port       # None: no envd (tests on a host)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        # set once the default contexts are started and warmed: /health says 200 only then,
        # so a template's ready command cannot freeze a kernel halfway through its warm-up
        self.ready = asyncio.Event()
        self.port = 0
        # the local addresses of this server's own rehearsal connections: the one caller
        # that needs no token (it runs in this process; a pooled clone's envd already has
        # a token no one here knows). Not a secret: a socket address nobody else can own.
        self._rehearsals: set[tuple[str, int]] = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._client, host, port, limit=MAX_HEAD, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def rehearse(self) -> None:
        """One ``run_code("1")`` through this server's own HTTP path as the SDK sends it,
        then the default Python context forgets it (IPython's reset: the user's first cell
        is still number 1, the namespace empty). The first use of that path costs: the
        server's and the kernel's lazy initialisation (done once, before the template is
        frozen) and, in every clone, the guest pages and translated code the path touches
        (done again by ``/health`` on a warm-pool clone, before it is handed out). The
        context is forgotten only if no other cell ran in between."""
        py = await self.contexts.default("python")
        before = py.cells_started
        body = json.dumps({"code": "1"}).encode()
        async with asyncio.timeout(120.0):
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            own = tuple(writer.get_extra_info("sockname")[:2])
            self._rehearsals.add(own)
            try:
                writer.write(b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                answer = await reader.read()
            finally:
                writer.close()
                self._rehearsals.discard(own)
        if b"end_of_execution" not in answer:
            raise OSError(f"the rehearsal cell did not finish: {answer[:200]!r}")
        async with py.lock:
            if py.cells_started == before + 1:
                await py.forget()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(BaseException):
                await t
        await self.contexts.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await serve_connection(reader, writer, self._route)
        except Exception:    # one connection's bug must not be more than that connection's end
            log.exception("connection failed")
        finally:
            self._conns.discard(task)

    async def _route(self, conn: Connection, req: Request) -> None:
        parts = [p for p in req.path.split("/") if p]
        m = req.method
        if parts == ["health"]:
            self._allow(m, "GET", "HEAD")
            ready = self.ready.is_set()
            if ready:
                await self._touch_default()
            return await conn.send_json(200 if ready else 503, "OK" if ready else "starting")
        if parts == ["execute"]:
            self._allow(m, "POST")
            return await self._execute(conn, req)
        if parts == ["contexts"]:
            self._allow(m, "GET", "POST")
            if m == "GET":
                return await conn.send_json(200, [c.describe() for c in self.contexts.all()])
            body = req.json() if req.body.strip() else {}
            spec = protocol.parse_create_context(body)
            try:
                ctx = await self.contexts.create(spec.language, spec.cwd)
            except ContextError as e:
                raise HttpError(400 if "not a directory" in str(e) else 500, str(e)) from None
            return await conn.send_json(200, ctx.describe())
        if len(parts) == 2 and parts[0] == "contexts":
            self._allow(m, "DELETE")
            try:
                await self.contexts.remove(parts[1])
            except UnknownContext:
                raise HttpError(404, f"Context {parts[1][:80]} not found") from None
            return await conn.send(204)
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            self._allow(m, "POST")
            ctx = self._context(parts[1])
            async with ctx.lock:
                try:
                    await ctx.restart()
                except ContextError as e:
                    raise HttpError(500, str(e)) from None
            return await conn.send(204)
        raise HttpError(404, f"no such endpoint: {m} {req.path[:80]}")

    async def _touch_default(self) -> None:
        """When the default Python context is idle: on one no cell has used yet, the
        rehearsal (a warm-pool clone: aenv runs the template's ready command on it, i.e.
        this, so the clone's first real cell finds the path warm: under TCG each QEMU
        translates the guest's code afresh); else one silent round trip."""
        if not self.contexts.has_default("python"):
            return
        ctx = await self.contexts.default("python")
        if ctx.lock.locked():
            return
        if ctx.cells_started == 0:
            with contextlib.suppress(Exception):
                await self.rehearse()
            return
        async with ctx.lock:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10.0):
                    await ctx.touch()

    @staticmethod
    def _allow(method: str, *allowed: str) -> None:
        if method not in allowed:
            raise HttpError(405, f"method {method} not allowed here; use {' or '.join(allowed)}")

    def _context(self, cid: str) -> CodeContext:
        try:
            return self.contexts.get(cid)
        except UnknownContext:
            raise HttpError(404, f"Context {cid[:80]} not found") from None

    async def _authorize(self, conn: Connection, req: Request) -> dict[str, str] | None:
        """The sandbox's envs when envd accepts the request's access token (None when there
        is no envd, or for this server's own rehearsal when envd refuses it); HttpError 401
        when envd refuses the token, 503 when envd cannot be asked (fail closed)."""
        if self.envd_port is None:
            return None
        token = req.headers.get("x-access-token")
        own = tuple(conn.writer.get_extra_info("peername") or ())[:2] in self._rehearsals
        try:
            answer = await fetch_envs(token, self.envd_port)
        except EnvdUnreachable as e:
            if own:
                return None
            raise HttpError(503, f"cannot check the access token: envd does not answer ({e})") from None
        if answer.status == 200:
            return answer.envs
        if own:
            return None
        if answer.refused:
            log.warning("/execute refused: %s access token", "no" if token is None else "a wrong")
            raise HttpError(401, "unauthorized access, please provide a valid access token" if token is None
                            else "invalid access token")
        raise HttpError(503, f"cannot check the access token: envd answered {answer.status}")

    async def _execute(self, conn: Connection, req: Request) -> None:
        # first, before a body is parsed or a kernel started for it
        envs = await self._authorize(conn, req)
        spec = protocol.parse_execute(req.json())
        if spec.context_id is not None:
            ctx = self._context(spec.context_id)
        else:
            try:
                ctx = await self.contexts.default(spec.language or "python")
            except ContextError as e:
                raise HttpError(500, str(e)) from None
        async with ctx.lock:
            ctx.cells_started += 1
            # the sandbox's envs, fetched with a token envd accepted, for a context that
            # has not had them yet; the context marks them applied only when it got them
            events = ctx.execute(spec.code, spec.env_vars, envs if ctx.needs_global_envs else None)
            gone = asyncio.ensure_future(conn.wait_closed_by_peer())
            try:
                await conn.stream(_lines(ctx, events, gone))
            except (ConnectionError, OSError):
                log.info("context %s: the client went away mid-cell; the cell was interrupted", ctx.id)
                raise HttpError(499, "client went away", close=True) from None
            finally:
                gone.cancel()
                with contextlib.suppress(BaseException):
                    await gone
                await events.aclose()   # interrupts the cell if it was still running


async def _lines(ctx: CodeContext, events: AsyncIterator[dict[str, Any]],
                 gone: asyncio.Future[None]) -> AsyncIterator[bytes]:
    """The cell's events as lines. When the client goes away: interrupt the cell, read
    its events to the end (discarded; the cell's finally steps, e.g. restoring envs,
    still run), kill the kernel if it ignores the interrupt for INTERRUPT_GRACE_SECONDS,
    then ConnectionResetError."""
    it = events.__aiter__()
    step = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            waiting: set[asyncio.Future[Any]] = {step, gone}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                break
            try:
                ev = step.result()
            except StopAsyncIteration:
                yield protocol.line(protocol.END)
                return
            yield protocol.line(ev)
            step = asyncio.ensure_future(it.__anext__())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + INTERRUPT_GRACE_SECONDS
        killed = False
        last_sigint = -1.0
        while True:
            left = deadline - loop.time()
            if not killed and left > 0 and loop.time() - last_sigint >= 1.0:
                # again every second: a SIGINT that lands before the kernel has entered the cell
                # is dropped by it (pykernel.Interrupts), as ipykernel drops one before user code
                await ctx.interrupt()
                last_sigint = loop.time()
            done, _ = await asyncio.wait({step}, timeout=max(min(left, 1.0), 0.0))
            if not done and loop.time() < deadline:
                continue
            if not done:
                if killed:
                    raise RuntimeError(f"context {ctx.id}: the cell did not end after its kernel was killed")
                log.warning("context %s: the cell ignored the interrupt; its kernel is killed", ctx.id)
                await ctx.kill()
                killed = True
                deadline += 30.0
                continue
            try:
                step.result()
            except StopAsyncIteration:
                break
            step = asyncio.ensure_future(it.__anext__())
        raise ConnectionResetError("the client closed the connection")
    finally:
        if not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
