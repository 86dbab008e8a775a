"""process.Process RPCs over the ProcessManager."""

from __future__ import annotations

import signal
from typing import AsyncGenerator, AsyncIterator

from . import pbjson
from .connect import Code, ConnectError
from .process import EndInfo, Output, Process, ProcessManager, ProcessSpec, PtySize, Subscriber
from .rpc import Handler, Message, RpcContext, get_or_keepalive, is_keepalive

_SIGNALS = {"SIGNAL_SIGTERM": signal.SIGTERM, "SIGNAL_SIGKILL": signal.SIGKILL, 15: signal.SIGTERM, 9: signal.SIGKILL}


def _selector(msg: Message) -> tuple[int | None, str | None]:
    sel = pbjson.get_obj(msg, "process")
    if sel is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "missing process selector")
    if pbjson.raw(sel, "pid") is not None:
        return pbjson.get_uint(sel, "pid"), None
    tag = pbjson.get_opt_str(sel, "tag")
    return None, tag


def _pty_size(msg: Message) -> PtySize | None:
    p = pbjson.get_obj(msg, "pty")
    if p is None:
        return None
    size = pbjson.get_obj(p, "size") or {}
    cols, rows = pbjson.get_uint(size, "cols", 80), pbjson.get_uint(size, "rows", 24)
    if not (0 < cols < 65536 and 0 < rows < 65536):
        raise ConnectError(Code.INVALID_ARGUMENT, f"invalid pty size {cols}x{rows}")
    return PtySize(cols, rows)


def parse_start(msg: Message) -> ProcessSpec:
    cfg = pbjson.get_obj(msg, "process")
    if cfg is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "missing process config")
    cmd = pbjson.get_str(cfg, "cmd")
    if not cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd must not be empty")
    return ProcessSpec(
        cmd=cmd,
        args=tuple(pbjson.get_str_list(cfg, "args")),
        envs=dict(pbjson.get_str_map(cfg, "envs")),
        cwd=pbjson.get_opt_str(cfg, "cwd"),
        tag=pbjson.get_opt_str(msg, "tag"),
        pty=_pty_size(msg),
        # optional, absent means true (older SDKs always had stdin)
        stdin=pbjson.get_bool(msg, "stdin", True),
    )


def _event(ev: Output | EndInfo) -> Message:
    if isinstance(ev, Output):
        return {"event": {"data": {ev.stream: pbjson.b64(ev.data)}}}
    end: Message = {"exited": ev.exited, "status": ev.status}
    if ev.exit_code:
        end["exitCode"] = ev.exit_code
    if ev.error is not None:
        end["error"] = ev.error
    return {"event": {"end": end}}


class ProcessService:
    def __init__(self, manager: ProcessManager) -> None:
        self.m = manager

    def handlers(self) -> dict[str, Handler]:
        p = "/process.Process/"
        return {
            p + "List": self.list, p + "Start": self.start, p + "Connect": self.connect,
            p + "Update": self.update, p + "StreamInput": self.stream_input,
            p + "SendInput": self.send_input, p + "SendSignal": self.send_signal,
            p + "CloseStdin": self.close_stdin,
        }

    async def list(self, msg: Message, ctx: RpcContext) -> Message:
        return {"processes": [p.info() for p in self.m.list()]}

    async def _follow(self, proc: Process, sub: Subscriber, ctx: RpcContext) -> AsyncGenerator[Message, None]:
        try:
            yield {"event": {"start": {"pid": proc.pid}}}
            while True:
                item = await get_or_keepalive(sub.queue, ctx.keepalive_s)
                if is_keepalive(item):
                    yield {"event": {"keepalive": {}}}
                    continue
                yield _event(item)
                if isinstance(item, EndInfo):
                    return
        finally:
            proc.unsubscribe(sub)

    async def start(self, msg: Message, ctx: RpcContext) -> AsyncGenerator[Message, None]:
        spec = parse_start(msg)
        proc, sub = self.m.start(spec, ctx.user(), ctx.timeout_s)
        async for out in self._follow(proc, sub, ctx):
            yield out

    async def connect(self, msg: Message, ctx: RpcContext) -> AsyncGenerator[Message, None]:
        # Like upstream: no replay of earlier output, stream from now on.
        proc = self.m.find(*_selector(msg))
        sub = proc.subscribe()
        async for out in self._follow(proc, sub, ctx):
            yield out

    async def update(self, msg: Message, ctx: RpcContext) -> Message:
        proc = self.m.find(*_selector(msg))
        size = _pty_size(msg)
        if size is not None:
            proc.resize(size)
        return {}

    async def _input(self, proc: Process, inp: Message | None) -> None:
        if inp is None:
            return
        stdin = pbjson.get_bytes(inp, "stdin")
        if stdin is not None:
            await proc.write_input(stdin, pty_input=False)
        data = pbjson.get_bytes(inp, "pty")
        if data is not None:
            await proc.write_input(data, pty_input=True)

    async def send_input(self, msg: Message, ctx: RpcContext) -> Message:
        proc = self.m.find(*_selector(msg))
        await self._input(proc, pbjson.get_obj(msg, "input"))
        return {}

    async def stream_input(self, msgs: AsyncIterator[Message], ctx: RpcContext) -> Message:
        proc = None
        async for msg in msgs:
            start = pbjson.get_obj(msg, "start")
            data = pbjson.get_obj(msg, "data")
            if start is not None:
                proc = self.m.find(*_selector(start))
            elif data is not None:
                if proc is None:
                    raise ConnectError(Code.FAILED_PRECONDITION, "input stream must begin with a start event")
                await self._input(proc, pbjson.get_obj(data, "input"))
        return {}

    async def send_signal(self, msg: Message, ctx: RpcContext) -> Message:
        proc = self.m.find(*_selector(msg))
        value = pbjson.raw(msg, "signal")
        sig = _SIGNALS.get(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {pbjson.raw(msg, 'signal')!r}")
        proc.signal(sig)
        return {}

    async def close_stdin(self, msg: Message, ctx: RpcContext) -> Message:
        self.m.find(*_selector(msg)).close_stdin()
        return {}
