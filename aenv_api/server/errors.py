"""The one exception the HTTP layer turns into E2B's error shape.

Every error the API answers is JSON ``{"code": <int>, "message": <str>}``
(E2B's ``Error`` schema), the code equal to the HTTP status. Handlers raise
``ApiError``; the app's middleware renders it (and anything unexpected as a
500 of the same shape, never a traceback)."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra
        # 429/502/503/504 are retried by the SDK unless told otherwise.
        self.retry = extra.pop("retry", None)

    def body(self) -> dict[str, Any]:
        return {"code": self.status, "message": self.message, **self.extra}


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)
