"""Restores: a running, envd-ready sandbox from saved state.

Create (from a template or snapshot), a pool refill, resume (from a pause) and
every fork child are a machine restore (aenv_vm/machine, ``MachinePlan.restore``);
they differ only in the ``RestorePlan``:

* the memory a new QEMU maps ``share=off`` (copy-on-write over the template's
  memory file, so clones share the host page cache) and, for a resume, the
  pages of the pause written into it through /proc/PID/mem before the device
  state loads;
* the disk: a new upper layer over the template's layer (create, fork), or a
  fresh upper layer over the pause's sealed layer (resume);
* the first words with envd (``Greeting``): a saved guest's envd still holds
  the access token it had (a built template's: a secret only the template
  record knows) and its identity, so a clone is first sent ``/init`` with its
  own hostname, entropy and clock and a new token (a clone of a template: a
  secret of its own until it is handed out and re-keyed to its sandbox's
  token; a fork child: its final token). Create and resume wait for ``/health`` first; a fork child posts
  ``/init`` straight away (its envd listens from its first instruction, and a
  separate ``/health`` costs 16 rounds of code translation under TCG).

A resume may bring a ``Standby``: the QEMU its pause started in advance (base
mapped, waiting in ``-incoming defer``) with the disk image kept open, which
saves QEMU's start. Any failure tears the half-made sandbox down. A sandbox
booted from its disk instead is coldboot.py's.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from aenv_store.formats.ids import Digest

from ..machine.bringup import BringUpTiming, Standby, bring_up
from ..machine.machine import Machine, teardown
from ..machine.cpushare import StartingGroup
from ..machine.plan import Disk, Greeting, MachinePlan, Restore, identity
from ..memory.memory_image import Delta
from ..net.policy import NetworkPolicy
from ..templates.template import Template
from .runtime import NodeRuntime
from .sandbox import CreateTiming, Sandbox


def new_sandbox_id() -> str:
    return "sbx-" + secrets.token_hex(8)


@dataclass(frozen=True)
class RestorePlan:
    sandbox_id: str
    template: Template
    memory: Path                    # the template's memory file, mapped share=off
    device_state: Path              # the saved device state to load
    disk_top: Digest | None         # the committed layer the sandbox's disk sits on
    greeting: Greeting
    fresh_upper: bool = False       # a new, empty upper layer even if one is on disk (resume)
    delta: Delta | None = None      # pages written over the memory before the state loads (resume, a pause's snapshot)
    policy: NetworkPolicy = NetworkPolicy()   # what the guest may open connections to
    background: bool = False        # pool refills: QEMU at a low CPU priority until handed out
    starting: StartingGroup | None = None   # a fork child's: shares the CPU with its siblings (cpushare.py)


def greeting(rt: NodeRuntime, body: dict[str, str | dict[str, str]], token: str | None, *,
             probe_health: bool = True) -> Greeting:
    """The first words with a restored clone's envd: ``body`` with the host's clock,
    within the node's ready timeout."""
    return Greeting(body, token, rt.ready_timeout, probe_health=probe_health, clock=True)


async def restore(rt: NodeRuntime, plan: RestorePlan, standby: Standby | None = None) -> tuple[Sandbox, BringUpTiming]:
    sid, tpl = plan.sandbox_id, plan.template
    machine_plan = MachinePlan.restore(sid, rt.sandbox_dir(sid), tpl.shape, plan.memory,
                                       Restore(plan.device_state, plan.delta),
                                       Disk(plan.disk_top, fresh_upper=plan.fresh_upper), plan.greeting,
                                       policy=plan.policy, background=plan.background,
                                       starting=plan.starting)
    machine, timing = await bring_up(rt, machine_plan, standby)
    return sandbox_of(tpl, machine), timing


def sandbox_of(tpl: Template, machine: Machine) -> Sandbox:
    """The sandbox a machine of ``tpl`` is."""
    return Sandbox(machine.name, tpl, machine.vm, machine.image, machine.work, net=machine.net,
                   guest_token=machine.guest_token)


async def restore_from_template(rt: NodeRuntime, tpl: Template, *, policy: NetworkPolicy = NetworkPolicy(),
                                background: bool = False) -> Sandbox:
    """A new sandbox restored from template (or snapshot) ``tpl``, with its own identity
    (a create that found no pooled clone, and every pool refill). A pause's snapshot's
    pages are written over the memory first, as a resume writes its pause's."""
    memory, state = await rt.templates.files(tpl)
    delta = await rt.templates.delta(tpl) if tpl.delta is not None else None
    sid = new_sandbox_id()
    # a secret of this clone's own from its first request on: until it is handed out
    # (and re-keyed to the sandbox's token) nobody else can talk to its envd
    body = {**identity(sid), "accessToken": secrets.token_urlsafe(24)}
    plan = RestorePlan(sid, tpl, memory, state, tpl.disk, greeting(rt, body, rt.templates.envd_token(tpl)),
                       delta=delta, policy=policy, background=background)
    sbx, t = await restore(rt, plan)
    sbx.timing = CreateTiming(t.qemu_start, t.state_load, t.first_answer, t.init, 0.0, t.total, False)
    return sbx


async def teardown_sandbox(rt: NodeRuntime, sbx: Sandbox) -> None:
    """Stop a sandbox's QEMU and give up everything it held on this node."""
    await teardown(rt, sbx.id, sbx.vm, sbx.image, sbx.dir)
