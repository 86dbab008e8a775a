"""The node <-> gateway contract of a fleet: the ``/_aenv/cluster`` routes every node
serves, and the machine-readable codes of the answers the gateway acts on.

Moving a paused sandbox between nodes that share one repository takes two routes
on the nodes (docs/cluster.md, docs/api.md "Moving sandboxes"):

* ``POST /_aenv/cluster/sandboxes/{sandboxID}/release`` on the node that holds it:
  204 released (paused, kept in the repository for another node);
* ``POST /_aenv/cluster/sandboxes/{sandboxID}/adopt[?force=true]`` on the node that
  takes it over: 200 and E2B's ``ListedSandbox`` (paused, on that node now).

A gateway finds the sandbox of a signed ``/files`` URL that names none with
``GET /_aenv/cluster/signed-owner?path=&username=&signature=&signature_expiration=&method=``:
200 ``{"sandboxID": ...}`` from the node whose sandbox made the signature, 401 elsewhere.

A refusal is E2B's error body with ``error_code`` set to a ``ClusterCode`` (the same
codes mark the E2B routes' answers the gateway acts on: a full node's 429, a stale
copy's 409). The gateway decides by the code, never by the message: messages are for
people and may change. Nodes and gateways of one fleet run the same version of aenv.
"""
from __future__ import annotations

import enum
import urllib.parse
from typing import Mapping

from .errors import read_error

PREFIX = "/_aenv/cluster"
ADOPT_ROUTE = PREFIX + "/sandboxes/{sandboxID}/adopt"        # the route tables' (OpenAPI) form
RELEASE_ROUTE = PREFIX + "/sandboxes/{sandboxID}/release"
FORCE_PARAM = "force"
# Which sandbox on this node a signed /files URL naming no sandbox is for (a gateway asks
# before it streams the request to that node): the URL's path, username, signature and
# signature_expiration, plus the request's method (the signature covers read or write).
SIGNED_OWNER_ROUTE = PREFIX + "/signed-owner"
SIGNED_PARAMS = ("path", "username", "signature", "signature_expiration")
METHOD_PARAM = "method"


def signed_owner_path(method: str, query: Mapping[str, str]) -> str:
    """The request target asking a node which of its sandboxes signed ``query``."""
    params = {k: query[k] for k in SIGNED_PARAMS if k in query}
    return SIGNED_OWNER_ROUTE + "?" + urllib.parse.urlencode({**params, METHOD_PARAM: method})


def adopt_path(sandbox_id: str, force: bool = False) -> str:
    """The request target of an adopt of ``sandbox_id``; ``force``: its holder is known to
    be gone, so a resume of it there after its last pause does not stop the adopt."""
    path = ADOPT_ROUTE.format(sandboxID=urllib.parse.quote(sandbox_id, safe=""))
    return path + f"?{FORCE_PARAM}=true" if force else path


def release_path(sandbox_id: str) -> str:
    return RELEASE_ROUTE.format(sandboxID=urllib.parse.quote(sandbox_id, safe=""))

# Retry-After (seconds) of a full node's 429, and of the gateway's when every node is full
# (``Should-Retry: false``): room comes when somebody kills a sandbox, which nothing can
# foresee; a harness that polls this often is cheap to answer. A node whose restore queue
# is long says instead when a restore would fit (``Should-Retry: true``).
FULL_RETRY_AFTER = 5


class ClusterCode(enum.StrEnum):
    """What a node's (or the gateway's) refusal means, in E2B's ``error_code`` field.

    The values read as E2B's own codes do (``sandbox_capacity_unavailable`` is E2B's),
    since a client may see them when the gateway relays an answer."""

    # 429 on a create, resume, fork or adopt: this node has no room for it now (next node)
    FULL = "sandbox_capacity_unavailable"
    # 404 on adopt: the repository has no committed pause of it (yet: a pause commits in
    # the background; a node that died inside the commit never finishes it)
    NOT_COMMITTED = "sandbox_pause_not_committed"
    # 409 on adopt: this node holds it already (an adopt that raced, or was retried)
    ALREADY_HELD = "sandbox_already_held"
    # 409 on adopt: its holder resumed it after the pause; adopt with force only if that node is gone
    RESUMED_ELSEWHERE = "sandbox_resumed_elsewhere"
    # 409 on adopt or release: it cannot change nodes (volume mounts, its record's format,
    # its template gone)
    NOT_MOVABLE = "sandbox_not_movable"
    # 404 on release: this node does not hold it
    NOT_HELD = "sandbox_not_held"
    # 409 on release: it is not paused here (running, or lost): only a paused sandbox moves
    NOT_PAUSED = "sandbox_not_paused"
    # 409 on resume or connect: this node's copy is stale, another node holds it now
    MOVED = "sandbox_moved"
    # 410 from the gateway: no node holds it and the repository has no pause of it
    LOST = "sandbox_lost"
    # 503 on a create, resume or adopt: this node lost its fleet lease and starts nothing
    # until it renews and has recovered (docs/cluster.md "Fencing"): next node
    FENCED = "sandbox_node_fenced"


def answer_code(body: bytes) -> ClusterCode | None:
    """The code an answer's body carries (None: no code, or not an error body)."""
    err = read_error(body)
    if err is None or err.error_code is None:
        return None
    try:
        return ClusterCode(err.error_code)
    except ValueError:
        return None
