"""``TemplateBuilds``: E2B's templates on one node — requesting a build, the COPY
contexts, running builds (one or a few at a time, in the background), their status
and logs, names, tags, listing and deleting. The API (aenv_api/server/templates_api.py)
speaks E2B's wire format over it; everything persistent is in the store's catalog
(records.py), so a restarted node still has its templates, tags and cache. A build's
log lives in memory while it runs and is written to ``<log_dir>/<build id>.json``
when it ends."""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from aenv_store.errors import StoreError
from aenv_store.store import Store
from aenv_wire.builds import BuildResources, BuildSpec, StepKind

from ..errors import BadRequest, Conflict, NotFound, VmError
from ..sandboxes.runtime import NodeRuntime
from ..templates.template import Template, find_template, remove_template
from . import records
from .executor import Build, BuildFailed, BuildJob, BuildSettings
from .log import BuildLog, LogEntry
from .records import DEFAULT_TAG, BuildEntry, TemplateDef

log = logging.getLogger(__name__)

# an uploaded context no build has used yet is kept at least this long whatever the
# retention (the SDK uploads the contexts, then starts the build that uses them)
UNUSED_CONTEXT_GRACE = 3600.0


@dataclass
class BuildRun:
    """A build this node knows of: requested (``waiting``), running, or finished."""
    name: str
    build_id: str
    tags: tuple[str, ...]
    resources: BuildResources
    created: float = field(default_factory=time.time)
    status: str = "waiting"                 # waiting | building | ready | error
    log: BuildLog = field(default_factory=BuildLog)
    reason: tuple[str, str | None] | None = None   # (message, step) of a failure
    finished: float | None = None
    task: "asyncio.Task[None] | None" = None
    # the steps a request made from a Dockerfile (E2B's legacy ``POST /templates``), started
    # by ``start_requested``; None: the start request brings them (``start_build``)
    requested_spec: BuildSpec | None = None
    cancelled: str | None = None        # why an admin cancelled it (cancel_builds), else None
    owner: str = ""                         # the template's (records.TemplateDef.owner)


@dataclass(frozen=True)
class StatusView:
    name: str
    build_id: str
    status: str
    entries: list[LogEntry]
    reason: tuple[str, str | None] | None
    reason_entries: list[LogEntry]


@dataclass(frozen=True)
class TemplateView:
    """One E2B template as the API lists it."""
    template_id: str
    names: tuple[str, ...]
    build: BuildEntry | None                 # the latest ready build
    builds: tuple[BuildEntry, ...]
    created: float
    updated: float
    public: bool
    status: str                              # of the latest build
    owner: str = ""                          # records.TemplateDef.owner ("" the default team)


Users = Callable[[str], list[str]]           # template record -> the sandboxes on it


