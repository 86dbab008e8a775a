"""The one exception the HTTP layer turns into E2B's error shape, and the
machine-readable code of a sandbox-layer error.

Every error the API answers is JSON ``{"code": <int>, "message": <str>}``
(E2B's ``Error`` schema, aenv_wire/errors.py), the code equal to the HTTP status,
plus ``error_code`` where a client acts on what happened. Handlers raise
``ApiError``; the app's middleware renders it (and anything unexpected as a
500 of the same shape, never a traceback)."""
from __future__ import annotations

from typing import Any

from aenv_vm.errors import (AlreadyHeld, CapacityError, Moved, NodeFenced, NotCommitted, NotMovable, NotPaused,
                            ResumedElsewhere, VmError)
from aenv_wire.cluster import ClusterCode
from aenv_wire.errors import error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra
        # 429/502/503/504 are retried by the SDK unless told otherwise.
        self.retry = extra.pop("retry", None)
        # whole seconds after which a retry may succeed (a Retry-After header; the SDK waits that long)
        self.retry_after: int | None = extra.pop("retry_after", None)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, **self.extra)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


# The codes of the node <-> gateway contract (aenv_wire/cluster.py), by the class of the
# sandbox layer's error (aenv_vm/errors.py); the status is lifecycle.api_error's.
_CODES: tuple[tuple[type[VmError], ClusterCode], ...] = (
    (CapacityError, ClusterCode.FULL),
    (NotCommitted, ClusterCode.NOT_COMMITTED),
    (AlreadyHeld, ClusterCode.ALREADY_HELD),
    (ResumedElsewhere, ClusterCode.RESUMED_ELSEWHERE),
    (NotMovable, ClusterCode.NOT_MOVABLE),
    (NotPaused, ClusterCode.NOT_PAUSED),
    (Moved, ClusterCode.MOVED),
    (NodeFenced, ClusterCode.FENCED),
)


def error_code(e: VmError) -> dict[str, str]:
    """``{"error_code": …}`` for an error the gateway acts on, else ``{}`` (ApiError extras)."""
    for cls, code in _CODES:
        if isinstance(e, cls):
            return {"error_code": code.value}
    return {}
