"""What a machine is to be: a ``MachinePlan``, one per bring-up, made by one of its modes.

* ``MachinePlan.restore``: a clone of a saved guest (create, pool refill, resume, fork
  child): QEMU waits in ``-incoming defer`` with the template's memory file mapped
  ``share=off``, a resume's delta pages are written into it, the device state loads.
* ``MachinePlan.cold_boot``: the same clone's machine booting from a disk instead (a
  paused sandbox's sealed disk: filesystem-only pauses, ``on_resume="reboot"``).
* ``MachinePlan.build``: a guest booted from a layer with a disk of its own size and
  RAM of its own (``<work>/memory``, ``share=on``, what a freeze saves), on QEMU's
  user-mode network (templates are frozen with user-mode devices): a template build's
  VM and the base template's boot.

Which of these the plan is decides the rest: a clone (its RAM a template's memory
file) gets the node's KSM settings, a machine with RAM of its own does not (it has
nothing to merge with); a restore answers ``closeConnections`` in its first /init
(its clients' connections died with the saved guest), a boot does not.
"""
from __future__ import annotations

import base64
import datetime
import secrets
from dataclasses import dataclass
from pathlib import Path

from aenv_store.formats.ids import Digest

from ..guest import kernel_cmdline
from ..memory.memory_image import Delta
from ..net.policy import NetworkPolicy
from ..qemu.launcher import Accel
from .cpushare import StartingGroup


@dataclass(frozen=True)
class Shape:
    """The machine a guest needs: what a template and its clones share (or migration fails)."""
    memory_mib: int
    vcpus: int
    accel: Accel
    kernel_cmdline: str


def boot_cmdline(accel: Accel) -> str:
    """The kernel command line of a guest booted to be frozen into a template. Under TCG
    without ASLR in the guest: with it every new process maps bash and its libraries at
    new addresses, and TCG (QEMU 7.2 keys translations by virtual address) translates
    them afresh, 0.5-1 s per command; without it the translations a pooled clone's
    warm-up made serve the user's commands (docs/guest.md). The sandbox VM is the
    isolation boundary (its user may be root inside), so ASLR within the guest buys
    little. KVM translates nothing: ASLR stays on there."""
    return kernel_cmdline(extra="norandmaps" if accel == "tcg" else "")


@dataclass(frozen=True)
class Disk:
    """The machine's disk: a fresh or kept upper layer over a committed layer."""
    top: Digest | None                  # the committed layer it sits on
    fresh_upper: bool = False           # a new, empty upper layer even if one is on disk
    size_mib: int | None = None         # None: the layer's size


@dataclass(frozen=True)
class Greeting:
    """The first words with the machine's envd: ``GET /health`` (unless ``probe_health``
    is off), then one ``POST /init``."""
    body: dict[str, str | dict[str, str]]   # /init fields (identity, a new token, env vars, ...)
    token: str | None               # the access token the guest's envd demands before this /init
    timeout: float                  # seconds envd may take to answer
    probe_health: bool = True       # GET /health first; off: /init posted until it answers (a fork child)
    clock: bool = False             # /init carries the host's clock, read as it is sent (a clone's, a cold boot's)

    @property
    def token_after(self) -> str | None:
        """The token envd demands once the /init is answered."""
        if "accessToken" in self.body:
            token = self.body["accessToken"]
            assert isinstance(token, str)
            return token or None
        return self.token


def identity(name: str) -> dict[str, str | dict[str, str]]:
    """/init fields of a new guest identity: hostname, fresh entropy (the clock comes with
    ``Greeting.clock``)."""
    return {"hostname": name, "entropy": base64.b64encode(secrets.token_bytes(64)).decode()}


def clock() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


@dataclass(frozen=True)
class Restore:
    """How a restored machine gets its state."""
    device_state: Path              # the saved device state to load
    delta: Delta | None = None      # pages written over the memory before the state loads (resume)


@dataclass(frozen=True)
class Boot:
    """A machine whose kernel boots."""
    failure: str                    # says what did not boot when envd never answers


@dataclass(frozen=True)
class MachinePlan:
    name: str                       # QEMU's name, its NBD export, its jail's and network's holder
    work: Path                      # the machine's own files: <work>/upper, <work>/memory, <work>/device-state
    shape: Shape
    memory: Path | None             # a template's memory file mapped share=off; None: RAM of its own
    disk: Disk
    start: Restore | Boot
    greeting: Greeting
    policy: NetworkPolicy = NetworkPolicy()   # what the guest may open connections to
    user_mode: bool = False         # QEMU's user-mode network even on a tap node
    background: bool = False        # QEMU at a low CPU priority (pool refills, until handed out)
    starting: StartingGroup | None = None   # a fork child's: its siblings' CPU weight while they start
    keep_work: bool = False         # ``work`` is the caller's: teardown removes only the machine's files in it
    # the host's read-ahead on its disk: a sandbox's (restored or cold-booted) disk may be
    # cold on this node; a build VM's layer was just written here, and read-ahead only
    # costs it CPU (its builds ran ~7 % slower with it, benchmarks/ab_trees.py)
    readahead: bool = True

    @classmethod
    def restore(cls, name: str, work: Path, shape: Shape, memory: Path, state: Restore, disk: Disk,
                greeting: Greeting, *, policy: NetworkPolicy = NetworkPolicy(),
                background: bool = False, starting: StartingGroup | None = None) -> "MachinePlan":
        return cls(name, work, shape, memory, disk, state, greeting, policy=policy, background=background,
                   starting=starting)

    @classmethod
    def cold_boot(cls, name: str, work: Path, shape: Shape, memory: Path, disk: Disk, greeting: Greeting,
                  failure: str, *, policy: NetworkPolicy = NetworkPolicy()) -> "MachinePlan":
        return cls(name, work, shape, memory, disk, Boot(failure), greeting, policy=policy)

    @classmethod
    def build(cls, name: str, work: Path, layer: Digest, *, disk_mib: int, memory_mib: int, vcpus: int,
              accel: Accel, greeting: Greeting, failure: str, keep_work: bool = False) -> "MachinePlan":
        return cls(name, work, Shape(memory_mib, vcpus, accel, boot_cmdline(accel)), None,
                   Disk(layer, size_mib=disk_mib), Boot(failure), greeting, user_mode=True, keep_work=keep_work,
                   readahead=False)

    @property
    def memory_file(self) -> Path:
        """The file QEMU maps as RAM."""
        return self.memory if self.memory is not None else self.work / "memory"

    @property
    def clone(self) -> bool:
        """Its RAM is a template's memory file (copy-on-write)."""
        return self.memory is not None
