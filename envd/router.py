"""Request routing, as a pure function of method, path and content type."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    UNARY = "unary"
    SERVER_STREAM = "server_stream"
    CLIENT_STREAM = "client_stream"
    HTTP = "http"


RPC_METHODS: dict[str, Kind] = {
    "/process.Process/List": Kind.UNARY,
    "/process.Process/Start": Kind.SERVER_STREAM,
    "/process.Process/Connect": Kind.SERVER_STREAM,
    "/process.Process/Update": Kind.UNARY,
    "/process.Process/StreamInput": Kind.CLIENT_STREAM,
    "/process.Process/SendInput": Kind.UNARY,
    "/process.Process/SendSignal": Kind.UNARY,
    "/process.Process/CloseStdin": Kind.UNARY,
    "/filesystem.Filesystem/Stat": Kind.UNARY,
    "/filesystem.Filesystem/MakeDir": Kind.UNARY,
    "/filesystem.Filesystem/Move": Kind.UNARY,
    "/filesystem.Filesystem/ListDir": Kind.UNARY,
    "/filesystem.Filesystem/Remove": Kind.UNARY,
    "/filesystem.Filesystem/WatchDir": Kind.SERVER_STREAM,
    "/filesystem.Filesystem/CreateWatcher": Kind.UNARY,
    "/filesystem.Filesystem/GetWatcherEvents": Kind.UNARY,
    "/filesystem.Filesystem/RemoveWatcher": Kind.UNARY,
}

HTTP_ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/metrics": ("GET",),
    "/envs": ("GET",),
    "/init": ("POST",),
    "/files": ("GET", "POST"),
}

# Paths that never need the access token: liveness probes must work before
# /init and from callers that do not hold it.
PUBLIC_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class Route:
    path: str
    kind: Kind


@dataclass(frozen=True)
class RouteError:
    """A request answered without reaching a handler."""

    status: int
    connect_code: str | None  # Connect code for RPC paths, None for plain HTTP
    message: str
    allow: str | None = None


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def route(method: str, path: str, content_type: str | None) -> Route | RouteError:
    kind = RPC_METHODS.get(path)
    if kind is not None:
        if method != "POST":
            return RouteError(405, "unimplemented", f"{method} not allowed on {path}", allow="POST")
        ct = media_type(content_type)
        expected = "application/json" if kind is Kind.UNARY else "application/connect+json"
        if ct != expected:
            return RouteError(
                415, "invalid_argument", f"unsupported content-type {ct!r} for {path}, expected {expected!r}"
            )
        return Route(path, kind)
    if path.startswith(("/process.Process/", "/filesystem.Filesystem/")):
        return RouteError(404, "unimplemented", f"unknown method {path}")
    methods = HTTP_ROUTES.get(path)
    if methods is None:
        return RouteError(404, None, f"no route for {path}")
    if method not in methods and not (method == "HEAD" and "GET" in methods):
        return RouteError(405, None, f"{method} not allowed on {path}", allow=", ".join(methods))
    return Route(path, Kind.HTTP)