class TemplateBuilds:
    def __init__(self, rt: NodeRuntime, settings: BuildSettings, log_dir: Path, users: Users,
                 max_parallel: int = 1, context_retention: float = 86400.0) -> None:
        """``context_retention``: seconds an uploaded COPY context is kept after the last
        build that used it ended (``sweep_contexts``)."""
        self.rt = rt
        self.settings = settings
        self.log_dir = log_dir
        self.users = users
        self.context_retention = context_retention
        self._context_used: dict[str, float] = {}      # files hash -> when a build using it ended
        self._context_holds: dict[str, int] = {}       # files hash -> started builds that use it
        self._runs: dict[str, BuildRun] = {}
        self._lock = asyncio.Lock()                    # template definitions: one writer
        self._slots = asyncio.Semaphore(max_parallel)
        self._closing = False

    @property
    def store(self) -> Store:
        return self.rt.store

    async def start(self) -> None:
        """Builds a previous process left unfinished failed with it; templates saved before
        ready builds were names (``name:<build id>``) get those names."""
        def fix() -> None:
            for tdef in records.list_defs(self.store):
                stale = [b for b in tdef.builds if b.status in ("waiting", "building")]
                if stale:
                    builds = tuple(replace(b, status="error", finished=time.time()) if b in stale else b
                                   for b in tdef.builds)
                    records.save_def(self.store, replace(tdef, builds=builds))
                elif not records.has_build_names(self.store, tdef):
                    records.save_def(self.store, tdef)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # build VMs' disks and memory files a stopped (or killed) process left behind
        await asyncio.to_thread(shutil.rmtree, self.rt.run_root / "builds", True)
        async with self._lock:
            await asyncio.to_thread(fix)
        await self.sweep_contexts()

    async def close(self) -> None:
        self._closing = True
        for run in list(self._runs.values()):
            if run.task is not None and not run.task.done():
                run.task.cancel()
        await asyncio.gather(*(r.task for r in self._runs.values() if r.task is not None), return_exceptions=True)

    # ------------------------------------------------------------------ request

    async def request(self, ref: str, tags: list[str] | None, resources: BuildResources,
                      spec: BuildSpec | None = None, notes: tuple[str, ...] = (), owner: str = "") -> BuildRun:
        """A build of ``ref`` (``name`` or ``name:tag``), waiting to be started; ``spec``:
        its steps, when the request already has them (``start_requested`` starts it);
        ``notes``: lines for its log (warnings about the request); ``owner``: who asks
        (records.TemplateDef.owner): a new template is theirs, and another owner's name is
        refused (Conflict: names are one namespace across owners)."""
        if self._closing:
            raise Conflict("the node is shutting down")
        name, tag = records.split_name(ref)
        wanted = [records.check_tag(t) for t in (tags or [])]
        if tag and tag not in wanted:
            wanted.insert(0, tag)
        if not wanted:
            wanted = [DEFAULT_TAG]
        if name == self.settings.base_template or name == "base":
            raise Conflict(f"{name!r} is this node's base template, built by `aenv template build`: "
                           f"choose another name")
        for value, what, lo, hi in ((resources.cpu_count, "cpuCount", 1, self.settings.max_vcpus),
                                    (resources.memory_mb, "memoryMB", 128, self.settings.max_memory_mib)):
            if value is not None and not lo <= value <= hi:
                raise BadRequest(f"{what} must be {lo}..{hi}, got {value}")
        disk = resources.min_free_disk_mb
        if disk is not None and not 0 <= disk <= 1 << 20:
            raise BadRequest(f"minFreeDiskMB must be 0..{1 << 20}, got {disk}")
        run = BuildRun(name, str(uuid.uuid4()), tuple(wanted), resources, requested_spec=spec, owner=owner)
        for note in notes:
            run.log.add("warn", note, "base")
        async with self._lock:
            def put() -> None:
                now = time.time()
                tdef = records.load_def(self.store, name) or TemplateDef(name, now, now, owner=owner)
                if tdef.owner != owner:
                    raise Conflict(f"the template name {name!r} is taken (names are unique across the "
                                   f"deployment's teams): choose another")
                entry = BuildEntry(run.build_id, None, "waiting", now, cpu_count=resources.cpu_count or 0,
                                   memory_mb=resources.memory_mb or 0)
                records.save_def(self.store, replace(tdef, updated=now, builds=tdef.builds + (entry,)))
            await asyncio.to_thread(put)
        self._runs[run.build_id] = run
        return run

    # ------------------------------------------------------------------ files

    def template_exists(self, template_id: str) -> bool:
        name, _ = records.split_name(template_id)
        return records.load_def(self.store, name) is not None

    def files_present(self, files_hash: str) -> bool:
        return records.has_files(self.store, files_hash)

    async def accept_files(self, files_hash: str, path: Path) -> None:
        await asyncio.to_thread(records.put_files, self.store, files_hash, path)

    async def sweep_contexts(self) -> int:
        """Delete the COPY contexts no started build holds whose last use (the end of a
        build that used it; its upload when none did, kept ``UNUSED_CONTEXT_GRACE`` at
        least) is more than ``context_retention`` ago. Their data goes at the next
        ``aenv repo gc``. How many were deleted."""
        now = time.time()

        def sweep() -> int:
            gone = 0
            for files_hash, created in records.list_files(self.store):
                if self._context_holds.get(files_hash):
                    continue
                used = self._context_used.get(files_hash)
                keep = self.context_retention if used is not None else max(self.context_retention,
                                                                            UNUSED_CONTEXT_GRACE)
                if now - (used if used is not None else created) > keep:
                    records.delete_files(self.store, files_hash)
                    self._context_used.pop(files_hash, None)
                    gone += 1
            return gone
        try:
            return await asyncio.to_thread(sweep)
        except (StoreError, OSError) as e:
            log.warning("sweeping build contexts: %s", e)
            return 0

    # ------------------------------------------------------------------ run

    def _run_of(self, template_id: str, build_id: str) -> BuildRun:
        run = self._runs.get(build_id)
        name, _ = records.split_name(template_id)
        if run is None or run.name != name:
            raise NotFound(f"no build {build_id} of template {template_id}")
        return run

    def first_build(self, ref: str) -> "asyncio.Task[None] | None":
        """The running build of ``ref``'s template while it has no ready build yet (a
        create from it waits for it: templates_api.py), else None."""
        try:
            name, _ = records.split_name(ref)
        except BadRequest:
            return None
        running = [r.task for r in self._runs.values() if r.name == name and r.status == "building" and r.task]
        if not running:
            return None
        tdef = records.load_def(self.store, name)
        if tdef is not None and tdef.latest_ready() is not None:
            return None
        return running[-1]

    def waiting_build(self, template_id: str) -> str | None:
        """The newest requested build of ``template_id`` not started yet (the one a COPY
        upload is for: the SDK uploads between its request and its start), or None."""
        name, _ = records.split_name(template_id)
        waiting = [r for r in self._runs.values() if r.name == name and r.status == "waiting"]
        return waiting[-1].build_id if waiting else None

    def startable(self, template_id: str, build_id: str) -> BuildRun:
        """The requested build ``build_id`` of ``template_id``, not started yet (NotFound:
        no such build; Conflict: it was started already)."""
        run = self._run_of(template_id, build_id)
        if run.status != "waiting":
            raise Conflict(f"build {build_id} was already started")
        return run

    async def start_requested(self, template_id: str, build_id: str) -> None:
        """Start a build whose steps came with its request (E2B's legacy flow). BadRequest:
        it came without (it is started with its steps, ``start_build``), or it is not
        waiting (E2B's legacy answer is a 400 there, not a 409)."""
        try:
            run = self._run_of(template_id, build_id)
        except NotFound:        # ended already (its record and log are all that is left of it)
            run = self._load_finished(records.split_name(template_id)[0], build_id)
        if run.status != "waiting":
            raise BadRequest(f"build {build_id} is not in waiting state (it is {run.status})")
        if run.requested_spec is None:
            raise BadRequest(f"build {build_id} was requested without a Dockerfile: start it with "
                             f"POST /v2/templates/{template_id}/builds/{build_id} and its steps")
        await self.start_build(template_id, build_id, run.requested_spec)

    async def start_build(self, template_id: str, build_id: str, spec: BuildSpec) -> None:
        """Start a requested build of ``spec`` (E2B's step list, parsed by aenv_wire.builds)
        in the background. BadRequest when a COPY's files were not uploaded."""
        run = self.startable(template_id, build_id)
        for step in spec.steps:
            if step.kind == StepKind.COPY and step.files_hash and not self.files_present(step.files_hash):
                raise BadRequest(f"step {step.index}: the files of COPY {step.args[0]} were not uploaded "
                                 f"(GET /templates/{template_id}/files/{step.files_hash} first)")
        job = BuildJob(run.name, run.build_id, spec, run.resources)
        run.status = "building"
        for files_hash in self._contexts_of(job):
            self._context_holds[files_hash] = self._context_holds.get(files_hash, 0) + 1
        run.task = asyncio.ensure_future(self._execute(run, job))

    @staticmethod
    def _contexts_of(job: BuildJob) -> set[str]:
        return {s.files_hash for s in job.spec.steps if s.kind == StepKind.COPY and s.files_hash}

    async def _execute(self, run: BuildRun, job: BuildJob) -> None:
        t0 = time.monotonic()
        try:
            async with self._slots:
                await self._set_build(run, "building")
                run.log.info(f"build {run.build_id} of {run.name} ({len(job.spec.steps)} steps, from "
                             f"{job.spec.base})")
                result = await Build(self.rt, self.settings, job, run.log).run()
                await self._finish_ok(run, result.template, result.shape, result.envd_version)
                run.log.info(f"template {run.name} ({', '.join(run.tags)}) = {result.template}: built in "
                             f"{time.monotonic() - t0:.1f} s{' (all cached)' if result.cached else ''}",
                             "finalize")
                run.status = "ready"
        except BuildFailed as e:
            self._fail(run, str(e), e.step)
        except asyncio.CancelledError:
            self._fail(run, run.cancelled or "the build was cancelled (the node shut down)", None)
        except (VmError, StoreError, OSError) as e:
            self._fail(run, f"{type(e).__name__}: {e}", None)
        except Exception as e:    # never lose a build's end: the status says what happened
            log.exception("build %s failed", run.build_id)
            self._fail(run, f"internal error: {type(e).__name__}: {e}", None)
        finally:
            run.finished = time.time()
            if run.status != "ready":
                try:
                    await self._set_build(run, "error")
                except (StoreError, OSError) as e:
                    log.error("recording the failure of build %s: %s", run.build_id, e)
            self._write_log(run)
            # finished: its status and log are read back from the store and the log file
            # (_load_finished), so a long-lived node does not keep every build in memory
            self._runs.pop(run.build_id, None)
            ended = time.time()
            for files_hash in self._contexts_of(job):
                left = self._context_holds.get(files_hash, 1) - 1
                if left > 0:
                    self._context_holds[files_hash] = left
                else:
                    self._context_holds.pop(files_hash, None)
                self._context_used[files_hash] = ended
            if not self._closing:
                await self.sweep_contexts()

    async def cancel_builds(self, owner: str, reason: str) -> tuple[int, int]:
        """Cancel every build of ``owner``'s templates (records.TemplateDef.owner) this node
        runs or holds requested, each ending as failed with ``reason`` (E2B's admin builds
        cancel): (cancelled, failed to cancel)."""
        runs = [r for r in list(self._runs.values()) if r.owner == owner and r.status in ("waiting", "building")]
        for run in runs:
            run.cancelled = reason
            if run.task is not None:
                run.task.cancel()
            else:           # requested, never started: it ends here
                self._fail(run, reason, None)
                run.finished = time.time()
                await self._set_build(run, "error")
                self._write_log(run)
                self._runs.pop(run.build_id, None)
        await asyncio.gather(*(r.task for r in runs if r.task is not None), return_exceptions=True)
        cancelled = sum(1 for r in runs if r.status == "error")
        return cancelled, len(runs) - cancelled

    def _fail(self, run: BuildRun, message: str, step: str | None) -> None:
        run.status = "error"
        run.reason = (message, step)
        run.log.error(f"build failed: {message}", step)

    async def _set_build(self, run: BuildRun, status: str) -> None:
        async with self._lock:
            def put() -> None:
                tdef = records.load_def(self.store, run.name)
                if tdef is None:
                    return
                builds = tuple(replace(b, status=status, finished=time.time() if status == "error" else None)
                               if b.build_id == run.build_id else b for b in tdef.builds)
                records.save_def(self.store, replace(tdef, builds=builds, updated=time.time()))
            await asyncio.to_thread(put)

    async def _finish_ok(self, run: BuildRun, tid: str, shape: Any, envd_version: str | None) -> None:
        async with self._lock:
            def put() -> None:
                now = time.time()
                tdef = records.load_def(self.store, run.name) or TemplateDef(run.name, now, now, owner=run.owner)
                builds = tuple(replace(b, status="ready", template=tid, finished=now, cpu_count=shape.vcpus,
                                       memory_mb=shape.memory_mib, disk_mb=shape.disk_mib,
                                       envd_version=envd_version)
                               if b.build_id == run.build_id else b for b in tdef.builds)
                tags = dict(tdef.tags)
                for tag in run.tags:
                    tags[tag] = (run.build_id, tid, now)
                records.save_def(self.store, replace(tdef, builds=builds, tags=tags, updated=now))
            await asyncio.to_thread(put)

    def _write_log(self, run: BuildRun) -> None:
        try:
            doc = {"template": run.name, "build_id": run.build_id, "status": run.status,
                   "reason": list(run.reason) if run.reason else None,
                   "entries": [[e.timestamp, e.level, e.message, e.step] for e in run.log.entries]}
            tmp = self.log_dir / f".{run.build_id}.tmp"
            tmp.write_text(json.dumps(doc))
            tmp.replace(self.log_dir / f"{run.build_id}.json")
        except OSError as e:
            log.error("writing the log of build %s: %s", run.build_id, e)

    # ------------------------------------------------------------------ status

    def status(self, template_id: str, build_id: str, offset: int = 0, limit: int = 100,
               level: str | None = None) -> StatusView:
        name, _ = records.split_name(template_id)
        run = self._runs.get(build_id)
        if run is None or run.name != name:
            run = self._load_finished(name, build_id)
        order = ["debug", "info", "warn", "error"]
        entries = run.log.since(offset, limit)
        if level in order:
            entries = [e for e in entries if order.index(e.level) >= order.index(level)]
        reason_entries = run.log.tail(20, run.reason[1]) if run.reason else []
        return StatusView(run.name, run.build_id, run.status, entries, run.reason, reason_entries)

    def _load_finished(self, name: str, build_id: str) -> BuildRun:
        tdef = records.load_def(self.store, name)
        entry = tdef.build(build_id) if tdef else None
        if entry is None:
            raise NotFound(f"no build {build_id} of template {name}")
        run = BuildRun(name, build_id, (), BuildResources(), created=entry.created, status=entry.status)
        try:
            doc = json.loads((self.log_dir / f"{build_id}.json").read_text())
            run.log.entries = [LogEntry(float(t), str(lv), str(m), s) for t, lv, m, s in doc.get("entries", [])]
            if doc.get("reason"):
                run.reason = (str(doc["reason"][0]), doc["reason"][1])
        except (OSError, ValueError, TypeError):
            if entry.status == "error":
                run.reason = ("the build failed (its log is gone)", None)
        return run

    # ------------------------------------------------------------------ templates

    def _view(self, tdef: TemplateDef) -> TemplateView:
        latest = max(tdef.builds, key=lambda b: b.created) if tdef.builds else None
        return TemplateView(tdef.name, (tdef.name,), tdef.latest_ready(), tdef.builds, tdef.created, tdef.updated,
                            tdef.public, latest.status if latest else "waiting", tdef.owner)

    def list_templates(self) -> list[TemplateView]:
        return sorted((self._view(t) for t in records.list_defs(self.store)), key=lambda v: v.created)

    def get(self, template_id: str) -> TemplateView:
        name, _ = records.split_name(template_id)
        tdef = records.load_def(self.store, name)
        if tdef is None:
            raise NotFound(f"unknown template {template_id!r}")
        return self._view(tdef)

    async def set_public(self, template_id: str, public: bool) -> TemplateView:
        """Record whether the template is public (E2B's ``TemplateUpdateRequest``; what it
        changes: docs/api.md "Templates")."""
        name, _ = records.split_name(template_id)
        async with self._lock:
            tdef = records.load_def(self.store, name)
            if tdef is None:
                raise NotFound(f"unknown template {template_id!r}")
            if tdef.public != public:
                tdef = replace(tdef, public=public, updated=time.time())
                await asyncio.to_thread(records.save_def, self.store, tdef)
        return self._view(tdef)

    def base_template(self) -> Template | None:
        try:
            return find_template(self.store, self.settings.base_template)
        except (VmError, StoreError):
            return None

    def alias(self, alias: str) -> str:
        """The template id a name resolves to (NotFound: none, or no build of it is ready)."""
        if alias in ("base", self.settings.base_template) and self.base_template() is not None:
            return "base"
        name, _ = records.split_name(alias)
        tdef = records.load_def(self.store, name)
        if tdef is None or tdef.latest_ready() is None:
            raise NotFound(f"no template named {alias!r}")
        return tdef.name

    async def delete(self, template_id: str) -> bool:
        """Delete an E2B template and its builds; False when ``template_id`` is none (the
        caller may then try snapshots). Conflict while a build of it runs or sandboxes use
        one of its builds."""
        name, _ = records.split_name(template_id)
        async with self._lock:
            tdef = records.load_def(self.store, name)
            if tdef is None:
                return False
            # a build that started (running, or queued for a slot) holds the template; one
            # only requested (its start never came, or was refused) goes with it
            if any(r.name == name and (r.status == "building" or (r.task is not None and not r.task.done()))
                   for r in self._runs.values()):
                raise Conflict(f"template {name} has a build running: wait for it to end")
            tids = sorted({b.template for b in tdef.builds if b.template})
            users = sorted(u for t in tids for u in self.users(t))
            if users:
                raise Conflict(f"template {name} is in use by {len(users)} sandbox(es) "
                               f"({', '.join(users[:3])}{', ...' if len(users) > 3 else ''}): kill them first")

            def work() -> None:
                records.delete_def(self.store, tdef)
                for tid in tids:
                    try:
                        remove_template(self.store, tid)
                    except (NotFound, StoreError):
                        pass
            await asyncio.to_thread(work)
            for tid in tids:
                self.rt.templates.forget(tid)
            for bid in [b for b, r in self._runs.items() if r.name == name]:
                self._runs.pop(bid, None)
        return True

    # ------------------------------------------------------------------ tags

    async def assign_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        name, tag = records.split_name(target)
        wanted = [records.check_tag(t) for t in tags]
        if not wanted:
            raise BadRequest("give at least one tag")
        async with self._lock:
            tdef = records.load_def(self.store, name)
            if tdef is None:
                raise NotFound(f"unknown template {name!r}")
            source = tdef.tags.get(tag or DEFAULT_TAG)
            if source is None:
                raise NotFound(f"template {name} has no tag {tag or DEFAULT_TAG!r}")
            now = time.time()
            new = dict(tdef.tags)
            for t in wanted:
                new[t] = (source[0], source[1], now)
            await asyncio.to_thread(records.save_def, self.store, replace(tdef, tags=new, updated=now))
        return source[0], wanted

    async def remove_tags(self, ref: str, tags: list[str]) -> None:
        name, _ = records.split_name(ref)
        async with self._lock:
            tdef = records.load_def(self.store, name)
            if tdef is None:
                raise NotFound(f"unknown template {name!r}")
            missing = [t for t in tags if t not in tdef.tags]
            if missing:
                raise NotFound(f"template {name} has no tag(s) {', '.join(missing)}")
            new = {t: v for t, v in tdef.tags.items() if t not in tags}
            await asyncio.to_thread(records.save_def, self.store, replace(tdef, tags=new, updated=time.time()))

    def tags(self, template_id: str) -> list[tuple[str, str, float]]:
        name, _ = records.split_name(template_id)
        tdef = records.load_def(self.store, name)
        if tdef is None:
            raise NotFound(f"unknown template {template_id!r}")
        return [(t, bid, when) for t, (bid, _tid, when) in sorted(tdef.tags.items())]
