"""The two answer shapes every handler module uses: a compact JSON body, and 204."""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(value, separators=(",", ":")).encode(),
                        content_type="application/json", headers=headers)


def no_content() -> web.Response:
    return web.Response(status=204)
