"""Serving with aiohttp: E2B's JSON error shape for requests aiohttp's HTTP parser
rejects itself (``JsonErrorRunner``), and the port a site bound (``bound_port``).

A malformed request line, a NUL or otherwise invalid header, an oversize
request line or header, too many headers: aiohttp answers those before any
middleware runs, from ``RequestHandler.handle_error``, as ``text/plain``.
``JsonErrorHandler`` overrides that one method so they are ``{"code",
"message"}`` JSON too, with the status that says what was wrong:

- 414 URI Too Long: the request line is over ``MAX_LINE`` bytes;
- 431 Request Header Fields Too Large: a header line is over ``MAX_FIELD``
  bytes, or there are more than aiohttp's 128 headers;
- 400: everything else the parser refuses (the parser's reason in the message);
- 500: an exception that escaped the app (the middleware lets none through, so
  this is a last resort; no traceback is ever sent).

Bodies that turn out malformed later (bad chunked framing after the headers
were handled) must surface while a handler reads them, and the app's
middleware maps those (``HttpProcessingError``) to 400 JSON. aiohttp's C
parser instead queues such an error as a next message and leaves the body of
the request being handled waiting forever: ``data_received`` hands the error
to that body.

aiohttp builds its ``RequestHandler`` inside ``web.Server.__call__`` with no
factory hook, so ``JsonErrorRunner`` gives the ``Server`` it makes a subclass
whose ``__call__`` builds ``JsonErrorHandler`` (the subclass adds no state).
"""
from __future__ import annotations

import json
import secrets
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_request import BaseRequest

from aenv_wire.errors import error_body
from aenv_wire.headers import REQUEST_ID_HEADER

# Request lines up to 64 KiB (the list filters' own limits then answer in JSON, schemas.py);
# header lines one byte less: the limit a LineTooLong reports then tells which one overflowed.
MAX_LINE = 64 << 10
MAX_FIELD = MAX_LINE - 1

# (status, message) of a rejected request, for the server's request log.
RejectLog = Callable[[str, int, str], None]


def parser_reason(exc: HttpProcessingError) -> str:
    """The first line of the parser's message (the rest is a picture of the bytes)."""
    text = (exc.message or "").strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def reject_status(exc: BaseException | None, status: int) -> tuple[int, str]:
    """The status and message a request the parser refused gets. Pure."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        if limit == MAX_LINE:
            return 414, f"the request line is longer than {MAX_LINE} bytes"
        return 431, f"a request header line is longer than {MAX_FIELD} bytes"
    if isinstance(exc, HttpProcessingError):
        text = parser_reason(exc)
        if "Too many headers" in text:
            return 431, "too many request headers"
        return 400, f"malformed HTTP request: {text}"
    if status >= 500:
        return 500, "internal error"
    return status, "malformed HTTP request"


class JsonErrorHandler(RequestHandler):
    on_reject: RejectLog | None = None

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued and self._current_request is not None:
            msg = self._messages[-1][0]
            body = self._current_request.content
            if isinstance(msg, _ErrInfo) and not body.is_eof() and body.exception() is None:
                body.set_exception(msg.exc if msg.exc is not None else HttpProcessingError(message=msg.message))

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: the response is under way, only a cut is left
            raise ConnectionError("response already started, cannot send an error response")
        code, text = reject_status(exc, status)
        rid = secrets.token_hex(8)
        resp = web.Response(status=code, text=json.dumps(error_body(code, text)),
                            content_type="application/json", headers={REQUEST_ID_HEADER: rid})
        resp.force_close()  # the stream position after a framing error is unknown
        if self.on_reject is not None:
            self.on_reject(rid, code, text)
        return resp


class _JsonErrorServer(web.Server):
    on_reject: RejectLog | None = None

    def __call__(self) -> RequestHandler:
        handler = JsonErrorHandler(self, loop=self._loop, **self._kwargs)
        handler.on_reject = self.on_reject
        return handler


class JsonErrorRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parser rejections in JSON."""

    def __init__(self, app: web.Application, *, on_reject: RejectLog | None = None, **kwargs: object) -> None:
        super().__init__(app, **kwargs)  # type: ignore[arg-type]  # AppRunner's keyword options, passed on as given
        self._on_reject = on_reject

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer
        server.on_reject = self._on_reject  # type: ignore[attr-defined]  # the class was swapped on the line above
        return server


def bound_port(site: web.TCPSite, asked: int) -> int:
    """The port ``site`` listens on (``asked`` 0 picks a free one; aiohttp's TCPSite has
    no public way to read it)."""
    sockets = getattr(site._server, "sockets", None) or []
    return sockets[0].getsockname()[1] if sockets else asked
