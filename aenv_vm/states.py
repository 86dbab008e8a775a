"""The sandbox state machine as one pure table (the model is h11's ``_state.py``).

A sandbox is in one ``Phase``: its record's coarse state (running, paused, lost; see
``aenv_vm.service.SandboxState``) refined by how it was paused, plus ``GONE`` for an id
this node does not hold (never created, killed, released). Each ``Op`` that the
sandbox layer or the API applies to one sandbox has, in every phase, exactly one
``Outcome`` in ``TABLE``: allowed (and the phase it leads to), a no-op (the sandbox is
already where the operation leads), or refused with an error class of
``aenv_vm.errors`` and its message. ``transition`` reads it; ``check`` raises the
refusal. The node (sandboxes/manager.py, sandboxes/node_service.py), the in-memory
``FakeSandboxService`` and the API (aenv_api/server/lifecycle.py) consult it instead of
testing record fields themselves, so they cannot disagree.

What the table does not decide, because it is not a state: whether the guest's agent
answers (a strict or filesystem-only pause needs it: ``GuestUnresponsive`` from the
probe), capacity (``CapacityError``), argument ranges (``BadRequest``), whether a pause
may move to another node (volume mounts, its template: sandboxes/handover.py), and the
background commit of a pause, which operations that need it wait for. A node restart
moves running records to ``PAUSED`` (a committed pause to resume from) or ``LOST``
(sandboxes/recovery.py).

Where the API and the node disagreed, E2B's API decides (its SDKs and OpenAPI
document): a pause of a paused sandbox and a resume of a running one are refused
(409), not no-ops; ``connect`` of a running sandbox is the no-op (it only extends the
TTL).

No I/O here, and nothing imported but the standard library and ``aenv_vm.errors``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import AlreadyHeld, Conflict, NotFound, NotPaused, UnresponsiveSnapshot, VmError

__all__ = ["Phase", "PAUSED_PHASES", "Op", "Verdict", "Outcome", "TABLE", "phase_of", "coarse", "transition",
           "check"]


class Phase(str, enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"                           # memory kept: resumes by restoring it
    PAUSED_FILESYSTEM = "paused-filesystem"     # filesystem only: the next resume boots from its disk
    PAUSED_UNRESPONSIVE = "paused-unresponsive" # memory kept while envd did not answer: resumes only by boot
    LOST = "lost"                               # found dead at start with no pause to resume from
    GONE = "gone"                               # not held here: never made, killed, or released


PAUSED_PHASES = frozenset({Phase.PAUSED, Phase.PAUSED_FILESYSTEM, Phase.PAUSED_UNRESPONSIVE})


class Op(str, enum.Enum):
    CREATE = "create"                       # a new sandbox under this id
    GET = "get"                             # its record (get, list)
    KILL = "kill"
    PAUSE = "pause"                         # keep memory (require_healthy: also refused by the probe)
    PAUSE_FILESYSTEM = "pause-filesystem"   # keep only the filesystem (always needs envd)
    PAUSE_UNRESPONSIVE = "pause-unresponsive"   # a memory pause that found envd not answering: marked
    RESUME = "resume"                       # restore its memory (boots where no memory was kept)
    RESUME_BOOT = "resume-boot"             # boot from its disk (E2B's on_resume="reboot")
    CONNECT = "connect"                     # the API's connect: resume if paused, else the TTL only
    CONNECT_BOOT = "connect-boot"           # connect with on_resume="reboot"
    AUTO_RESUME = "auto-resume"             # traffic to a paused sandbox created with autoResume
    SET_TIMEOUT = "set-timeout"
    UPDATE_NETWORK = "update-network"
    ANNOTATE = "annotate"                   # change the layer above's fields in its record
    SNAPSHOT = "snapshot"
    FORK = "fork"
    FORK_PAUSE = "fork-pause"               # new sandboxes from its last pause (it stays paused)
    ENDPOINT = "endpoint"                   # where a guest port is reached (the proxy)
    USAGE = "usage"                         # host-side resource use of its VM
    CONSOLE = "console"
    METRICS = "metrics"                     # its samples (kept across pauses)
    ADOPT = "adopt"                         # take over its pause from the shared repository
    RELEASE = "release"                     # forget its pause here, for another node to adopt


class Verdict(str, enum.Enum):
    ALLOWED = "allowed"     # do it; the sandbox is in ``next`` afterwards
    NOOP = "no-op"          # nothing to do: answer as a success
    REFUSED = "refused"     # raise ``error(message)``


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    next: Phase | None = None               # after an allowed operation or a no-op
    error: type[VmError] | None = None      # of a refusal
    # of a refusal: {sid}, {state} (running, paused, lost) and {note} (": " and the record's
    # note, when it has one) filled in
    message: str = ""
    boot: bool = False                      # an allowed resume boots the guest from its disk

    @property
    def refused(self) -> bool:
        return self.verdict is Verdict.REFUSED

    def refusal(self, sid: str, phase: Phase, note: str = "") -> VmError:
        """The error of a refusal, its message filled in for sandbox ``sid``."""
        assert self.error is not None, "only a refusal has an error"
        return self.error(self.message.format(sid=sid, state=coarse(phase), note=f": {note}" if note else ""))


def phase_of(state: str | None, cold_boot: bool = False, envd_unresponsive: bool = False) -> Phase:
    """The phase of a record (``SandboxRecord`` or ``SandboxInfo``: ``state`` is its
    ``SandboxState``, a ``str`` enum); ``None``: there is no record."""
    if state is None:
        return Phase.GONE
    if state == "running":
        return Phase.RUNNING
    if state == "paused":
        if cold_boot:
            return Phase.PAUSED_FILESYSTEM
        return Phase.PAUSED_UNRESPONSIVE if envd_unresponsive else Phase.PAUSED
    if state == "lost":
        return Phase.LOST
    raise ValueError(f"unknown sandbox state {state!r}")


def coarse(phase: Phase) -> str:
    """The state the service shows for ``phase`` (``SandboxState``'s values; ``gone``)."""
    if phase in PAUSED_PHASES:
        return "paused"
    return phase.value


def _ok(next_phase: Phase, boot: bool = False) -> Outcome:
    return Outcome(Verdict.ALLOWED, next_phase, boot=boot)


def _noop(phase: Phase) -> Outcome:
    return Outcome(Verdict.NOOP, phase)


def _no(error: type[VmError], message: str) -> Outcome:
    return Outcome(Verdict.REFUSED, error=error, message=message)


UNKNOWN = _no(NotFound, "unknown sandbox {sid!r}")
NOT_RUNNING = _no(Conflict, "sandbox {sid} is not running (state: {state})")
NOT_RUNNING_HERE = _no(NotFound, "sandbox {sid} is not running")     # what the proxy answers as not found
ALREADY_PAUSED = _no(Conflict, "Error pausing sandbox - sandbox '{sid}' is already paused")   # E2B's words
ALREADY_RUNNING = _no(Conflict, "sandbox {sid} is already running")
NOT_RESUMABLE = _no(Conflict, "sandbox {sid} cannot be resumed (state {state}{note})")
UNRESPONSIVE = _no(UnresponsiveSnapshot, "sandbox {sid} was paused while its guest agent (envd) was not "
                                         "responding: it resumes only by cold boot")
NETWORK_OF_PAUSED = _no(Conflict, "sandbox {sid} is paused: resume it (connect) before updating its network")
ANNOTATE_PAUSED = _no(Conflict, "sandbox {sid} is paused: connect to resume it first (a paused sandbox's "
                                "record is the one its pause committed)")
FORK_OF_PAUSED = _no(Conflict, "sandbox {sid} is paused; only a running sandbox can be forked")
TRAFFIC_NEVER_BOOTS = _no(Conflict, "The sandbox {sid} was not found: its pause kept only its filesystem (or its "
                                    "guest agent was not responding), so it must be resumed explicitly (connect)")
HELD = _no(AlreadyHeld, "this node already holds sandbox {sid} ({state})")   # the fleet acts on these classes
RELEASE_RUNNING = _no(NotPaused, "sandbox {sid} is running: pause it before releasing it")
RELEASE_NOT_PAUSED = _no(NotPaused, "sandbox {sid} is {state}: only a paused sandbox can be released")
EXISTS = _no(Conflict, "sandbox {sid} already exists")
BATCH_OF_RUNNING = _no(Conflict, "sandbox {sid} is running: only a paused sandbox's last pause starts sandboxes "
                                 "from its id (fork the running sandbox instead)")
BATCH_WITHOUT_MEMORY = _no(Conflict, "sandbox {sid} was paused without its memory: its pause holds no processes "
                                     "to start sandboxes from (resume it, then fork it)")
BATCH_UNRESPONSIVE = _no(UnresponsiveSnapshot, "sandbox {sid} was paused while its guest agent (envd) was not "
                                               "responding: no sandbox starts from that pause")
BATCH_NO_PAUSE = _no(Conflict, "sandbox {sid} has no pause to start sandboxes from (state {state}{note})")


def _build() -> dict[tuple[Phase, Op], Outcome]:
    R, P, PF, PU, L, G = (Phase.RUNNING, Phase.PAUSED, Phase.PAUSED_FILESYSTEM, Phase.PAUSED_UNRESPONSIVE,
                          Phase.LOST, Phase.GONE)
    t: dict[tuple[Phase, Op], Outcome] = {}

    def row(op: Op, running: Outcome, paused: Outcome, filesystem: Outcome, unresponsive: Outcome,
            lost: Outcome, gone: Outcome = UNKNOWN) -> None:
        for phase, outcome in ((R, running), (P, paused), (PF, filesystem), (PU, unresponsive), (L, lost),
                               (G, gone)):
            t[(phase, op)] = outcome

    row(Op.CREATE, EXISTS, EXISTS, EXISTS, EXISTS, EXISTS, gone=_ok(R))
    row(Op.GET, _noop(R), _noop(P), _noop(PF), _noop(PU), _noop(L))
    row(Op.KILL, _ok(G), _ok(G), _ok(G), _ok(G), _ok(G))
    row(Op.PAUSE, _ok(P), ALREADY_PAUSED, ALREADY_PAUSED, ALREADY_PAUSED, NOT_RUNNING)
    row(Op.PAUSE_FILESYSTEM, _ok(PF), ALREADY_PAUSED, ALREADY_PAUSED, ALREADY_PAUSED, NOT_RUNNING)
    row(Op.PAUSE_UNRESPONSIVE, _ok(PU), ALREADY_PAUSED, ALREADY_PAUSED, ALREADY_PAUSED, NOT_RUNNING)
    # a filesystem-only pause kept no memory: every resume of it boots
    row(Op.RESUME, ALREADY_RUNNING, _ok(R), _ok(R, boot=True), UNRESPONSIVE, NOT_RESUMABLE)
    row(Op.RESUME_BOOT, ALREADY_RUNNING, _ok(R, boot=True), _ok(R, boot=True), _ok(R, boot=True), NOT_RESUMABLE)
    row(Op.CONNECT, _noop(R), _ok(R), _ok(R, boot=True), UNRESPONSIVE, NOT_RESUMABLE)
    row(Op.CONNECT_BOOT, _noop(R), _ok(R, boot=True), _ok(R, boot=True), _ok(R, boot=True), NOT_RESUMABLE)
    # traffic resumes only what resumes as it was: never a boot behind the owner's back
    row(Op.AUTO_RESUME, _noop(R), _ok(R), TRAFFIC_NEVER_BOOTS, TRAFFIC_NEVER_BOOTS, NOT_RUNNING_HERE)
    # a paused sandbox keeps the timeout its next resume takes (E2B answers 404: its
    # paused sandboxes have no TTL at all)
    row(Op.SET_TIMEOUT, _ok(R), _ok(P), _ok(PF), _ok(PU), _ok(L))
    row(Op.UPDATE_NETWORK, _ok(R), NETWORK_OF_PAUSED, NETWORK_OF_PAUSED, NETWORK_OF_PAUSED, NOT_RUNNING)
    # a pause commits the record (handover.py): a change after it would not move with the
    # sandbox to the node that adopts it, so only a running sandbox's record changes
    row(Op.ANNOTATE, _ok(R), ANNOTATE_PAUSED, ANNOTATE_PAUSED, ANNOTATE_PAUSED, NOT_RUNNING)
    row(Op.SNAPSHOT, _ok(R), NOT_RUNNING, NOT_RUNNING, NOT_RUNNING, NOT_RUNNING)
    row(Op.FORK, _ok(R), FORK_OF_PAUSED, FORK_OF_PAUSED, FORK_OF_PAUSED, NOT_RUNNING)
    # a batch from a paused sandbox's last pause leaves it paused; one this node does not
    # hold may be paused in the shared repository (another node's, or released): asked there
    row(Op.FORK_PAUSE, BATCH_OF_RUNNING, _ok(P), BATCH_WITHOUT_MEMORY, BATCH_UNRESPONSIVE, BATCH_NO_PAUSE, gone=_ok(G))
    for op in (Op.ENDPOINT, Op.USAGE, Op.CONSOLE):
        row(op, _ok(R), NOT_RUNNING_HERE, NOT_RUNNING_HERE, NOT_RUNNING_HERE, NOT_RUNNING_HERE)
    row(Op.METRICS, _ok(R), _ok(P), _ok(PF), _ok(PU), _ok(L))
    row(Op.ADOPT, HELD, HELD, HELD, HELD, HELD, gone=_ok(P))    # paused as the other node paused it
    row(Op.RELEASE, RELEASE_RUNNING, _ok(G), _ok(G), _ok(G), RELEASE_NOT_PAUSED)
    return t


TABLE: dict[tuple[Phase, Op], Outcome] = _build()


def transition(phase: Phase, op: Op) -> Outcome:
    """What ``op`` does to a sandbox in ``phase``."""
    return TABLE[(phase, op)]


def check(phase: Phase, op: Op, sid: str, note: str = "") -> Outcome:
    """``transition``, raising the refusal (for sandbox ``sid``, whose record says
    ``note``) when there is one."""
    outcome = TABLE[(phase, op)]
    if outcome.refused:
        raise outcome.refusal(sid, phase, note)
    return outcome
