"""Create options of E2B's API that aenv does not implement, refused by name.

Unknown body fields stay ignored (schemas.py: newer SDKs add fields), but
these are known and each one changes what the sandbox is: a sandbox started
without its MCP gateway, its workload identity or its secrets would look
created and then fail later, far from the cause. So a request
that really asks for one (a non-empty value; ``null``, ``{}`` and ``[]`` are
what the SDKs send for "none") is a 400 naming the option. The network
objects' own refusals (``egressProxy``, ``rules``) live in network.py.
"""
from __future__ import annotations

from typing import Any

from .errors import ApiError
from .schemas import NewSandbox

# E2B's secret placeholder (the SDK's ``Secret.fill``): resolved by E2B's runtime, a
# literal string here.
SECRET_PLACEHOLDER = "${e2b.secrets."


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
    for name, value in (req.env_vars or {}).items():
        if SECRET_PLACEHOLDER in value:
            raise not_supported(f"envVars.{name[:64]}: a secret placeholder",
                                "aenv keeps no secrets; the sandbox would see the placeholder text")
