"""One build, start to end (docs/templates.md):

1. **base**: the disk layer and starting state of ``fromTemplate`` (its frozen disk;
   ``base`` and E2B's ``e2bdev/base`` image are this node's base template) or of
   ``fromImage`` (pulled into a store image: aenv_vm/oci; its config's Env).
2. **steps**, with the build cache: step *i*'s key is (the layer it starts from, the
   state it starts with, the step: type, args, files hash). A hit gives the layer and
   state after it without a VM; the first miss boots a build VM from the layer so far,
   and from there every step runs in it (each disk-changing step committed as a layer
   and cached). ``force`` (the SDK's ``skip_cache``) or a step's own ``force`` turn
   hits into misses from that step on.
3. **finalize**: the start command started (as the state's user, in its workdir, with
   its envs; which command, and whether a parent's or an image's start is run instead:
   start.py), the ready command polled until it exits 0, envd given the template's
   defaults, and the running VM frozen into a ``tpl-…`` record. An unchanged rebuild
   (same last layer, state, commands and shape) reuses the template the earlier one
   made, without booting anything.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import ConfigError
from aenv_store.formats.ids import Digest
from aenv_wire.builds import BuildResources, BuildSpec, Step, StepKind

from ..envd_client import EnvdError, ProcessRequest, stream_process
from ..errors import BadRequest, NotFound, VmError
from ..oci.auth import Credentials
from ..oci.config import OciConfig
from ..oci.errors import OciError
from ..oci.pull import Puller
from ..qemu.launcher import Accel
from ..sandboxes.runtime import NodeRuntime
from ..templates.template import find_template
from ..templates.trust import CaBundle, ca_env, install_ca_certificates
from . import records
from .context import ContextError, context_parts
from .copy import copy_script, part_path
from .log import BuildLog
from .start import BaseStart, StartPlan, image_start, plan_start
from .steps import StepState, next_state
from .vm import BuildVm, VmShape

E2B_BASE_IMAGE = re.compile(r"(docker\.io/)?e2bdev/base(:[\w.-]+)?\Z")
READY_INTERVAL = 1.0
START_SETTLE = 2.0          # no ready command: the start command must survive this long
MiB = 1 << 20


class BuildFailed(VmError):
    """A build stopped; ``step`` names where (``base``, a step number, ``finalize``)."""

    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class BuildSettings:
    base_template: str              # what ``base`` means on this node
    accel: Accel
    memory_mib: int                 # defaults when the request gives none
    vcpus: int
    disk_mib: int                   # 0: the base's size plus ``headroom_mib``
    max_memory_mib: int = 16384
    max_vcpus: int = 16
    headroom_mib: int = 2048        # free space a build VM's disk gets above its base
    step_timeout: float = 3600.0
    ready_timeout: float = 300.0
    boot_timeout: float = 240.0
    oci: OciConfig | None = None
    data_dir: Path | None = None
    ca_bundle: CaBundle | None = None   # [vm] trust_host_ca: installed in every build VM (templates/trust.py)
    max_context_bytes: int = 8 << 30    # what a COPY context may inflate to ([templates] max_context_mib)

    @property
    def setup_key(self) -> str:
        """What the node puts on every build VM's disk (part of the base's cache key)."""
        return self.ca_bundle.fingerprint if self.ca_bundle is not None else ""


@dataclass(frozen=True)
class BuildJob:
    name: str
    build_id: str
    spec: BuildSpec
    resources: BuildResources = BuildResources()


@dataclass(frozen=True)
class BuildResult:
    template: str                   # the tpl-… record
    cached: bool                    # the whole template came from the cache
    shape: VmShape
    envd_version: str | None
    state: StepState


@dataclass
class _Base:
    layer: Digest
    state: StepState
    size_mib: int
    disk_mib: int                   # the base template's disk (0 for an image)
    start: BaseStart | None = None  # what the base starts (start.py)


class Build:
    def __init__(self, rt: NodeRuntime, settings: BuildSettings, job: BuildJob, log: BuildLog) -> None:
        self.rt = rt
        self.settings = settings
        self.job = job
        self.log = log
        self.vm: BuildVm | None = None

    # ------------------------------------------------------------------ base

    async def _base(self) -> _Base:
        spec, st = self.job.spec, self.settings
        ref = spec.from_template
        if ref is None and spec.from_image and E2B_BASE_IMAGE.match(spec.from_image):
            ref = "base"
            self.log.info(f"{spec.from_image} is this node's base template", "base")
        if ref is not None:
            try:
                tpl = find_template(self.rt.store, st.base_template if ref == "base" else ref)
            except NotFound:
                raise BuildFailed(f"unknown template {ref!r}", "base") from None
            if tpl.guest_key != self.rt.guest.key:
                raise BuildFailed(f"template {ref!r} was built from another guest build: rebuild it first", "base")
            built = tpl.meta.build_state
            state = StepState.from_json(built) if built is not None else StepState()
            size = self.rt.store.load_manifest(tpl.disk).size // MiB
            self.log.info(f"base: template {ref} ({tpl.id})", "base")
            meta = tpl.meta
            start = (BaseStart(meta.start_cmd, meta.ready_cmd, meta.start_user or state.user,
                               meta.start_workdir or state.workdir, f"template {ref}")
                     if meta.start_cmd or meta.ready_cmd else None)
            return _Base(tpl.disk, state, size, tpl.disk_mib or size, start)
        assert spec.from_image is not None
        if st.oci is None or st.data_dir is None:
            raise BuildFailed("this node pulls no images (no [oci] configuration)", "base")
        creds = Credentials(spec.registry.username, spec.registry.password) if spec.registry else None
        self.log.info(f"pulling {spec.from_image}", "base")
        try:
            # the guest tools go into the image (aenv_vm/tools): envd runs in any root filesystem
            puller = Puller(self.rt.store, st.oci, st.data_dir, spec.from_image, credentials=creds,
                            log_line=lambda line: self.log.info(line, "base"), tools=self.rt.guest.tools_tree)
            pulled = await puller.run_async()
        except (OciError, BadRequest) as e:
            raise BuildFailed(f"pulling {spec.from_image} failed: {e}", "base") from None
        img = pulled.image
        envs: dict[str, str] = {}
        env_list = img.runtime.get("Env") or []
        for item in env_list if isinstance(env_list, list) else []:
            k, sep, v = str(item).partition("=")
            if sep and k:
                envs[k] = v
        self.log.info(f"base: image {pulled.reference} ({pulled.digest[:19]}, {pulled.layers} layers, "
                      f"{pulled.downloaded_bytes} bytes downloaded)", "base")
        return _Base(img.layer_id, StepState().with_envs(envs), img.size // MiB, 0,
                     image_start(img.runtime, spec.from_image))

    def _shape(self, base: _Base) -> VmShape:
        st, asked = self.settings, self.job.resources
        vcpus = asked.cpu_count or st.vcpus
        memory = asked.memory_mb or st.memory_mib
        if not 1 <= vcpus <= st.max_vcpus:
            raise BadRequest(f"cpuCount must be 1..{st.max_vcpus}, got {vcpus}")
        if not 128 <= memory <= st.max_memory_mib:
            raise BadRequest(f"memoryMB must be 128..{st.max_memory_mib}, got {memory}")
        disk = max(base.disk_mib, st.disk_mib or 0, base.size_mib + st.headroom_mib)
        if asked.min_free_disk_mb:
            disk = max(disk, base.size_mib + asked.min_free_disk_mb)
        return VmShape(memory, vcpus, disk, st.accel)

    # ------------------------------------------------------------------ VM

    async def _ensure_vm(self, layer: Digest, shape: VmShape, label: str) -> BuildVm:
        if self.vm is not None:
            return self.vm
        self.log.info(f"starting the build VM ({shape.vcpus} vCPU, {shape.memory_mib} MiB, "
                      f"{shape.disk_mib} MiB disk)", label)
        t0 = time.monotonic()
        try:
            self.vm = await BuildVm.boot(self.rt, f"build-{self.job.build_id[:12]}-{secrets.token_hex(2)}", layer,
                                         shape, self.settings.boot_timeout)
            await self.vm.grow_root()
            ca = self.settings.ca_bundle
            if ca is not None:
                # at every boot (a VM booted from a cached layer has the files already:
                # nothing is added, but envd's environment must name the bundle again)
                trusted = await install_ca_certificates(self.vm.envd, ca)
                await self.vm.envd.init({"envVars": ca_env(trusted.bundle_path)})
        except (VmError, ConfigError) as e:
            raise BuildFailed(f"the build VM did not start: {e}", label) from None
        self.log.info(f"build VM ready in {time.monotonic() - t0:.1f} s", label)
        return self.vm

    # ------------------------------------------------------------------ steps

    async def _run_step(self, vm: BuildVm, step: Step, state: StepState) -> None:
        label = step.label
        if step.kind == StepKind.RUN:
            user = step.args[1] if len(step.args) > 1 and step.args[1] else state.user
            req = ProcessRequest("/bin/bash", ("-l", "-c", step.args[0]), user=user, cwd=state.workdir,
                                 envs=state.env_dict())
            await self._checked(vm, req, label, what=f"RUN {step.args[0][:200]}")
        elif step.kind == StepKind.COPY:
            src, dest = step.args[0], step.args[1]
            owner = step.args[2] if len(step.args) > 2 and step.args[2] else None
            mode = step.args[3] if len(step.args) > 3 and step.args[3] else None
            assert step.files_hash is not None
            stage = f"/tmp/.aenv-copy-{secrets.token_hex(6)}.tar"
            await self._send_context(vm, step.files_hash, stage, src, label)
            script = copy_script(stage, src, dest, state, owner, mode)
            await self._checked(vm, ProcessRequest("/bin/sh", ("-c", script), user="root", cwd="/"), label,
                                what=f"COPY {src} {dest}")
        elif step.kind == StepKind.WORKDIR:
            path = next_state(step, state).workdir
            script = (f"mkdir -p -- '{path}' 2>/dev/null || /.aenv/bin/busybox mkdir -p -- '{path}'; "
                      f"[ '{state.user}' = root ] || chown '{state.user}:' '{path}' 2>/dev/null || true")
            if "'" in path or "'" in state.user:
                raise BuildFailed(f"WORKDIR {path!r}: quotes are not allowed in paths here", label)
            await self._checked(vm, ProcessRequest("/bin/sh", ("-c", script), user="root", cwd="/"), label,
                                what=f"WORKDIR {path}")
        elif step.kind == StepKind.USER:
            code, out = await vm.sh(f"id -u -- '{step.args[0].split(':', 1)[0]}'", timeout=60.0)
            if code != 0:
                raise BuildFailed(f"USER {step.args[0]}: no such user in the image", label)

    async def _send_context(self, vm: BuildVm, files_hash: str, stage: str, src: str, label: str) -> None:
        """The COPY context into the build VM as a plain tar in parts (context.py): read,
        inflated and checked a part at a time, never whole in the node's memory."""
        try:
            read, size = await asyncio.to_thread(records.open_files, self.rt.store, files_hash)
        except NotFound as e:
            raise BuildFailed(f"COPY {src}: {e}", label) from None
        parts = context_parts(read, size, self.settings.max_context_bytes)
        # one thread inflates the whole context: its buffers stay in one malloc arena
        # instead of one per default-executor thread (measured: the node's RSS)
        inflater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-context")
        loop = asyncio.get_running_loop()
        index = 0
        try:
            while True:
                part = await loop.run_in_executor(inflater, next, parts, None)
                if part is None:
                    break
                await vm.envd.write_file(part_path(stage, index), part, user="root", timeout=600.0)
                index += 1
        except (ContextError, BadRequest) as e:
            raise BuildFailed(f"COPY {src}: {e}", label) from None
        except EnvdError as e:
            raise BuildFailed(f"COPY {src}: uploading the files into the build VM failed: {e}", label) from None
        finally:
            await loop.run_in_executor(inflater, parts.close)
            inflater.shutdown(wait=False)

    async def _checked(self, vm: BuildVm, req: ProcessRequest, label: str, what: str) -> None:
        t0 = time.monotonic()
        timeout = self.settings.step_timeout
        try:
            code = await vm.run(req, timeout=timeout, on_output=lambda s, d: self.log.output(label, s, d))
        except VmError as e:
            self.log.flush(label)
            raise BuildFailed(f"{what}: {e}", label) from None
        self.log.flush(label)
        if code != 0:
            if time.monotonic() - t0 >= timeout:
                raise BuildFailed(f"{what}: did not finish in {timeout:.0f} s", label)
            raise BuildFailed(f"{what}: exited with code {code}", label)

    # ------------------------------------------------------------------ the whole

    async def run(self) -> BuildResult:
        try:
            return await self._run()
        finally:
            if self.vm is not None:
                await self.vm.close()
                self.vm = None

    async def _run(self) -> BuildResult:
        spec, store = self.job.spec, self.rt.store
        base = await self._base()
        shape = self._shape(base)
        layer, state = base.layer, base.state
        forced = spec.force
        # the base's key: its layer and state, the disk it is grown to, what the node sets up in it
        parent = records.cache_key("base", {"layer": bytes(layer).hex(), "state": state.to_json(),
                                            "disk_mib": shape.disk_mib, "setup": self.settings.setup_key})
        for step in spec.steps:
            label = step.label
            key = records.cache_key(parent, {"layer": bytes(layer).hex(), "state": state.to_json(),
                                             **step.identity()})
            forced = forced or step.force
            hit = None if forced or self.vm is not None else records.find_step(store, key)
            if hit is not None:
                self.log.info(f"CACHED [{label}/{len(spec.steps)}] {step.describe()}", label)
                layer, state, parent = hit.layer, hit.state, key
                continue
            self.log.info(f"[{label}/{len(spec.steps)}] {step.describe()}", label)
            t0 = time.monotonic()
            new_state = next_state(step, state)
            if step.changes_disk:
                vm = await self._ensure_vm(layer, shape, label)
                await self._run_step(vm, step, state)
                try:
                    layer = await vm.commit_layer({"build": self.job.build_id, "step": label})
                except VmError as e:
                    raise BuildFailed(f"committing the disk after {step.describe()} failed: {e}", label) from None
            elif step.kind == StepKind.USER and self.vm is not None:
                await self._run_step(self.vm, step, state)
            state = new_state
            await asyncio.to_thread(records.put_step, store, key, layer, state, step.describe())
            self.log.info(f"done in {time.monotonic() - t0:.1f} s", label)
            parent = key
        return await self._finalize(layer, state, shape, parent, forced, plan_start(spec, base.start))

    async def _finalize(self, layer: Digest, state: StepState, shape: VmShape, parent: str,
                        forced: bool, plan: StartPlan) -> BuildResult:
        store = self.rt.store
        start_cmd, ready_cmd = plan.cmd, plan.ready_cmd
        # an inherited start's user and directory are part of what is frozen (the request's
        # own start runs with ``state``, which the key has already)
        start_key: list[str | None] | str | None = (
            [start_cmd, plan.user, plan.workdir] if plan.inherited and start_cmd else start_cmd)
        key = records.cache_key(parent, {"layer": bytes(layer).hex(), "state": state.to_json(),
                                         "start": start_key, "ready": ready_cmd,
                                         "vcpus": shape.vcpus, "memory_mib": shape.memory_mib,
                                         "disk_mib": shape.disk_mib, "accel": shape.accel,
                                         "guest": self.rt.guest.key})
        if not forced and self.vm is None:
            tid = records.find_snapshot(store, key)
            if tid is not None:
                tpl = find_template(store, tid)
                self.log.info(f"CACHED [finalize] template {tid}", "finalize")
                return BuildResult(tid, True, shape, tpl.envd_version, state)
        vm = await self._ensure_vm(layer, shape, "finalize")
        try:
            await vm.envd.init({"envVars": state.env_dict(), "defaultUser": state.user,
                                "defaultWorkdir": state.workdir})
        except VmError as e:
            raise BuildFailed(f"configuring envd failed: {e}", "finalize") from None
        follower = None
        if start_cmd:
            if plan.inherited:
                self.log.info(f"no start command was given: starting the {plan.source}'s "
                              f"(as {plan.user}, in {plan.workdir})", "finalize")
            follower = await self._start(vm, state, start_cmd, plan.user, plan.workdir)
        # an inherited start that ends is not a failure of this build (start.py): the ready
        # command decides
        watched = follower if plan.required else None
        try:
            if ready_cmd:
                await self._wait_ready(vm, state, ready_cmd, watched)
            elif follower is not None:
                await asyncio.sleep(START_SETTLE)
                self._check_alive(watched)
            self._check_alive(watched)
            if follower is not None and watched is None and follower.done():
                self.log.add("warn", f"the {plan.source}'s start command ended before the template was frozen "
                              f"({self._ending(follower)}): sandboxes of this template do not run it", "finalize")
        finally:
            if follower is not None:
                follower.cancel()     # the stream closes; the start command runs on
                await asyncio.gather(follower, return_exceptions=True)
                self.log.flush("finalize")
        tid = f"tpl-{secrets.token_hex(6)}"
        self.log.info(f"snapshotting the running VM as {tid}", "finalize")
        meta = dataclasses.replace(vm.template_meta(), build_state=state.to_json(), build_id=self.job.build_id,
                                   e2b_template=self.job.name, default_user=state.user,
                                   start_cmd=start_cmd or None, ready_cmd=ready_cmd or None,
                                   start_user=plan.user if start_cmd else None,
                                   start_workdir=plan.workdir if start_cmd else None)
        try:
            await vm.freeze(tid, meta)
        except VmError as e:
            raise BuildFailed(f"snapshotting the template failed: {e}", "finalize") from None
        await asyncio.to_thread(records.put_snapshot, store, key, tid)
        return BuildResult(tid, False, shape, vm.envd_version, state)

    async def _start(self, vm: BuildVm, state: StepState, cmd: str, user: str | None = None,
                     workdir: str | None = None) -> "asyncio.Task[int]":
        self.log.info(f"start command: {cmd}", "finalize")
        req = ProcessRequest("/bin/bash", ("-l", "-c", cmd), user=user or state.user, cwd=workdir or state.workdir,
                             envs=state.env_dict())
        task = asyncio.ensure_future(stream_process(vm.envd, req, timeout=None,
                                                    on_output=lambda s, d: self.log.output("finalize", s, d)))
        await asyncio.sleep(0.2)
        return task

    @staticmethod
    def _ending(follower: "asyncio.Task[int]") -> str:
        exc = follower.exception()
        return f"failed: {exc}" if exc else f"exited with code {follower.result()}"

    @classmethod
    def _check_alive(cls, follower: "asyncio.Task[int] | None") -> None:
        """A start command that failed fails the build; one that finished with exit
        code 0 does not (E2B's finalize: a start command may be a one-shot setup,
        and the ready command still decides when the template is ready). None: no
        start command whose end matters."""
        if follower is not None and follower.done():
            if follower.exception() is None and follower.result() == 0:
                return
            raise BuildFailed(f"the start command {cls._ending(follower)} before the template was ready",
                              "finalize")

    async def _wait_ready(self, vm: BuildVm, state: StepState, cmd: str,
                          follower: "asyncio.Task[int] | None") -> None:
        self.log.info(f"waiting for the ready command: {cmd}", "finalize")
        deadline = time.monotonic() + self.settings.ready_timeout
        req = ProcessRequest("/bin/bash", ("-l", "-c", cmd), user=state.user, cwd=state.workdir,
                             envs=state.env_dict())
        tries = 0
        while True:
            tries += 1
            left = deadline - time.monotonic()
            try:
                code = await vm.run(req, timeout=max(1.0, min(60.0, left)))
            except VmError as e:
                code = -1
                self.log.add("debug", f"ready command: {e}", "finalize")
            if code == 0:
                self.log.info(f"ready after {tries} check(s)", "finalize")
                return
            if follower is not None:
                self._check_alive(follower)
            if time.monotonic() + READY_INTERVAL > deadline:
                raise BuildFailed(f"the ready command {cmd!r} did not succeed within "
                                  f"{self.settings.ready_timeout:.0f} s (last exit code {code})", "finalize")
            await asyncio.sleep(READY_INTERVAL)

