"""The one restore path: a running, envd-ready sandbox from saved state.

Create (from a template or snapshot), a pool refill, resume (from a pause) and
every fork child come through ``restore``; they differ only in the
``RestorePlan``:

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
saves QEMU's start. Any failure tears the half-made sandbox down.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from aenv_store.formats.ids import Digest

from ..blockimage.image import BlockImage
from ..blockimage.prefetch import Prefetcher
from ..memory.lazyfs import LazyMemoryError
from ..memory.memory_image import Delta
from ..net.policy import NetworkPolicy
from ..memory.pagemap import ram_mapping, write_pages
from ..qemu.launcher import QemuProcess
from ..qemu.migration import load_device_state
from ..templates.template import Template
from .runtime import NodeRuntime
from .sandbox import CreateTiming, Sandbox

log = logging.getLogger(__name__)

# Nice value of pooled (not yet handed out) sandboxes' QEMU processes.
POOL_NICE = 10


def new_sandbox_id() -> str:
    return "sbx-" + secrets.token_hex(8)


def identity(sid: str) -> dict[str, str]:
    """/init fields of a clone's identity: hostname, fresh entropy, the host's clock."""
    return {"hostname": sid, "entropy": base64.b64encode(secrets.token_bytes(64)).decode(),
            "timestamp": clock()}


def clock() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def renice(pgid: int, nice: int) -> None:
    """Set the nice value of every thread of QEMU's process group (threads created
    later inherit it from their creator). Raising priority back needs root."""
    try:
        os.setpriority(os.PRIO_PGRP, pgid, nice)
    except OSError as e:
        log.debug("renice of QEMU group %d to %d failed: %s", pgid, nice, e)


@dataclass(frozen=True)
class Greeting:
    """The first words with a restored clone's envd."""
    body: dict[str, str]            # /init fields (identity or clock, maybe a new token)
    token: str | None               # the access token the saved guest's envd still holds
    probe_health: bool = True       # GET /health first (create, resume); a fork child: /init alone


@dataclass(frozen=True)
class RestorePlan:
    sandbox_id: str
    template: Template
    memory: Path                    # the template's memory file, mapped share=off
    device_state: Path              # the saved device state to load
    disk_top: Digest | None         # the committed layer the sandbox's disk sits on
    greeting: Greeting
    fresh_upper: bool = False       # a new, empty upper layer even if one is on disk (resume)
    delta: Delta | None = None      # pages written over the memory before the state loads (resume)
    policy: NetworkPolicy = NetworkPolicy()   # what the guest may open connections to
    background: bool = False        # pool refills: QEMU at a low CPU priority until handed out


@dataclass
class Standby:
    """A paused sandbox's next QEMU, already started, and its disk image, still open."""
    vm: QemuProcess
    image: BlockImage


@dataclass(frozen=True)
class RestoreTiming:
    qemu_start: float               # QEMU process start until QMP answers (0 with a standby)
    inject: float                   # delta pages written into the new QEMU
    state_load: float               # device state loaded, vCPUs running
    first_answer: float             # envd /health answered (0 for a fork child)
    init: float                     # envd /init answered
    running_at: float = field(default=0.0)   # time.monotonic() when the vCPUs ran

    @property
    def total(self) -> float:
        return self.qemu_start + self.inject + self.state_load + self.first_answer + self.init


