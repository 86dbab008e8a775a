"""The one way a machine comes up on a host: ``bring_up``.

In this order, for every mode of ``MachinePlan`` (plan.py):

1. the machine's dirs made afresh (its work dir, its QEMU's run dir);
2. **disk**: ``BlockImage.open`` over the store (in a worker thread: 20-50 ms of the
   event loop otherwise, 16 at once in a fork), with the host's ``min_free_disk``.
   A sandbox's disk gets the read-ahead ``Prefetcher`` when the host's ``readahead``
   is above 0 (a node's ``[vm] readahead_mib``: restores and cold boots; not a build
   VM, whose layer is local, ``MachinePlan.readahead``; the base template's standalone
   host has none);
3. the disk's **NBD export**, listening on a socket of the machine's own in its run
   dir, owned by its jail's uid;
4. the **jail** (the host's confinement; its uid is the machine's until teardown);
5. the **network** (``NodeNetworks.attach`` → a typed ``Attachment``);
6. the ``VmSpec`` (spec.py) and ``QemuProcess.start``; a background machine's QEMU
   yields the CPU (``Priority.BACKGROUND``: its nice value and its cgroup's weight); a
   fork child's joins its fork's ``StartingGroup`` (cpushare.py) until its envd answers;
7. a restore: a resume's delta pages written into its RAM through /proc/PID/mem,
   then the device state loaded (tap nodes: without its ``slirp`` section);
8. the **envd greeting**: ``/health`` (the version it reports; a boot that never
   answers fails naming what did not boot), then ``/init`` (a restore's with
   ``closeConnections``; a fork child's posted until it answers, without /health).

A restore first takes one of the host's admission slots (admission.py: at most so many
restores at once, the rest wait in arrival order or are refused at once with
``AdmissionRefused``) and holds it until its envd has answered (or it failed).

A restore may bring a ``Standby`` instead of 2-6: the QEMU a pause started in
advance (``start_standby``, waiting in ``-incoming defer``) with the disk image kept
open. Any failure tears the half-made machine down (machine.py ``teardown``); a
clone whose lazily served memory file failed a page read raises ``LazyMemoryError``
saying so (the QEMU died of a page the store could not give).
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import shutil
import time
from dataclasses import dataclass, field

from ..blockimage.image import BlockImage
from ..blockimage.prefetch import Prefetcher
from ..envd_client import EnvdClient
from ..errors import AdmissionRefused, VmError
from ..memory.lazyfs import LazyMemoryError
from ..memory.pagemap import ram_mapping, write_pages
from ..net.netns import SandboxNet
from ..qemu.launcher import QemuProcess, VmSpec
from ..qemu.migration import load_device_state
from .host import Host
from .machine import MEMORY, UPPER, Machine, teardown
from .plan import Boot, MachinePlan, Restore, clock
from .spec import envd_address, machine_spec

log = logging.getLogger(__name__)

class Priority(enum.Enum):
    """A QEMU's claim on the CPU while other QEMUs want it too: (nice value, share of a
    running sandbox's cgroup CPU weight). A pool refill (nobody waits for it) yields to
    every sandbox in use until it is warm. Each confined QEMU is alone in its cgroup,
    where its nice value weighs only against its own threads: between QEMUs the
    groups' weights decide (1/8: about what nice 10 weighs against nice 0); unconfined,
    the nice value does.

    A fork's children share a ``StartingGroup`` while they start (cpushare.py); other
    foreground restores (a create without a pooled clone, a resume) have the full weight."""
    RUNNING = (0, 1.0)
    BACKGROUND = (10, 1 / 8)


def prioritise(vm: QemuProcess, priority: Priority) -> None:
    """Give ``vm`` ``priority`` (best effort: raising it back needs root)."""
    nice, share = priority.value
    renice(vm.pid, nice)
    if vm.cgroup is not None:
        vm.cgroup.set_cpu_share(share)


@dataclass
class Standby:
    """A paused sandbox's next QEMU, already started, and its disk image, still open."""
    vm: QemuProcess
    image: BlockImage


@dataclass(frozen=True)
class BringUpTiming:
    """Where a bring-up's time went (what CreateTiming and ResumeTiming report)."""
    qemu_start: float               # QEMU process start until QMP answers (0 with a standby)
    inject: float                   # delta pages written into the new QEMU (restore)
    state_load: float               # device state loaded, vCPUs running (restore)
    first_answer: float             # envd /health answered (0 for a fork child; a boot: the boot)
    init: float                     # envd /init answered
    running_at: float = field(default=0.0)   # time.monotonic() when the vCPUs ran (a restore's state loaded)

    @property
    def total(self) -> float:
        return self.qemu_start + self.inject + self.state_load + self.first_answer + self.init


def renice(pgid: int, nice: int) -> None:
    """Set the nice value of every thread of QEMU's process group (threads created
    later inherit it from their creator). Raising priority back needs root."""
    try:
        os.setpriority(os.PRIO_PGRP, pgid, nice)
    except OSError as e:
        log.debug("renice of QEMU group %d to %d failed: %s", pgid, nice, e)


