"""The gateway's own error: answered as E2B's ``{"code", "message"}`` JSON."""
from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra
