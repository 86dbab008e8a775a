"""Create options of E2B's API that aenv does not implement, refused by name.

Unknown body fields stay ignored (schemas.py: newer SDKs add fields), but
these are known and each one changes what the sandbox is: a sandbox started
without its MCP gateway or its workload identity would look created and then
fail later, far from the cause. So a request
that really asks for one (a non-empty value; ``null``, ``{}`` and ``[]`` are
what the SDKs send for "none") is a 400 naming the option. The network
objects' own refusal (``egressProxy``) lives in network.py; secret markers
(envVars, ``network.rules``) are checked against the team's secrets by secret_refs.py.
"""
from __future__ import annotations

from typing import Any

from .errors import ApiError
from .schemas import NewSandbox


def not_supported(option: str, why: str) -> ApiError:
    return ApiError(400, f"{option} is not supported by aenv: {why}", retry=False)


def _iam_tokens(iam: Any) -> bool:
    return isinstance(iam, dict) and bool(iam.get("tokens"))


def reject_unsupported(req: NewSandbox) -> None:
    """ApiError 400 when ``req`` asks for an option aenv does not implement."""
    if req.mcp:
        raise not_supported("mcp", "aenv runs no MCP gateway in sandboxes")
    if _iam_tokens(req.iam) or (isinstance(req.iam, dict) and any(k != "tokens" for k in req.iam)):
        raise not_supported("iam", "aenv issues no workload identity tokens")
