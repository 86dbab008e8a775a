"""Rotating a running sandbox's client token (``POST /sandboxes/{id}/rotate-token``; the
token model is access_tokens.py's). Beside the lifecycle, not in access_tokens.py: this
module uses the lifecycle, which uses the derivations there."""
from __future__ import annotations

from aenv_vm.errors import VmError
from aenv_vm.states import Op

from .access_tokens import GENERATION_ANNOTATION, BadGeneration, generation_of
from .errors import ApiError
from .lifecycle import Lifecycle, api_error
from .views import SandboxView


async def rotate(lc: Lifecycle, sid: str) -> SandboxView:
    """A new client token for running sandbox ``sid`` (``POST /sandboxes/{id}/rotate-token``):
    its generation goes up by one in its record, and the proxy forgets the old token at once.
    409 for a paused sandbox (the table's refusal: its record is the one its pause committed;
    connect first) and for one that is not secured (no token to rotate)."""
    view = await lc.get(sid)
    lc.check_op(view, Op.ANNOTATE)
    if not view.secure:
        raise ApiError(409, f"sandbox {sid} is not secured: it has no envd access token to rotate")
    info = await lc.service.get(sid)
    try:
        generation = generation_of(info.annotations) + 1
    except BadGeneration as e:
        raise ApiError(500, f"sandbox {sid}: {e}") from None
    try:
        info = await lc.service.annotate(sid, {GENERATION_ANNOTATION: str(generation)})
    except VmError as e:
        raise api_error(e, f"token rotation of {sid}") from None
    finally:        # whatever happened, the proxy reads the record afresh
        lc.forget_tokens(sid)
    lc.logs.event(sid, "envd access token rotated", generation=generation)
    return lc.view_of(info)
