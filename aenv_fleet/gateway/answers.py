"""What the gateway answers with: its own errors (E2B's ``{"code", "message"}`` body),
JSON, and a node's answer relayed (the node's status, body and end-to-end headers; the
node it came from in ``X-Aenv-Node``)."""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from aenv_wire.errors import error_body

from .forward import Answer

NODE_HEADER = "X-Aenv-Node"     # which node answered (placement, relayed answers)
# a node's answer's headers that belong to its own connection, not to the client's
_HOP = ("content-length", "transfer-encoding", "connection", "keep-alive", "date", "server")


def error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> web.Response:
    return web.Response(status=status, text=json.dumps(error_body(status, message, **extra)),
                        content_type="application/json", headers=headers)


def json_answer(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload), content_type="application/json", headers=headers)


def relay(a: Answer, node_id: str | None = None, passed: tuple[str, ...] | None = None) -> web.Response:
    """A node's answer as the client's: its headers but the hop-by-hop ones (``passed``:
    only these, lower-case), and ``X-Aenv-Node`` when ``node_id`` is given."""
    headers = {k: v for k, v in a.headers.items()
               if (k.lower() in passed if passed is not None else k.lower() not in _HOP)}
    if node_id is not None:
        headers[NODE_HEADER] = node_id
    return web.Response(status=a.status, body=a.body, headers=headers)
