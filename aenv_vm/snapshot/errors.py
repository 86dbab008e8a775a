"""Errors of the snapshot layer."""
from __future__ import annotations

from ..qemu.errors import VmError


class SnapshotError(VmError):
    """A pause, resume, snapshot or fork could not be done."""
