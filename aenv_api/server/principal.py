"""Who a control-plane request is (set by the server once its credential checks out,
teams_api.py ``authenticate``), for the handlers that scope what they show by team."""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from .errors import ApiError

BAD_KEY = "Invalid API key: send the server's key, once, in the X-API-Key header"
PRINCIPAL = "principal"     # where the server keeps a request's Principal (request[PRINCIPAL])


@dataclass(frozen=True)
class Principal:
    """A team's key, or the admin (acting for ``team_id`` on the routes that take
    X-Team-ID; ``""`` on the admin-only routes)."""

    team_id: str
    api_key: str        # the key it presented ("" for the admin): GET /teams shows it back
    admin: bool = False


def principal_of(request: web.Request) -> Principal:
    p = request.get(PRINCIPAL)
    if not isinstance(p, Principal):    # a route without auth has none; no team-scoped route is such
        raise ApiError(401, BAD_KEY)
    return p
