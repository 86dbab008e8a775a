"""Which requests are sandbox traffic, and for which sandbox and port.

A request is sandbox traffic (the proxy's, not the control plane's) when it names a
sandbox by

* the ``E2b-Sandbox-Id`` header (port in ``E2b-Sandbox-Port``, default envd's), or
  AgentENV's ``X-Agentenv-Sandbox-Id`` / ``X-Agentenv-Target-Port`` (its ``/proxy``
  path prefix is taken off such header-routed requests);
* a host ``<port>-<sandboxID>.<domain>`` when the deployment has a domain;
* or, naming no sandbox, a signed file URL (``/files?…&signature=…``, what the SDK
  builds on ``E2B_SANDBOX_URL``): its signature says which sandbox (envd/signing.py
  verifies it; this module only recognises the shape);
* or, naming no sandbox, an envd call carrying an envd access token (what E2B SDKs
  2.7 to 2.10 send on ``E2B_SANDBOX_URL`` for a sandbox they connected to): the
  token says which sandbox (the node finds the secured sandbox it belongs to).

Headers are given as a case-insensitive mapping (what the HTTP layer parsed).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from .errors import BadRoute
from .headers import (ACCESS_TOKEN_HEADER, AGENTENV_ID_HEADER, AGENTENV_PORT_HEADER, API_KEY_HEADER, SANDBOX_ID_HEADER,
                      SANDBOX_PORT_HEADER)

PROXY_PREFIX = "/proxy"        # AgentENV's: ``/proxy/<path>`` is forwarded as ``/<path>``
FILES_PATH = "/files"          # envd's file transfer path (signed URLs)
ENVD_RPC_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")   # envd's Connect services
SIGNATURE_PARAM = "signature"


class SandboxAddress(NamedTuple):
    sandbox_id: str
    port: int


def parse_host(host: str, domain: str) -> SandboxAddress | None:
    """``(sandbox id, port)`` of a ``<port>-<id>.<domain>[:p]`` host, else None."""
    if not domain or not host:
        return None
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    suffix = "." + domain.lower()
    if not name.lower().endswith(suffix):
        return None
    label = name[: -len(suffix)]
    port, sep, sid = label.partition("-")
    if not sep or not sid or "." in sid or not (port.isascii() and port.isdigit()):
        return None
    return SandboxAddress(sid, int(port))


def has_routing_header(headers: Mapping[str, str]) -> bool:
    return SANDBOX_ID_HEADER in headers or AGENTENV_ID_HEADER in headers


def routed_sandbox_id(headers: Mapping[str, str]) -> str | None:
    """The sandbox a routing header names (E2B's first, then AgentENV's), as sent."""
    sid = headers.get(SANDBOX_ID_HEADER)
    return sid if sid is not None else headers.get(AGENTENV_ID_HEADER)


def is_unrouted_envd_call(path: str, headers: Mapping[str, str]) -> bool:
    """An envd call that names no sandbox but carries an envd access token: a Connect
    RPC of envd's process or filesystem service, or ``/files``. E2B SDKs 2.7 to 2.10
    send a connected sandbox's calls to ``E2B_SANDBOX_URL`` with its token and without
    the routing headers (they set those on created sandboxes only)."""
    return bool(headers.get(ACCESS_TOKEN_HEADER)) and (path.startswith(ENVD_RPC_PREFIXES) or path == FILES_PATH)


def is_sdk_connect(method: str, path: str, headers: Mapping[str, str]) -> bool:
    """An E2B SDK's connect call that carries the routing headers: SDKs 2.7 to 2.2x put
    ``E2b-Sandbox-Id``/``-Port`` on the API client they connect with (E2B's API is on
    another host than its sandboxes, and ignores them), so on a deployment that serves
    both on one address ``POST /sandboxes/<id>/connect`` with the API key and that very
    sandbox's routing header is the control plane's, not traffic for the sandbox."""
    if method != "POST" or API_KEY_HEADER not in headers:
        return False
    sid = headers.get(SANDBOX_ID_HEADER)
    return sid is not None and path == f"/sandboxes/{sid.strip()}/connect"


def has_proxy_prefix(path: str) -> bool:
    return path == PROXY_PREFIX or path.startswith(PROXY_PREFIX + "/")


def is_unrouted_signed_url(path: str, query: Mapping[str, str]) -> bool:
    """A signed file URL that names no sandbox (the SDK's ``download_url``/``upload_url``
    on ``E2B_SANDBOX_URL``): ``/files`` with a ``signature`` query parameter."""
    return path == FILES_PATH and SIGNATURE_PARAM in query


def sandbox_route(headers: Mapping[str, str], host: str, path: str, domain: str,
                  default_port: int) -> SandboxAddress | None:
    """Where sandbox traffic goes, or None for a control-plane request (and for a signed
    URL naming no sandbox: ``is_unrouted_signed_url``); ``default_port`` (envd's) when a
    routing header names no port. BadRoute on a port that is not one, an empty routing
    header, and a ``/proxy`` path that names no sandbox."""
    sid = routed_sandbox_id(headers)
    if sid is not None:
        name = AGENTENV_PORT_HEADER if AGENTENV_PORT_HEADER in headers else SANDBOX_PORT_HEADER
        raw = headers.get(name, str(default_port))
        # ASCII digits only: str.isdigit() takes "²", which int() does not
        if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) < 65536:
            raise BadRoute(f"{name} must be a port number, got {raw[:20]!r}")
        if not sid.strip():
            raise BadRoute("the sandbox routing header is empty: it names the sandbox the request is for")
        return SandboxAddress(sid.strip(), int(raw))
    route = parse_host(host, domain)
    if route is None and has_proxy_prefix(path):
        raise BadRoute(f"missing sandbox routing header: {PROXY_PREFIX} paths need {AGENTENV_ID_HEADER} "
                       f"(or {SANDBOX_ID_HEADER})")
    return route
