"""The gateway's own errors: answered as E2B's ``{"code", "message"}`` JSON."""
from __future__ import annotations

from typing import Any

from aenv_wire.cluster import ClusterCode


class GatewayError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra, self.headers = status, message, extra, headers


class SandboxLost(GatewayError):
    """No node holds the sandbox and the repository has no pause of it: 410, state lost."""

    def __init__(self, sandbox_id: str, note: str) -> None:
        super().__init__(410, f"sandbox {sandbox_id} was lost: {note}", error_code=ClusterCode.LOST.value,
                         sandboxId=sandbox_id, state="lost")