async def restore(rt: NodeRuntime, plan: RestorePlan, standby: Standby | None = None) -> tuple[Sandbox, RestoreTiming]:
    sid, tpl = plan.sandbox_id, plan.template
    sdir = rt.sandbox_dir(sid)
    image: BlockImage | None = standby.image if standby is not None else None
    vm: QemuProcess | None = standby.vm if standby is not None else None
    try:
        t1 = time.monotonic()
        if vm is None:
            for d in (sdir, rt.vm_dir(sid)):
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
            # off the event loop: 20-50 ms here, 16 at once in a fork
            image = await asyncio.to_thread(BlockImage.open, rt.store, plan.disk_top, sid, upper_dir=sdir / "upper",
                                            fresh_upper=plan.fresh_upper, min_free_disk=rt.min_free_disk)
            if rt.readahead > 0:   # sequential guest reads of a cold disk find the next chunks fetched
                Prefetcher(image, window=rt.readahead)
            rt.nbd.add_export(image)
            jail = rt.confinement.jail(sid)
            uid = jail.uid if jail is not None else None
            await rt.nbd.listen(sid, rt.vm_dir(sid) / "nbd.sock", owner=uid)
            network = await rt.networks.attach(sid, plan.policy, owner=uid)
            spec = rt.clone_spec(sid, tpl, plan.memory, network, jail)
            t1 = time.monotonic()
            vm = await QemuProcess.start(spec)
            if plan.background:
                renice(vm.pid, POOL_NICE)
        assert image is not None
        t2 = time.monotonic()
        if plan.delta is not None:
            delta, pid = plan.delta, vm.pid
            await asyncio.to_thread(lambda: write_pages(pid, ram_mapping(pid, plan.memory), delta.pages, delta.data))
        t3 = time.monotonic()
        await load_device_state(vm, await rt.networks.device_state(plan.device_state))
        t4 = time.monotonic()
        body = plan.greeting.body
        sbx = Sandbox(sid, tpl, vm, image, sdir, net=rt.networks.get(sid),
                      guest_token=(body["accessToken"] or None) if "accessToken" in body else plan.greeting.token)
        envd = sbx.envd.with_token(plan.greeting.token)
        if plan.greeting.probe_health:
            await envd.wait_healthy(timeout=rt.ready_timeout, alive=vm.alive)
        t5 = time.monotonic()
        # the snapshot's client connections are dead: envd closes them first
        greeting = {**plan.greeting.body, "closeConnections": True}
        if plan.greeting.probe_health:
            await envd.init(greeting)
        else:
            await envd.init_when_ready(greeting, rt.ready_timeout, vm.alive)
        t6 = time.monotonic()
    except BaseException as e:
        await teardown(rt, sid, vm, image)
        if isinstance(e, Exception) and (lazy := rt.templates.lazy_image(plan.memory)) is not None and lazy.error:
            # the QEMU died of a memory page the store could not give (corrupt or missing chunk)
            raise LazyMemoryError(f"sandbox {sid} cannot run: {lazy.error}") from e
        raise
    return sbx, RestoreTiming(t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t4)


async def restore_from_template(rt: NodeRuntime, tpl: Template, *, policy: NetworkPolicy = NetworkPolicy(),
                                background: bool = False) -> Sandbox:
    """A new sandbox restored from template (or snapshot) ``tpl``, with its own identity
    (a create that found no pooled clone, and every pool refill)."""
    memory, state = await rt.templates.files(tpl)
    sid = new_sandbox_id()
    # a secret of this clone's own from its first request on: until it is handed out
    # (and re-keyed to the sandbox's token) nobody else can talk to its envd
    body = {**identity(sid), "accessToken": secrets.token_urlsafe(24)}
    plan = RestorePlan(sid, tpl, memory, state, tpl.disk, Greeting(body, rt.templates.envd_token(tpl)),
                       policy=policy, background=background)
    sbx, t = await restore(rt, plan)
    sbx.timing = CreateTiming(t.qemu_start, t.state_load, t.first_answer, t.init, 0.0, t.total, False)
    return sbx


async def teardown(rt: NodeRuntime, sid: str, vm: QemuProcess | None, image: BlockImage | None) -> None:
    """Stop a sandbox's QEMU and give up everything it held on this node."""
    if vm is not None:
        await vm.stop(timeout=2.0)
    await rt.release_host(sid)
    rt.nbd.remove_export(sid)
    if image is not None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(image.close)
    shutil.rmtree(rt.sandbox_dir(sid), ignore_errors=True)


async def teardown_sandbox(rt: NodeRuntime, sbx: Sandbox) -> None:
    await teardown(rt, sbx.id, sbx.vm, sbx.image)
