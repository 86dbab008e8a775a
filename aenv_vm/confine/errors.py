"""Errors of QEMU confinement (``aenv_vm.errors.VmError``: answered as server errors)."""
from __future__ import annotations

from ..errors import VmError


class ConfinementError(VmError):
    """A QEMU cannot be confined as configured (``[vm] confine = "required"`` on a host
    that lacks a part, or a jail that could not be set up)."""
