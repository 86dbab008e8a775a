"""The errors of the VM layer, one hierarchy for every module in it.

``VmError`` is the base of everything aenv_vm raises on purpose. Its direct
subclasses below say *how* an operation failed, which is what a caller acts
on; the API layer maps them to HTTP status by class (aenv_api/server/
lifecycle.py), the CLI prints the message. Errors of one part of the VM layer
that are internal failures (QEMU exited, envd answered nonsense, a memory
image is corrupt...) derive from ``VmError`` directly in their own module and
are answered as server errors.
"""
from __future__ import annotations


class VmError(Exception):
    """Base of the errors raised by aenv_vm."""


class NotFound(VmError):
    """No such sandbox, template or snapshot."""


class Conflict(VmError):
    """The thing exists but is in the wrong state for the operation (not running,
    already exists, still in use)."""


class BadRequest(VmError):
    """An argument is out of range or malformed (fork count, negative timeout...)."""


class Unsupported(VmError):
    """This node cannot do the operation at all (a mode or feature it lacks)."""


class CapacityError(VmError):
    """The node is full: no more sandboxes fit now (try another node or later)."""


class AdmissionRefused(CapacityError):
    """The node's restore queue cannot take another restore now (aenv_vm/machine/
    admission.py): retry after ``retry_after`` seconds, here or on another node."""

    def __init__(self, message: str, *, reason: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason = reason                # "queue" (max_queue) or "wait" (max_wait)
        self.retry_after = retry_after      # whole seconds, at least 1


class NodeFenced(VmError):
    """This fleet node could not renew its lease: it has stopped its running sandboxes
    and starts none until it renews (docs/cluster.md, "Fencing"); retry after
    ``retry_after`` seconds, or through a gateway, which places it elsewhere."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class VmTimeout(VmError):
    """A VM did not reach the awaited state in time."""


class SnapshotError(VmError):
    """A pause, resume, snapshot or fork failed on the node's side (a server error)."""


class GuestUnresponsive(VmError):
    """The sandbox's envd does not answer, and the operation needs it to (a strict or a
    filesystem-only pause): nothing was done, the sandbox keeps running."""


class UnresponsiveSnapshot(Conflict):
    """The pause was taken while the guest's envd did not answer: restoring its memory
    would bring that guest back, so it resumes only by cold boot (``memory=False``)."""


class Moved(Conflict):
    """The sandbox's latest pause in the shared repository was made, or taken over, by
    another node: what this node holds of it is stale and is neither resumed nor committed
    (release it; the other node resumes it)."""


# Why a paused sandbox cannot move between nodes sharing one repository (handover.py);
# the API gives each its code of the fleet's contract (aenv_wire/cluster.py).

class NotCommitted(NotFound):
    """The shared repository has no committed pause of the sandbox (none was made, or its
    background commit has not finished, or the node making it died inside the commit)."""


class AlreadyHeld(Conflict):
    """This node holds the sandbox already: there is nothing to adopt."""


class ResumedElsewhere(Conflict):
    """The node that holds the sandbox resumed it after its last pause (it may be running
    there): it moves only when that node is known to be gone (adopt with force)."""


class NotMovable(Conflict):
    """The sandbox cannot change nodes at all: volumes mounted (directories of one node),
    a pause record this node cannot read, or its template gone."""


class NotPaused(Conflict):
    """Only a paused sandbox moves: this one is running here (or lost)."""
