"""The typed seam between the API and whatever runs sandboxes.

``SandboxService`` is everything the E2B-compatible API asks of the sandbox
layer, in records that carry no VM internals (no run directories, QEMU pids or
specs): one node (``aenv_vm.sandboxes.node_service.NodeSandboxService``), and on
a fleet node the agent's wrapper of it (``aenv_fleet.agent.ObservedService``), stand
behind the API. (A fleet's gateway implements no ``SandboxService``: it routes HTTP
to the nodes' APIs, docs/cluster.md.) Errors are ``aenv_vm.errors`` classes: ``NotFound``, ``Conflict``,
``BadRequest``, ``Unsupported``, ``CapacityError``; anything else is a
server-side failure.
"""
from __future__ import annotations

import enum
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Callable, Protocol, Union

from .errors import VmError
from .net.policy import NetworkPolicy

# Mints the envd access token of a sandbox from its id, which is known only once
# the node has picked the VM (the API derives it with the deployment's HMAC).
TokenMinter = Callable[[str], str]
ExpiryListener = Callable[[str, str], None]   # (sandbox id, "paused" | "killed")


class SandboxState(str, enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    LOST = "lost"       # found dead at start with no snapshot to resume from


@dataclass(frozen=True)
class CreateRequest:
    template: str                                   # template id, alias, or snapshot id/name
    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: TokenMinter | None = None         # None: envd is not secured
    timeout: float | None = None                    # seconds to live (None: the node's default)
    metadata: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = True                         # on expiry: pause (True) or kill
    allow_internet_access: bool | None = None       # None: not set (allowed); False: deny 0.0.0.0/0
    network: NetworkPolicy = field(default_factory=NetworkPolicy)   # egress rules (net/policy.py)
    pause_memory: bool = True                       # a TTL auto-pause keeps memory (False: filesystem only)
    volume_mounts: tuple[dict[str, str], ...] = ()            # E2B's [{name, path}]: volumes mounted at create
    annotations: dict[str, str] = field(default_factory=dict)   # the caller's own fields, kept with the sandbox


@dataclass(frozen=True)
class SandboxInfo:
    sandbox_id: str
    template_id: str
    state: SandboxState
    started_at: float               # unix time
    end_at: float                   # TTL deadline (unix time)
    vcpus: int
    memory_mib: int
    disk_mib: int
    auto_pause: bool
    timeout: float
    metadata: dict[str, str]
    access_token: str | None
    allow_internet_access: bool | None
    envd_version: str | None        # what the template's guest envd reported at build (None: unknown)
    network: NetworkPolicy = field(default_factory=NetworkPolicy)   # the egress rules in force
    note: str = ""                  # why a sandbox is lost, or what recovery did
    from_pool: bool | None = None   # create answers only: handed out from the warm pool
    pause_memory: bool = True       # what a TTL auto-pause keeps (False: the filesystem only)
    cold_boot: bool = False         # paused filesystem-only: the next resume boots from its disk
    envd_unresponsive: bool = False # paused while envd did not answer: resumes by cold boot only
    volume_mounts: tuple[dict[str, str], ...] = ()    # [{name, path}] of the volumes mounted in it
    # what the create's caller asked to keep with it (inherited by fork children, moved
    # with the sandbox between nodes)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    names: tuple[str, ...]
    sandbox_id: str
    created: float
    # the API team its record names as its owner (None: recorded before snapshots carried
    # their team; the API then asks the node's own map)
    team: str | None = None
    # what it takes on its own: its memory image as allocated (holes free) plus its disk's
    # data above its template, before the repository's deduplication and compression
    # (None: recorded before snapshots carried their size)
    bytes: int | None = None


@dataclass(frozen=True)
class Usage:
    """Host-side resource use of a running sandbox."""
    rss_bytes: int
    cpu_seconds: float              # since its VM process started
    disk_bytes: int                 # held by its writable disk layer on the host


@dataclass(frozen=True)
class MetricSample:
    """One sample of a sandbox's resource use as its guest sees it (E2B's SandboxMetric)."""
    timestamp: float                # unix time the sample was taken
    cpu_count: int
    cpu_used_pct: float             # of all its vCPUs, since the previous sample
    mem_used: int                   # bytes
    mem_total: int
    mem_cache: int                  # page cache, bytes
    disk_used: int                  # of the guest's root filesystem, bytes
    disk_total: int


@dataclass(frozen=True)
class ConsoleRead:
    """A piece of a sandbox's serial console: ``data`` starts at byte ``start`` of the
    console named ``source`` (a resumed sandbox's new VM has a new one)."""
    source: str
    start: int
    data: bytes
    skipped: int = 0                # bytes passed over because the console grew faster than the limit


ForkResult = Union[SandboxInfo, VmError]


class SandboxService(Protocol):
    """Sandbox operations as the API needs them (one node or many)."""

    async def create(self, req: CreateRequest) -> SandboxInfo: ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list_sandboxes(self) -> list[SandboxInfo]: ...

    async def kill(self, sandbox_id: str) -> None: ...

    async def pause(self, sandbox_id: str, memory: bool = True, require_healthy: bool = False) -> SandboxInfo:
        """``memory=False``: keep only the filesystem (the next resume boots from it);
        ``require_healthy``: GuestUnresponsive, sandbox left running, when envd does not
        answer (always so for ``memory=False``)."""
        ...

    async def resume(self, sandbox_id: str, timeout: float | None = None, memory: bool = True) -> SandboxInfo:
        """``memory=False``: boot from the disk instead of restoring the memory
        (UnresponsiveSnapshot: a pause marked envd-unresponsive resumes only so)."""
        ...

    async def set_timeout(self, sandbox_id: str, seconds: float) -> SandboxInfo: ...

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        """Replace the egress rules of a running sandbox at once (kept across pause,
        resume, fork and snapshot)."""
        ...

    async def annotate(self, sandbox_id: str, annotations: dict[str, str]) -> SandboxInfo:
        """Set these keys of a running sandbox's ``annotations`` (the others stay), durably
        in its record: kept by its next pause and moved with it. Conflict when paused."""
        ...

    async def snapshot(self, sandbox_id: str, name: str | None = None, team: str | None = None) -> SnapshotInfo:
        """A named snapshot whose record names ``team`` as its owner (every node sharing the
        repository lists it with that team)."""
        ...

    async def list_snapshots(self) -> list[SnapshotInfo]: ...

    async def delete_snapshot(self, snapshot_id: str) -> None: ...

    async def fork(self, sandbox_id: str, count: int, timeout: float | None = None,
                   access_token: TokenMinter | None = None) -> list[ForkResult]: ...

    def pause_snapshot(self, sandbox_id: str) -> AbstractAsyncContextManager[SnapshotInfo]:
        """A hidden snapshot of paused sandbox ``sandbox_id``'s last pause, held for the
        ``async with`` block: ``create`` from its id makes sandboxes that start from that
        pause (its files and its processes), each with its own id, identity and token, while
        the paused sandbox stays as it is. A sandbox this node does not hold is looked for
        in the shared repository (paused by another node, or released). The snapshot lives
        while the block runs or a sandbox made from it exists, whether or not its source
        does. On entry: NotFound (no such paused sandbox: never made, or killed), Conflict
        (running, lost, or paused without its memory), UnresponsiveSnapshot (paused while
        its envd did not answer)."""
        ...

    async def endpoint(self, sandbox_id: str, port: int) -> tuple[str, int]:
        """``(host, port)`` where this process reaches guest TCP ``port`` of a running sandbox."""
        ...

    async def usage(self, sandbox_id: str) -> Usage: ...

    async def metrics(self, sandbox_id: str, start: float | None = None,
                      end: float | None = None) -> list[MetricSample]:
        """The samples of a sandbox (running or paused) taken between ``start`` and
        ``end`` (unix seconds, inclusive; None: unbounded), oldest first."""
        ...

    async def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, MetricSample]:
        """The newest sample of each of these sandboxes that has one (unknown ids are left out)."""
        ...

    async def console(self, sandbox_id: str, source: str | None, offset: int, limit: int) -> ConsoleRead:
        """Console output of a running sandbox from ``offset`` of ``source`` (None or another
        source than the current one: from the start of the current one)."""
        ...

    def on_expiry(self, listener: ExpiryListener) -> None:
        """Call ``listener`` after a sandbox's TTL paused or killed it."""
        ...

    async def adopt(self, sandbox_id: str, force: bool = False) -> SandboxInfo:
        """Take over a sandbox that another node sharing the repository paused: it is
        paused here afterwards, and ``resume`` runs it with the same id. NotFound: no such
        paused sandbox in the repository; Conflict: this one already holds it, or it cannot
        move (volume mounts, its template gone, paused by an older node), or its holder
        resumed it after that pause and ``force`` (that node is known to be gone) is not set."""
        ...

    async def release(self, sandbox_id: str) -> None:
        """Forget a paused sandbox, its pause committed and kept in the repository, so that
        another node can adopt it. NotFound: unknown; Conflict: running (or not movable)."""
        ...

    async def reclaim(self, sandbox_id: str) -> bool:
        """After a lapse of this node's fleet lease, before a running sandbox runs on: say
        again in the shared repository that it runs here, over the record as read. True:
        it is still this node's; False: another node took it over meanwhile, and this
        node's copy is gone (killed, its pause left to the new holder). NotFound: unknown."""
        ...
