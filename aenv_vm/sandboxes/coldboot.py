"""Filesystem-only pauses and cold boot: a paused sandbox runs again from its disk alone.

E2B's filesystem-only pause (``memory: false``), ``connect(on_resume="reboot")``
and a pause taken while envd did not answer come back this way: the same
sandbox id, a new guest boot (new ``/proc/sys/kernel/random/boot_id``, no
processes of before), the disk exactly as the pause sealed it.

The machine is the one a resume would bring up (aenv_vm/machine,
``MachinePlan.cold_boot``: same devices, kernel command line and memory size
as the template) but boots instead of waiting for a device state; its RAM is
the template's memory file mapped ``share=off``, as a clone's. The kernel does not need zeroed RAM (real
machines give it garbage), and the mapping keeps the sandbox a normal one
afterwards: its next memory pause captures the pages that differ from the
template's image, like any clone's, and resumes over it.

envd starts fresh in the booted guest (no token, no env vars), so it is told
what the template's build and the sandbox's create gave it: hostname (the
sandbox id), entropy, clock, the template's env vars, user and workdir plus
the sandbox's own env vars, and the sandbox's access token (or none). A
template's start command, if it has one, is started again. The template's
settings come from its record (a snapshot's carries its parent's:
templates/template.py ``guest_settings``).

A filesystem-only pause ran ``sync`` in the guest before it stopped, so its
disk holds every write; a memory pause booted cold (``on_resume="reboot"``)
loses what its guest had not written back yet (its file system's journal
replays at mount).
"""
from __future__ import annotations

import asyncio
import logging
import time

from ..envd_client import ProcessRequest, stream_process
from ..errors import Conflict, GuestUnresponsive, VmError
from ..machine.bringup import bring_up
from ..machine.machine import close
from ..machine.plan import Disk, Greeting, MachinePlan, identity
from ..templates.meta import GuestSettings
from ..templates.template import guest_settings
from .handover import claim_held
from .pause import PausedSandboxes, digest_of
from .records import SandboxRecord, SandboxState
from .restore import sandbox_of
from .runtime import NodeRuntime
from .sandbox import Sandbox

log = logging.getLogger(__name__)

HEALTH_TIMEOUT = 3.0        # seconds envd has to answer /health before a strict or filesystem pause
SYNC_TIMEOUT = 120.0        # seconds the guest's sync may take before a filesystem-only pause
BOOT_TIMEOUT = 240.0        # seconds a booting guest's envd may take to answer (TCG under load)


async def prepare_pause(sbx: Sandbox, *, sync: bool) -> None:
    """Before a strict (``requireHealthyGuest``) or filesystem-only pause: envd must
    answer (GuestUnresponsive otherwise, nothing done); ``sync``: the guest's page cache
    is written back, so the disk the pause seals holds every write a boot will see."""
    envd = sbx.envd.with_token(sbx.guest_token)
    try:
        await envd.health(timeout=HEALTH_TIMEOUT)
    except (OSError, asyncio.TimeoutError, ConnectionError) as e:
        raise GuestUnresponsive(f"the guest agent (envd) of sandbox {sbx.id} is not responding: "
                                f"{e or type(e).__name__}") from None
    if sync:
        try:
            r = await envd.run("sync", user="root", timeout=SYNC_TIMEOUT)
        except VmError as e:
            raise GuestUnresponsive(f"sync in sandbox {sbx.id} failed: {e}") from None
        if r.exit_code != 0:
            raise GuestUnresponsive(f"sync in sandbox {sbx.id} exited {r.exit_code}")


async def cold_boot(rt: NodeRuntime, paused: PausedSandboxes, rec: SandboxRecord) -> tuple[Sandbox, float]:
    """Boot paused sandbox ``rec`` from its sealed disk (the caller holds its lock and
    records the result); returns it and the seconds until envd was initialised."""
    t0 = time.monotonic()
    sid = rec.id
    if rec.state != SandboxState.PAUSED or rec.snapshot is None:
        raise Conflict(f"sandbox {sid} cannot be booted (state {rec.state.value})")
    await paused.committed(sid)
    rec = paused.records.get(sid) or rec
    if rec.snapshot is not None and not rec.snapshot.committed:
        await paused.commit_pending(rec)   # never boot over an unsealed disk
        rec = paused.records.get(sid) or rec
    snap = rec.snapshot
    assert snap is not None and snap.committed
    # Moved: another node holds it now; else the repository says it runs here from now on,
    # before the guest runs (a takeover racing this write is refused, or refuses it)
    await asyncio.to_thread(claim_held, rt, rec)
    tpl = rt.templates.resolve(rec.template)
    mem, _ = await rt.templates.files(tpl)
    settings = await asyncio.to_thread(guest_settings, rt.store, tpl)
    await paused.release(sid)     # a standby waits for a device state: of no use to a boot
    body: dict[str, str | dict[str, str]] = {**identity(sid), "envVars": {**settings.env_vars, **rec.env_vars},
                                             "accessToken": rec.access_token or ""}
    if settings.user:
        body["defaultUser"] = settings.user
    if settings.workdir:
        body["defaultWorkdir"] = settings.workdir
    plan = MachinePlan.cold_boot(sid, rt.sandbox_dir(sid), tpl.shape, mem,
                                 Disk(digest_of(snap.disk_top), fresh_upper=True),
                                 Greeting(body, None, BOOT_TIMEOUT, clock=True),
                                 f"sandbox {sid} did not boot from its disk", policy=rec.policy)
    machine, _ = await bring_up(rt, plan)
    sbx = sandbox_of(tpl, machine)
    try:
        if settings.start_cmd:
            await _start_again(sbx, settings)
    except BaseException:
        await close(rt, machine)
        raise
    sbx.created = rec.started_at
    return sbx, time.monotonic() - t0


async def _start_again(sbx: Sandbox, settings: GuestSettings) -> None:
    """The template's start command, running again in the booted guest (left running in
    the background, as at build). A command that fails to start is logged, not fatal:
    the sandbox itself is up."""
    assert settings.start_cmd is not None
    req = ProcessRequest("/bin/bash", ("-l", "-c", settings.start_cmd),
                         user=settings.start_user or settings.user or "root",
                         cwd=settings.start_workdir or settings.workdir, envs=dict(settings.env_vars))
    try:
        await stream_process(sbx.envd.with_token(sbx.guest_token), req, timeout=60.0, detach=True)
    except (VmError, OSError, asyncio.TimeoutError) as e:
        log.warning("sandbox %s: the start command did not start after the boot: %s", sbx.id, e)
