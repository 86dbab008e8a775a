"""Errors of the QEMU driver (all ``aenv_vm.errors.VmError``: internal failures,
answered as server errors)."""
from __future__ import annotations

from ..errors import VmError


class QemuNotFound(VmError):
    """The QEMU binary (or qemu-img) is not installed or not executable."""


class QemuExited(VmError):
    """The QEMU process ended (or failed to start); the message carries its log tail."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr


class QmpError(VmError):
    """QEMU answered a QMP command with an error."""

    def __init__(self, command: str, error_class: str, desc: str) -> None:
        super().__init__(f"QMP {command} failed: {error_class}: {desc}")
        self.command = command
        self.error_class = error_class
        self.desc = desc


class QmpProtocolError(VmError):
    """The QMP byte stream is not valid QMP (bad JSON, wrong shape, oversized)."""


class QmpConnectionError(VmError):
    """The QMP connection could not be made or was lost."""