def _fresh_dirs(host: Host, plan: MachinePlan) -> None:
    run = host.vm_dir(plan.name)
    if plan.keep_work:          # the caller's dir: only the machine's own files go
        for name in (UPPER, MEMORY):
            p = plan.work / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        plan.work.mkdir(parents=True, exist_ok=True)
        dirs = [run]
    else:
        dirs = [plan.work, run]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)


async def bring_up(host: Host, plan: MachinePlan, standby: Standby | None = None) -> tuple[Machine, BringUpTiming]:
    """Machine ``plan`` running on ``host``, its envd greeted (see the module doc)."""
    gate = host.admission
    if gate is None or not isinstance(plan.start, Restore):
        return await _bring_up(host, plan, standby)
    try:
        async with gate.slot(background=plan.background):
            return await _bring_up(host, plan, standby)
    except AdmissionRefused:
        if standby is not None:     # never started: its QEMU and disk go as a failed restore's would
            await teardown(host, plan.name, standby.vm, standby.image, plan.work, plan.keep_work)
        raise


async def _bring_up(host: Host, plan: MachinePlan, standby: Standby | None) -> tuple[Machine, BringUpTiming]:
    name = plan.name
    image: BlockImage | None = standby.image if standby is not None else None
    vm: QemuProcess | None = standby.vm if standby is not None else None
    net: SandboxNet | None
    try:
        t1 = time.monotonic()
        if vm is None:
            _fresh_dirs(host, plan)
            disk = plan.disk
            image = await asyncio.to_thread(
                BlockImage.open, host.store, disk.top, name, upper_dir=plan.work / UPPER,
                size=None if disk.size_mib is None else disk.size_mib << 20, fresh_upper=disk.fresh_upper,
                min_free_disk=host.min_free_disk)
            if host.readahead > 0 and plan.readahead:   # sequential reads of a cold disk find the next chunks fetched
                Prefetcher(image, window=host.readahead)
            host.nbd.add_export(image)
            jail = host.confinement.jail(name)
            uid = jail.uid if jail is not None else None
            await host.nbd.listen(name, host.vm_dir(name) / "nbd.sock", owner=uid)
            network = await host.networks.attach(name, plan.policy, owner=uid, user_mode=plan.user_mode)
            net = network.net
            spec = machine_spec(host, plan, network, jail)
            t1 = time.monotonic()
            vm = await QemuProcess.start(spec)
        else:
            net = host.networks.get(name)
        if plan.background:
            prioritise(vm, Priority.BACKGROUND)
        elif plan.starting is not None:
            plan.starting.started(vm)
        assert image is not None
        t2 = t3 = time.monotonic()
        start = plan.start
        if isinstance(start, Restore):
            if start.delta is not None:
                delta, pid, memory = start.delta, vm.pid, plan.memory_file
                await asyncio.to_thread(lambda: write_pages(pid, ram_mapping(pid, memory), delta.pages, delta.data,
                                                                  delta.release))
            t3 = time.monotonic()
            await load_device_state(vm, await host.networks.device_state(start.device_state))
        t4 = time.monotonic()
        greeting = plan.greeting
        envd = EnvdClient(*envd_address(net, vm.spec), greeting.token)
        version: str | None = None
        if greeting.probe_health:
            try:
                version = await envd.wait_healthy(timeout=greeting.timeout, alive=vm.alive)
            except VmError as e:
                if not isinstance(start, Boot):
                    raise
                raise VmError(f"{start.failure}: {e}\n{vm.log_tail()}") from None
        t5 = time.monotonic()
        body: dict[str, object] = dict(greeting.body)
        if isinstance(start, Restore):
            body["closeConnections"] = True    # the saved guest's client connections are dead: envd closes them
        if greeting.clock:
            body["timestamp"] = clock()
        if greeting.probe_health:
            await envd.init(body)
        else:
            await envd.init_when_ready(body, greeting.timeout, vm.alive)
        t6 = time.monotonic()
        if plan.starting is not None:
            plan.starting.answered(vm)
    except BaseException as e:
        if plan.starting is not None and vm is not None:
            plan.starting.left(vm)
        await teardown(host, name, vm, image, plan.work, plan.keep_work)
        if isinstance(e, Exception) and plan.memory is not None and (
                lazy := host.lazy_image(plan.memory)) is not None and lazy.error:
            # the QEMU died of a memory page the store could not give (corrupt or missing chunk)
            raise LazyMemoryError(f"sandbox {name} cannot run: {lazy.error}") from e
        raise
    machine = Machine(name, vm, image, plan.work, plan.keep_work, net, envd.with_token(greeting.token_after),
                      version)
    return machine, BringUpTiming(t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t4)


async def start_standby(host: Host, spec: VmSpec) -> QemuProcess:
    """The next QEMU of a paused sandbox whose last QEMU ran ``spec``: started now, waiting
    for its device state (a resume brings it to ``bring_up`` as a ``Standby``). User
    mode: a new host port; tap mode: the same namespace (kept until the standby goes)."""
    network = await host.networks.attach_again(spec)
    return await QemuProcess.start(dataclasses.replace(network.on(spec), incoming_defer=True))
