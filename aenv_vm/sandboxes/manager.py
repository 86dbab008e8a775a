"""Sandboxes restored from templates, and the warm pool.

``SandboxManager.create(template)`` never cold-boots: it maps the template's
memory file ``share=off`` (copy-on-write, shared page cache), gives the
sandbox its own writable upper disk layer over the template's disk layer
(served by one NBD server per manager), starts QEMU with ``-incoming defer``,
loads the device state, waits for envd and calls envd ``/init`` (env vars,
access token, clock). Any failure tears the half-made sandbox down.

Every restored clone first gets its own identity through envd ``/init``
(hostname = sandbox id, host entropy credited to the kernel RNG and reseeded,
clock), without starting a process. Under TCG the first requests to a freshly
restored VM are slow: the software CPU translates the guest's code afresh in
each QEMU process. So a pool per template keeps ``pool_size`` sandboxes
restored and warmed -- each ran the SDK's own command path (``bash -l -c`` as
the default user and as root) and a file write and read, at low CPU priority
-- and ``create`` takes one (then only ``/init`` remains) and refills in the
background. pool_size 0 disables the pool.

Networking (aenv_vm/net/networks.py): user-mode with host port forwards, or
tap mode where each sandbox's QEMU runs in its own network namespace (made
before QEMU starts, removed with it). ``Sandbox.endpoint(port)`` says where
the host reaches a guest port in either mode.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from aenv_store.store import Store

from .blockimage.image import BlockImage
from .blockimage.nbd_server import NbdServer
from .envd_client import init as envd_init, read_file, run_command, write_file
from .guest import GuestImage, wait_http_ok
from .ksm import KsmSettings, enable as ksm_enable
from .net.netns import SandboxNet
from .net.networks import NodeNetworks
from .qemu.errors import VmError
from .qemu.launcher import ENVD_PORT, GUEST_IP, NbdDisk, QemuProcess, VmSpec, free_port
from .qemu.migration import load_device_state
from .template import Template, TemplateError, find_template, materialize

if TYPE_CHECKING:
    from .records import SandboxRecord
    from .snapshot.snapshotter import SnapshotInfo, Snapshotter

log = logging.getLogger(__name__)


class SandboxError(VmError):
    """A sandbox could not be created or found."""


@dataclass(frozen=True)
class CreateTiming:
    qemu_start: float       # QEMU process start until QMP answers (-incoming defer)
    state_load: float       # device state loaded, VM running
    first_answer: float     # envd /health answered
    identity: float         # envd /init with hostname, entropy, clock
    init: float             # envd /init (env vars, token, clock)
    total: float
    from_pool: bool
    warm: float = 0.0       # pool only, before hand-out: the SDK's command path and a file write/read


@dataclass
class Sandbox:
    id: str
    template: Template
    vm: QemuProcess
    image: BlockImage
    dir: Path
    created: float = field(default_factory=time.time)
    timing: CreateTiming | None = None
    net: SandboxNet | None = None       # tap mode: the sandbox's network namespace
    _forwards: dict[int, int] = field(default_factory=dict, repr=False)   # user mode: guest port -> host port

    @property
    def envd_host(self) -> str:
        return "127.0.0.1" if self.net is None else self.net.ns_ip

    @property
    def envd_port(self) -> int:
        if self.net is not None:
            return ENVD_PORT
        assert self.vm.spec.host_port is not None
        return self.vm.spec.host_port

    @property
    def envd_url(self) -> str:
        return f"http://{self.envd_host}:{self.envd_port}"

    async def endpoint(self, port: int) -> tuple[str, int]:
        """``(host, port)`` where the host reaches guest TCP ``port``: in tap mode the
        namespace address (every port is DNATed to the guest); in user mode 127.0.0.1
        and a host port forwarded by QEMU (envd's at start, others added on first use
        with QMP ``hostfwd_add``; they go with this QEMU)."""
        if self.net is not None:
            return self.net.endpoint(port)
        if port == ENVD_PORT:
            return "127.0.0.1", self.envd_port
        host_port = self._forwards.get(port)
        if host_port is None:
            if self.vm.qmp is None:
                raise SandboxError(f"sandbox {self.id} has no QMP connection to forward port {port}")
            host_port = free_port()
            reply = await self.vm.qmp.execute("human-monitor-command", {
                "command-line": f"hostfwd_add net0 tcp:127.0.0.1:{host_port}-{GUEST_IP}:{port}"})
            if isinstance(reply, str) and reply.strip():
                raise SandboxError(f"forwarding port {port} of sandbox {self.id} failed: {reply.strip()}")
            self._forwards[port] = host_port
        return "127.0.0.1", host_port

    @property
    def serial_log(self) -> Path:
        return self.vm.spec.serial_log


# Nice value of pooled (not yet handed out) sandboxes' QEMU processes.
POOL_NICE = 10
# After a create the refill waits this long before restoring the next clone, so
# that its QEMU start, state load and warm-up (and this process's share: fork,
# QMP, NBD) do not compete with the new sandbox's first requests. Measured here
# (load ~10): the first command after a pooled create took ~80 ms p50 without a
# concurrent refill, 130-650 ms with one.
POOL_REFILL_DELAY = 1.0


def _renice(pgid: int, nice: int) -> None:
    """Set the nice value of every thread of QEMU's process group (threads created
    later inherit it from their creator). Raising priority back needs root."""
    try:
        os.setpriority(os.PRIO_PGRP, pgid, nice)
    except OSError as e:
        log.debug("renice of QEMU group %d to %d failed: %s", pgid, nice, e)


class SandboxManager:
    """Creates, tracks and kills this node's sandboxes. Use within one event loop."""

    def __init__(self, store: Store, guest: GuestImage, run_root: Path, *, pool_size: int = 0,
                 ready_timeout: float = 60.0, tcg_tb_mib: int | None = None,
                 default_timeout: float = 300.0, ksm: KsmSettings | None = None, network: str = "user") -> None:
        self.store = store
        self.guest = guest
        self.run_root = run_root
        self.pool_size = pool_size
        self.ready_timeout = ready_timeout
        self.tcg_tb_mib = tcg_tb_mib
        self.ksm = ksm   # None: QEMU's default (only guest RAM is mergeable, if ksmd runs)
        self.networks = NodeNetworks(network, run_root)   # "user" or "tap" (root)
        self.sandboxes: dict[str, Sandbox] = {}
        self._pools: dict[str, list[Sandbox]] = {}
        self._refills: dict[str, asyncio.Task] = {}
        self._local_lock = asyncio.Lock()
        self.nbd = NbdServer(run_root / "nbd.sock")
        self._started = False
        self.default_timeout = default_timeout
        self.lifecycle: "Snapshotter | None" = None   # pause/resume/snapshot/fork, records, TTL (start())

    async def start(self) -> None:
        self.run_root.mkdir(parents=True, exist_ok=True)
        (self.run_root / "sandboxes").mkdir(exist_ok=True)
        await self.networks.start()
        await self.nbd.start()
        if self.ksm is not None and (why := await asyncio.to_thread(ksm_enable, self.ksm)) is not None:
            log.warning("KSM not enabled: %s", why)
        self._started = True
        from .snapshot.snapshotter import Snapshotter
        self.lifecycle = Snapshotter(self, self.default_timeout)
        await self.lifecycle.start()

    def process_flags(self) -> dict[str, bool]:
        """VmSpec fields every sandbox QEMU of this node gets (KSM, address layout)."""
        k = self.ksm
        return {"merge_memory": k is not None, "fixed_layout": k is not None and k.fixed_layout}

    async def __aenter__(self) -> "SandboxManager":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _template(self, ref: str) -> Template:
        tpl = find_template(self.store, ref)
        if tpl.guest_key != self.guest.key:
            raise TemplateError(f"template {tpl.id} was built from guest {tpl.guest_key}, this node runs guest "
                                f"{self.guest.key}: rebuild the template")
        return tpl

    async def _restore(self, tpl: Template, background: bool = False, egress: bool = True,
                       init: Callable[[str], dict] | None = None) -> Sandbox:
        """A running, envd-ready sandbox restored from ``tpl`` (not yet /init-ed).

        ``background`` (pool refills): QEMU runs at a low CPU priority until it is
        handed out, so refilling never slows the sandboxes users already have.
        ``egress``: outbound connections allowed (tap mode).
        ``init`` (fork children): sandbox id → more /init fields (the new access token), sent
        with the identity as the clone's first and only request (no /health first:
        snapshot/first_init.py); ``timing.identity`` then covers it all."""
        if not self._started:
            raise SandboxError("SandboxManager.start() was not called")
        async with self._local_lock:  # one writer of the local template files
            mem, state = await asyncio.to_thread(materialize, self.store, tpl, self.run_root / "templates")
        sid = "sbx-" + secrets.token_hex(8)
        sdir = self.run_root / "sandboxes" / sid
        sdir.mkdir(parents=True)
        image: BlockImage | None = None
        vm: QemuProcess | None = None
        try:
            # off the event loop: 20-50 ms here, 16 at once in a fork
            image = await asyncio.to_thread(BlockImage.open, self.store, tpl.disk, sid, upper_dir=sdir / "upper")
            self.nbd.add_export(image)
            netfields = await self.networks.attach(sid, egress)
            state = await self.networks.device_state(state)
            spec = VmSpec(name=sid, kernel=self.guest.kernel, initrd=self.guest.initrd,
                          kernel_cmdline=tpl.kernel_cmdline, run_dir=sdir, memory_mib=tpl.memory_mib,
                          vcpus=tpl.vcpus, accel=tpl.accel,  # type: ignore[arg-type]
                          mem_path=mem, mem_share=False, disk=NbdDisk(self.nbd.socket_path, sid),
                          incoming_defer=True, tcg_tb_mib=self.tcg_tb_mib,
                          **netfields, **self.process_flags())  # type: ignore[arg-type]
            t0 = time.monotonic()
            vm = await QemuProcess.start(spec)
            if background:
                _renice(vm.pid, POOL_NICE)
            t1 = time.monotonic()
            await load_device_state(vm, state)
            t2 = time.monotonic()
            sbx = Sandbox(sid, tpl, vm, image, sdir, net=self.networks.get(sid))
            if init is not None:
                from .snapshot.first_init import init_when_ready
                t3 = time.monotonic()
                await init_when_ready(sbx.envd_host, sbx.envd_port, {**self._identity(sid), **init(sid)},
                                      self._life.template_token(tpl), self.ready_timeout, vm.alive)
                t4 = time.monotonic()
            else:
                await wait_http_ok(sbx.envd_port, "/health", timeout=self.ready_timeout, alive=vm.alive,
                                   host=sbx.envd_host)
                t3 = time.monotonic()
                # a snapshot's envd still holds its sandbox's access token
                await self._set_identity(sid, sbx.envd_port, self._life.template_token(tpl), host=sbx.envd_host)
                t4 = time.monotonic()
            sbx.timing = CreateTiming(t1 - t0, t2 - t1, t3 - t2, t4 - t3, 0.0, t4 - t0, False)
            return sbx
        except BaseException:
            await self._teardown(sid, vm, image, sdir)
            raise

    async def _set_identity(self, sid: str, port: int, access_token: str | None = None,
                            host: str = "127.0.0.1") -> None:
        """Give a restored clone its own hostname, fresh kernel randomness and the host's clock.

        Every clone of a template wakes up with the template's hostname, RNG state
        and clock; one envd /init sets all three (docs/envd.md), no process start."""
        await asyncio.to_thread(envd_init, port, self._identity(sid), access_token=access_token, host=host)

    @staticmethod
    def _identity(sid: str) -> dict:
        """/init fields of a clone's identity: hostname, fresh entropy, the host's clock."""
        return {"hostname": sid, "entropy": base64.b64encode(secrets.token_bytes(64)).decode(),
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat()}

    async def _warm(self, sbx: Sandbox, access_token: str | None = None) -> None:
        """Run what a user's first calls run, so that this QEMU has translated it before
        hand-out: a file write and read and the SDK's command request (``bash -l -c`` as
        envd's default user, then as root, which also removes the file). Templates built
        under TCG have the guest's ASLR off, so the user's commands reuse these
        translations instead of paying them (docs/guest.md)."""
        port, host, path = sbx.envd_port, sbx.envd_host, f"/tmp/.aenv-warm-{sbx.id}"

        def work() -> None:
            write_file(port, path, b"warm", access_token=access_token, host=host)
            if read_file(port, path, access_token=access_token, host=host) != b"warm":
                raise SandboxError(f"warming {sbx.id}: file read back differs")
            for user, cmd in ((None, "true"), ("root", f"rm -f {path}")):
                result = run_command(port, cmd, user=user, timeout=60.0, access_token=access_token, host=host)
                if result.exit_code != 0:
                    raise SandboxError(f"warming {sbx.id}: {cmd!r} as {user or 'default user'} exited "
                                       f"{result.exit_code}")
        await asyncio.to_thread(work)

    async def create(self, template: str, *, env_vars: dict[str, str] | None = None,
                     access_token: str | Callable[[str], str] | None = None, timeout: float | None = None,
                     metadata: dict[str, str] | None = None, auto_pause: bool = True,
                     allow_internet_access: bool | None = None) -> Sandbox:
        """A new sandbox from ``template`` (id or alias), envd initialised.
        ``allow_internet_access``: False = the guest may not open outbound connections
        (None, not set: it may)."""
        egress = allow_internet_access is not False
        t0 = time.monotonic()
        tpl = self._template(template)
        # Pooled clones have egress on; user mode cannot turn it off in a running QEMU.
        pool = self._pools.get(tpl.id, []) if egress or self.networks.tap else []
        sbx = None
        while pool and sbx is None:
            candidate = pool.pop(0)
            if candidate.vm.alive():
                sbx = candidate
            else:
                await self._teardown(candidate.id, candidate.vm, candidate.image, candidate.dir)
        from_pool = sbx is not None
        if sbx is not None:
            _renice(sbx.vm.pid, 0)
        if sbx is None:
            sbx = await self._restore(tpl, egress=egress)
        self._schedule_refill(tpl, POOL_REFILL_DELAY)
        if callable(access_token):  # derived from the sandbox id (the API's HMAC), known only now
            access_token = access_token(sbx.id)
        try:
            ti = time.monotonic()
            await self.networks.set_egress(sbx.id, egress)   # pooled: made with egress on
            # The clock was set with the identity at restore and has run since: /init is
            # needed only for env vars and tokens (an empty one would cost a round trip).
            body: dict = {}
            if env_vars:
                body["envVars"] = env_vars
            old = self._life.template_token(tpl)
            if access_token or old:  # a snapshot's token is replaced (or cleared), never inherited
                body["accessToken"] = access_token or ""
            if body:
                await asyncio.to_thread(envd_init, sbx.envd_port, body, host=sbx.envd_host,
                                        **({"access_token": old} if old else {}))
        except BaseException:
            await self._teardown(sbx.id, sbx.vm, sbx.image, sbx.dir)
            raise
        done = time.monotonic()
        base = sbx.timing or CreateTiming(0, 0, 0, 0, 0, 0, False)
        if from_pool:  # restore work happened before this create asked
            base = CreateTiming(0, 0, 0, 0, 0, 0, True)
        sbx.timing = CreateTiming(base.qemu_start, base.state_load, base.first_answer, base.identity,
                                  done - ti, done - t0, from_pool)
        sbx.created = time.time()
        self.sandboxes[sbx.id] = sbx
        self._life.on_created(sbx, timeout=timeout, metadata=metadata, auto_pause=auto_pause,
                              env_vars=env_vars, access_token=access_token,
                              allow_internet_access=allow_internet_access)
        return sbx

    def _schedule_refill(self, tpl: Template, delay: float = 0.0) -> None:
        if self.pool_size <= 0:
            return
        task = self._refills.get(tpl.id)
        if task is None or task.done():
            self._refills[tpl.id] = asyncio.get_running_loop().create_task(self._refill(tpl, delay))

    async def _refill(self, tpl: Template, delay: float = 0.0) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        pool = self._pools.setdefault(tpl.id, [])
        while len(pool) < self.pool_size:
            try:
                sbx = await self._restore(tpl, background=True)  # at low priority
            except (VmError, OSError) as e:
                log.warning("pool refill for %s failed: %s", tpl.id, e)
                return
            t0 = time.monotonic()
            try:
                await self._warm(sbx, self._life.template_token(tpl))
            except BaseException as e:
                await self._teardown(sbx.id, sbx.vm, sbx.image, sbx.dir)
                if not isinstance(e, (VmError, OSError)):
                    raise
                log.warning("pool refill for %s: warming failed: %s", tpl.id, e)
                return
            # Warm: wait at normal priority (idle costs little), ready to serve at once.
            _renice(sbx.vm.pid, 0)
            assert sbx.timing is not None
            sbx.timing = dataclasses.replace(sbx.timing, warm=time.monotonic() - t0)
            pool.append(sbx)

    async def fill_pool(self, template: str) -> None:
        """Fill the pool of ``template`` now (e.g. at server start) and wait for it."""
        tpl = self._template(template)
        self._schedule_refill(tpl)
        with contextlib.suppress(Exception):
            await self._refills[tpl.id]

    def pooled(self, template: str) -> list[Sandbox]:
        """Sandboxes waiting in ``template``'s pool (not handed out)."""
        return list(self._pools.get(self._template(template).id, []))

    def get(self, sandbox_id: str) -> Sandbox:
        try:
            return self.sandboxes[sandbox_id]
        except KeyError:
            raise SandboxError(f"unknown sandbox {sandbox_id!r}") from None

    async def kill(self, sandbox_id: str) -> None:
        async with self._life.lock(sandbox_id):
            sbx = self.sandboxes.pop(sandbox_id, None)
            if sbx is None:
                if await self._life.forget(sandbox_id):  # paused or lost
                    return
                raise SandboxError(f"unknown sandbox {sandbox_id!r}")
            await self._teardown(sbx.id, sbx.vm, sbx.image, sbx.dir)
            self._life.on_killed(sandbox_id)

    async def _teardown(self, sid: str, vm: QemuProcess | None, image: BlockImage | None, sdir: Path) -> None:
        if vm is not None:
            await vm.stop(timeout=2.0)
        await self.networks.release(sid)
        self.nbd.remove_export(sid)
        if image is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(image.close)
        shutil.rmtree(sdir, ignore_errors=True)

    async def close(self) -> None:
        """Kill every sandbox (pooled too), stop the NBD server, remove local run state.
        Paused sandboxes are kept (their records and files live outside ``sandboxes/``)."""
        if self.lifecycle is not None:
            await self.lifecycle.close()
        for task in self._refills.values():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self._refills.clear()
        for pool in self._pools.values():
            for sbx in pool:
                await self._teardown(sbx.id, sbx.vm, sbx.image, sbx.dir)
        self._pools.clear()
        for sid in list(self.sandboxes):
            await self.kill(sid)
        if self._started:
            await self.nbd.close()
            self._started = False
        shutil.rmtree(self.run_root / "sandboxes", ignore_errors=True)
        await self.networks.close()
        if self.lifecycle is not None:
            self.lifecycle.close_records()
            self.lifecycle = None

    # --- pause / resume / snapshot / fork / TTL (aenv_vm/snapshot/snapshotter.py) ---
    @property
    def _life(self) -> "Snapshotter":
        if self.lifecycle is None:
            raise SandboxError("SandboxManager.start() was not called")
        return self.lifecycle

    async def pause(self, sandbox_id: str) -> "SandboxRecord":
        return await self._life.pause(sandbox_id)

    async def resume(self, sandbox_id: str, timeout: float | None = None) -> Sandbox:
        return await self._life.resume(sandbox_id, timeout)

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> tuple[str, list[str]]:
        return await self._life.snapshot(sandbox_id, name)

    async def fork(self, sandbox_id: str, count: int, timeout: float | None = None,
                   access_token: Callable[[str], str] | None = None) -> list[Sandbox | Exception]:
        return await self._life.fork(sandbox_id, count, timeout, access_token)

    async def set_timeout(self, sandbox_id: str, seconds: float) -> "SandboxRecord":
        return self._life.set_timeout(sandbox_id, seconds)

    async def list_snapshots(self) -> list["SnapshotInfo"]:
        return await asyncio.to_thread(self._life.list_snapshots)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await asyncio.to_thread(self._life.delete_snapshot, snapshot_id)

    def record(self, sandbox_id: str) -> "SandboxRecord":
        """The sandbox's record: state (running/paused/lost), metadata, started/end times."""
        return self._life.record(sandbox_id)

    def records(self) -> list["SandboxRecord"]:
        return self._life.records.all()
