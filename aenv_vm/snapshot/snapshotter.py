"""Pause, resume, named snapshots and fork of a SandboxManager's sandboxes.

What each operation captures and guarantees is in docs/snapshots.md. In short:

* **capture** (the VM stopped): device state via ``xen-save-devices-state``
  (vmstate.py), the guest pages the QEMU holds privately (pagemap.py: exactly
  the pages that differ from the base memory image the sandbox maps
  ``share=off``), and the disk (the upper layer, flushed or sealed).
* **pause**: capture, write ``memory.delta`` + ``device-state`` durably into
  ``<run_root>/paused/<id>/<seq>/``, record the sandbox as paused (LMDB), kill
  QEMU (its memory is released). A background task then seals the disk's
  upper layer and commits delta, device state and a ``paused-<id>`` catalog
  record to the store. Resume waits for that task, so a resumed VM never
  writes into an upper layer that is still being sealed.
* **resume**: a new QEMU maps the same base ``share=off``, the delta pages are
  written into it through /proc/PID/mem, the device state is loaded; the disk
  restarts on a fresh upper layer over the sealed one.
* **snapshot**: capture, seal the disk, let the parent continue, then write a
  full memory image (base + delta) and commit it as a template record, so
  ``create(snapshot_id)`` works like any template.
* **fork**: a hidden snapshot, then ``count`` children restored from it
  concurrently, each with its own identity, token and upper layer.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from aenv_store.errors import NotFound, StoreError
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.formats.ids import Digest

from ..blockimage.image import BlockImage
from ..envd_client import _request as envd_request
from ..guest import wait_http_ok
from ..qemu.launcher import NbdDisk, QemuProcess, VmSpec
from ..qemu.migration import load_device_state
from ..records import RecordStore, SandboxRecord, SandboxState, SnapshotRef
from ..template import DEVICE_STATE, Template, materialize
from .disk_squash import MAX_DISK_CHAIN, squash
from .errors import SnapshotError
from .memory_image import (SPARE, Delta, fetch_delta, page_hashes, parent_seq, read_delta, read_index,
                           stage_delta, sync_file, write_delta, write_incremental)
from .named import MAX_FORK, NamedSnapshots, SnapshotInfo
from .pagemap import private_pages, ram_mapping, read_and_hash, write_pages
from .vmstate import durable_write, save_devices, template_config

__all__ = ["Snapshotter", "SnapshotError", "SnapshotInfo", "PauseTiming", "ResumeTiming", "MAX_FORK"]

if TYPE_CHECKING:
    from ..sandbox import Sandbox, SandboxManager
    from ..ttl import TtlWatcher

log = logging.getLogger(__name__)

PAUSED_KIND = "sandbox-snapshot"
# The page buffer a capture reads into is kept for the next one up to this size
# (the manager holds it resident: reading 26 MiB took 25 ms into a fresh buffer,
# 11 ms into a reused one).
RETAINED_BUFFER = 160 << 20


@dataclass(frozen=True)
class PauseTiming:
    stop: float             # QMP stop
    device_state: float     # xen-save-devices-state + splice
    pages: float            # pagemap + read of the private pages + xxh3
    write: float            # memory.delta written, disk flush (ran concurrently since stop) done, record put
    total: float            # until the pause is durable (QEMU is killed right after)
    dirty_pages: int        # pages the sandbox holds privately (the flattened delta)
    written_pages: int = 0  # of those, written by this pause (new or changed since the previous one)


@dataclass(frozen=True)
class ResumeTiming:
    fetch: float            # local snapshot files present (0 when they were)
    qemu_start: float
    inject: float           # delta pages written into the new QEMU
    state_load: float       # until QMP status "running": (a)
    first_answer: float     # envd /health
    init: float             # envd /init (clock)
    running: float          # (a) total: call → vCPUs running
    total: float            # call → envd initialised




@dataclass
class _Capture:
    delta: Delta
    timing: tuple[float, float, float]


def _hex(d: Digest | None) -> str | None:
    return None if d is None else d.hex()


def _digest(h: str | None) -> Digest | None:
    return None if h is None else Digest(bytes.fromhex(h))


def upper_base(upper_dir: Path) -> Digest | None:
    """The committed layer an upper layer's map says it sits on (docs/block-image.md)."""
    raw = (upper_dir / "upper.map").read_bytes()[32:64]
    return None if raw == bytes(32) else Digest(raw)


class Snapshotter(NamedSnapshots):
    """Lifecycle beyond create/kill for one SandboxManager (see the module doc)."""

    def __init__(self, mgr: "SandboxManager", default_timeout: float = 300.0, standby: int = 4) -> None:
        self.mgr = mgr
        self.default_timeout = default_timeout
        # Paused sandboxes (most recent first) whose next QEMU is already started
        # (-incoming defer, base mapped, disk export kept): resume skips QEMU's start.
        self.standby_limit = standby
        self._held: dict[str, tuple[BlockImage, Path]] = {}      # disk image kept open while paused
        self._standby: dict[str, asyncio.Task] = {}               # sid → task starting its standby QEMU
        self.records = RecordStore(mgr.run_root / "records")
        self.paused_root = mgr.run_root / "paused"
        self._commits: dict[str, asyncio.Task] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._configs: dict[str, bytes] = {}
        self._tokens: dict[str, str | None] = {}
        self._ttl: asyncio.Task | None = None
        self._ttl_watcher: "TtlWatcher | None" = None
        # called after a TTL expiry paused or killed a sandbox: (sandbox id, "paused" | "killed")
        self.expiry_listeners: list[Callable[[str, str], None]] = []
        self._buffers: list[bytearray] = []     # at most one, see _give_back
        self.last_pause: PauseTiming | None = None
        self.last_resume: ResumeTiming | None = None
        self.last_fork_snapshot: float | None = None      # seconds the fork's snapshot took (until restorable)
        self.last_fork_timing: dict[str, float] | None = None
        self._fork_commits: dict[str, asyncio.Task] = {}         # fork snapshot id → its background commit

    # ------------------------------------------------------------ helpers
    def lock(self, sid: str) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    def record(self, sid: str) -> SandboxRecord:
        rec = self.records.get(sid)
        if rec is None:
            from ..sandbox import SandboxError
            raise SandboxError(f"unknown sandbox {sid!r}")
        return rec

    def template_token(self, tpl: Template) -> str | None:
        """The envd access token a snapshot's guest still holds (None for built templates)."""
        if tpl.id not in self._tokens:
            try:
                self._tokens[tpl.id] = self.mgr.store.get_record(tpl.id).meta_dict().get("envd_token")
            except (NotFound, StoreError):
                return None
        return self._tokens[tpl.id]

    async def _template_files(self, tpl: Template) -> tuple[Path, Path]:
        async with self.mgr._local_lock:
            return await asyncio.to_thread(materialize, self.mgr.store, tpl, self.mgr.run_root / "templates")

    async def _config(self, tpl: Template) -> bytes:
        cfg = self._configs.get(tpl.id)
        if cfg is None:
            _, state = await self._template_files(tpl)
            cfg = self._configs[tpl.id] = template_config(state)
        return cfg

    def _running(self, sid: str) -> "Sandbox":
        sbx = self.mgr.sandboxes.get(sid)
        if sbx is None:
            rec = self.records.get(sid)
            state = rec.state.value if rec else "unknown"
            raise SnapshotError(f"sandbox {sid} is not running (state: {state})")
        return sbx

    async def _capture(self, sbx: "Sandbox", state_path: Path, sync: bool = True,
                       flush: list[asyncio.Future] | None = None) -> _Capture:
        """Stop the VM and take its device state and private pages (the VM stays stopped).
        ``flush``: also start the disk flush right after the stop (it overlaps the rest)."""
        await self._template_committed(sbx)
        vm = sbx.vm
        assert vm.qmp is not None and vm.spec.mem_path is not None
        cfg = await self._config(sbx.template)
        t0 = time.monotonic()
        await vm.qmp.execute("stop")   # returns with the vCPUs stopped and block I/O drained
        if flush is not None:
            flush.append(asyncio.ensure_future(asyncio.to_thread(sbx.image.flush)))
        t1 = time.monotonic()
        await save_devices(vm, state_path, cfg, sync)
        t2 = time.monotonic()

        buffer = self._buffers.pop() if self._buffers else None

        def pages() -> Delta:
            mapping = ram_mapping(vm.pid, vm.spec.mem_path)  # type: ignore[arg-type]
            idx = private_pages(vm.pid, mapping)
            data, hashes = read_and_hash(vm.pid, mapping, idx, buffer)
            return Delta(sbx.template.memory, sbx.template.memory_mib << 20, idx, hashes, data)
        try:
            delta = await asyncio.to_thread(pages)
        except BaseException:
            self._give_back(buffer)
            raise
        t3 = time.monotonic()
        return _Capture(delta, (t1 - t0, t2 - t1, t3 - t2))

    def _give_back(self, buffer: bytearray | memoryview | None) -> None:
        """Keep one page buffer for the next capture (up to RETAINED_BUFFER bytes)."""
        if isinstance(buffer, memoryview):
            buffer = buffer.obj  # type: ignore[assignment]
        if isinstance(buffer, bytearray) and len(buffer) <= RETAINED_BUFFER and (
                not self._buffers or len(self._buffers[0]) < len(buffer)):
            self._buffers[:] = [buffer]

    # ------------------------------------------------------------ records hooks
    def on_created(self, sbx: "Sandbox", *, timeout: float | None, metadata: dict[str, str] | None,
                   auto_pause: bool, env_vars: dict[str, str] | None, access_token: str | None,
                   allow_internet_access: bool | None = None) -> None:
        now = time.time()
        t = self.default_timeout if timeout is None else timeout
        self.records.put(SandboxRecord(
            id=sbx.id, template=sbx.template.id, state=SandboxState.RUNNING, started_at=now, end_at=now + t,
            auto_pause=auto_pause, metadata=dict(metadata or {}), env_vars=dict(env_vars or {}),
            access_token=access_token, allow_internet_access=allow_internet_access,
            memory_mib=sbx.template.memory_mib, vcpus=sbx.template.vcpus,
            envd_port=sbx.envd_port, timeout=t))

    async def forget(self, sid: str) -> bool:
        """Delete a sandbox that is not running (paused or lost): local files, store
        record, LMDB record. False if there is no such record."""
        rec = self.records.get(sid)
        if rec is None:
            return False
        task = self._commits.pop(sid, None)
        if task is not None:
            with contextlib.suppress(BaseException):
                await task
        await self._release(sid)
        with contextlib.suppress(NotFound, StoreError):
            await asyncio.to_thread(self.mgr.store.delete_record, f"paused-{sid}")
        shutil.rmtree(self.paused_root / sid, ignore_errors=True)
        shutil.rmtree(self.mgr.run_root / "sandboxes" / sid, ignore_errors=True)
        self.records.delete(sid)
        self._drop_unused_fork(rec.template)
        return True

    def on_killed(self, sid: str) -> None:
        rec = self.records.get(sid)
        with contextlib.suppress(NotFound, StoreError):
            self.mgr.store.delete_record(f"paused-{sid}")
        shutil.rmtree(self.paused_root / sid, ignore_errors=True)
        self.records.delete(sid)
        if rec is not None:
            self._drop_unused_fork(rec.template)

    def set_timeout(self, sid: str, seconds: float) -> SandboxRecord:
        if seconds < 0:
            raise SnapshotError(f"timeout must be >= 0, got {seconds}")
        rec = self.record(sid).replace(end_at=time.time() + seconds, timeout=seconds)
        self.records.put(rec)
        return rec

    # ------------------------------------------------------------ pause
    async def pause(self, sid: str) -> SandboxRecord:
        async with self.lock(sid):
            rec = self.record(sid)
            if rec.state == SandboxState.PAUSED:
                return rec
            sbx = self._running(sid)
            seq = (rec.snapshot.seq + 1) if rec.snapshot else 1
            d = self.paused_root / sid / str(seq)
            d.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            try:
                # The pause is durable against a crash of this process at once (files
                # renamed complete, record in LMDB); fsync for host crashes happens in the
                # background commit, before anything is staged.
                flush: list[asyncio.Future] = []
                try:
                    cap = await self._capture(sbx, d / "device-state", sync=False, flush=flush)
                    t1 = time.monotonic()
                    try:
                        written = await asyncio.to_thread(self._write_pause_delta, d / "memory.delta", cap.delta,
                                                          rec.snapshot)
                    finally:
                        self._give_back(cap.delta.data)
                finally:
                    for f in flush:
                        await f
            except BaseException:
                shutil.rmtree(d, ignore_errors=True)
                with contextlib.suppress(Exception):
                    if sbx.vm.alive() and sbx.vm.qmp is not None:
                        await sbx.vm.qmp.execute("cont")
                raise
            snap = SnapshotRef(seq=seq, local=str(d), base=sbx.template.memory.hex(), disk_top=_hex(sbx.image.top),
                               committed=False, created=time.time())
            previous = rec.snapshot
            rec = rec.replace(state=SandboxState.PAUSED, snapshot=snap, envd_port=None)
            self.records.put(rec)
            t2 = time.monotonic()
            self.last_pause = PauseTiming(*cap.timing, t2 - t1, t2 - t0, len(cap.delta.pages), written)
            self.mgr.sandboxes.pop(sid, None)
            # The record says paused: finish even if the caller is cancelled now, or the
            # QEMU and the disk image would belong to nobody.
            await asyncio.shield(self._after_pause(sid, sbx, snap, previous))
            return rec

    @staticmethod
    def _write_pause_delta(path: Path, delta: Delta, previous: SnapshotRef | None) -> int:
        """memory.delta of a pause: only pages new or changed since the previous pause
        (a version-2 file over its version-1 file) when that one is here, else whole.
        Returns the pages written."""
        if previous is not None and previous.committed and Path(previous.local) == path.parent.parent / str(
                previous.seq) and previous.seq != int(path.parent.name):
            parent = read_index(Path(previous.local) / "memory.delta")
            if parent is not None and parent.base == delta.base:
                return write_incremental(path, delta, parent, previous.seq, spare=path.parent.parent / SPARE)
        write_delta(path, delta, False, spare=path.parent.parent / SPARE)
        return len(delta.pages)

    @staticmethod
    def _retire(pause_dir: Path) -> None:
        """Remove a pause directory nothing references any more, keeping its memory.delta
        as the sandbox's spare: the next pause overwrites it instead of a new file."""
        with contextlib.suppress(OSError):
            os.replace(pause_dir / "memory.delta", pause_dir.parent / SPARE)
        shutil.rmtree(pause_dir, ignore_errors=True)

    async def _after_pause(self, sid: str, sbx: "Sandbox", snap: SnapshotRef, previous: SnapshotRef | None) -> None:
        await sbx.vm.kill()
        if self.standby_limit <= 0:   # tap mode: no QEMU left in the namespace (a standby would keep it)
            await self.mgr.networks.release(sid)
        loop = asyncio.get_running_loop()
        self._held[sid] = (sbx.image, sbx.dir)
        self._commits[sid] = loop.create_task(self._commit(sid, sbx.image, sbx.dir, snap, previous))
        if self.standby_limit > 0:
            self._standby[sid] = loop.create_task(self._start_standby(sbx.vm.spec))
            for old in list(self._standby)[:-self.standby_limit]:
                loop.create_task(self._evict(old))

    async def _start_standby(self, spec: VmSpec) -> QemuProcess:
        """The QEMU a resume will use: started now, waiting for its device state."""
        # user mode: a new host port; tap mode: the same namespace (kept until the standby goes)
        spec = dataclasses.replace(spec, **await self.mgr.networks.attach_again(spec),  # type: ignore[arg-type]
                                   incoming_defer=True)
        return await QemuProcess.start(spec)

    async def _drop_standby(self, sid: str) -> None:
        task = self._standby.pop(sid, None)
        if task is not None:
            with contextlib.suppress(BaseException):
                await (await task).kill()

    async def _evict(self, sid: str) -> None:
        """Beyond the standby limit: stop the standby; free the rest once committed."""
        await self._drop_standby(sid)
        if sid not in self._commits:
            await self._release(sid)

    async def _release(self, sid: str, keep_dir: bool = False) -> None:
        """Give up what a paused sandbox holds on this node: standby QEMU, export, image,
        and (unless ``keep_dir``: a pause whose commit failed keeps its upper layer) run dir."""
        await self._drop_standby(sid)
        if sid not in self.mgr.sandboxes:   # tap mode: no QEMU of it runs in its namespace now
            await self.mgr.networks.release(sid)
        held = self._held.pop(sid, None)
        self.mgr.nbd.remove_export(sid)
        if held is not None:
            image, sdir = held
            await asyncio.to_thread(image.close)
            if not keep_dir:
                shutil.rmtree(sdir, ignore_errors=True)

    async def commit_pending(self, rec: SandboxRecord) -> None:
        """Commit a pause whose background commit did not finish (server restart, store
        error): its upper layer on disk is exactly that pause's disk."""
        assert rec.snapshot is not None
        ref = rec.snapshot
        sdir = self.mgr.run_root / "sandboxes" / rec.id
        upper = sdir / "upper"
        top = upper_base(upper) if (upper / "upper.map").exists() else _digest(ref.disk_top)
        image = await asyncio.to_thread(BlockImage.open, self.mgr.store, top, rec.id, upper_dir=upper)
        self._held[rec.id] = (image, sdir)
        await self._commit(rec.id, image, sdir, ref, None)

    async def _commit(self, sid: str, image: BlockImage, sdir: Path, snap: SnapshotRef,
                      previous: SnapshotRef | None) -> None:
        """Seal the disk and commit the pause to the store (background)."""
        rec = self.records.get(sid)
        meta = {"sandbox": sid, "seq": str(snap.seq), "template": rec.template if rec else ""}

        def work() -> tuple[SnapshotRef, bool]:
            store = self.mgr.store
            up = image.upper
            top = image.commit(meta=meta).layer_id if up is not None and up.touched() else image.top
            d = Path(snap.local)
            for f in (d / "memory.delta", d / "device-state", d):
                sync_file(f)
            delta = read_delta(d / "memory.delta")
            if not (page_hashes(delta.data) == delta.hashes).all():   # torn by a host crash before the fsync
                raise SnapshotError(f"pause {snap.seq} of {sid}: memory.delta pages do not match their xxh3")
            prev = None
            if previous is not None and previous.committed and previous.memory_id:
                with contextlib.suppress(Exception):
                    prev = (read_delta(Path(previous.local) / "memory.delta"),
                            store.load_manifest(Digest(bytes.fromhex(previous.memory_id))))
            with store.workspace(chunk_size=4096) as ws:
                squashed = top is not None and len(image.layers) > MAX_DISK_CHAIN
                if squashed:  # bound the disk chain: one equivalent layer replaces the stack
                    assert top is not None
                    top, restaged = squash(store, ws, top, meta)
                    log.info("pause %s/%d: disk stack of %d layers squashed (%d bytes restaged)", sid, snap.seq,
                             len(image.layers), restaged)
                mid, stats = stage_delta(ws, delta, prev, meta)
                state = (d / "device-state").read_bytes()
                w = ws.blob_writer(DEVICE_STATE, size=len(state), meta=meta)
                w.write(0, state)
                state_id = w.close()
                roles = ((("disk", top),) if top is not None else ()) + (
                    ("memory", mid), ("base", delta.base), ("state", state_id))
                ws.commit(CatalogRecord(name=f"paused-{sid}", kind=PAUSED_KIND, manifests=roles,
                                        meta=tuple(sorted(meta.items())), created=time.time()), exclusive=False)
            parent = parent_seq(d / "memory.delta")
            if parent is not None:   # self-contained again (durably) before its parent is removed
                write_delta(d / "memory.delta", delta)
                self._retire(d.parent / str(parent))
            log.info("pause %s/%d committed: %d pages, %d staged", sid, snap.seq, stats.pages, stats.staged)
            return SnapshotRef(seq=snap.seq, local=snap.local, base=snap.base, disk_top=_hex(top), committed=True,
                               memory_id=mid.hex(), state_id=state_id.hex(), created=snap.created), squashed
        try:
            done, squashed = await asyncio.to_thread(work)
        except BaseException:
            await self._release(sid, keep_dir=True)
            raise
        finally:
            self._commits.pop(sid, None)
        if sid not in self._standby or squashed:   # a squash: resume reopens on the new layer
            await self._release(sid)
        rec = self.records.get(sid)
        if rec is not None and rec.snapshot is not None and rec.snapshot.seq == snap.seq:
            self.records.put(rec.replace(snapshot=done))
            if previous is not None and previous.local != done.local:
                self._retire(Path(previous.local))

    # ------------------------------------------------------------ resume
    async def resume(self, sid: str, timeout: float | None = None) -> "Sandbox":
        from ..sandbox import Sandbox
        async with self.lock(sid):
            t0 = time.monotonic()
            rec = self.record(sid)
            if rec.state == SandboxState.RUNNING and sid in self.mgr.sandboxes:
                return self.mgr.sandboxes[sid]
            if rec.state != SandboxState.PAUSED or rec.snapshot is None:
                raise SnapshotError(f"sandbox {sid} cannot be resumed (state {rec.state.value}"
                                    f"{': ' + rec.note if rec.note else ''})")
            task = self._commits.get(sid)
            if task is not None:
                await asyncio.shield(task)
            rec = self.record(sid)
            if rec.snapshot is not None and not rec.snapshot.committed:
                await self.commit_pending(rec)   # an earlier commit failed: never resume over an unsealed disk
                rec = self.record(sid)
            snap = rec.snapshot
            assert snap is not None and snap.committed
            tpl = self.mgr._template(rec.template)
            mem, _ = await self._template_files(tpl)
            d = Path(snap.local)
            tf = time.monotonic()
            if not ((d / "memory.delta").is_file() and (d / "device-state").is_file()):
                await asyncio.to_thread(self._fetch, snap, d)
            fetch = time.monotonic() - tf
            delta = await asyncio.to_thread(read_delta, d / "memory.delta")
            if delta.base != tpl.memory:
                raise SnapshotError(f"sandbox {sid}: memory delta is over {delta.base.short()}, "
                                    f"template {tpl.id} has {tpl.memory.short()}")
            sdir = self.mgr.run_root / "sandboxes" / sid
            image: BlockImage | None = None
            vm: QemuProcess | None = None
            standby = self._standby.pop(sid, None)
            if standby is not None and sid in self._held:
                with contextlib.suppress(Exception):
                    vm = await standby
                if vm is not None and (not vm.alive() or vm.spec.mem_path != mem or (
                        vm.spec.netns is not None and self.mgr.networks.get(sid) is None)):
                    await vm.kill()
                    vm = None
            if vm is not None:
                image = self._held.pop(sid)[0]      # sealed by the commit: a fresh upper over the pause's layer
            else:
                await self._release(sid)
                shutil.rmtree(sdir, ignore_errors=True)
                sdir.mkdir(parents=True)
            try:
                t1 = time.monotonic()
                if vm is None:
                    image = await asyncio.to_thread(BlockImage.open, self.mgr.store, _digest(snap.disk_top), sid,
                                                    upper_dir=sdir / "upper", fresh_upper=True)
                    self.mgr.nbd.add_export(image)
                    netfields = await self.mgr.networks.attach(sid, rec.allow_internet_access is not False)
                    spec = VmSpec(name=sid, kernel=self.mgr.guest.kernel, initrd=self.mgr.guest.initrd,
                                  kernel_cmdline=tpl.kernel_cmdline, run_dir=sdir, memory_mib=tpl.memory_mib,
                                  vcpus=tpl.vcpus, accel=tpl.accel,  # type: ignore[arg-type]
                                  mem_path=mem, mem_share=False, disk=NbdDisk(self.mgr.nbd.socket_path, sid),
                                  incoming_defer=True, tcg_tb_mib=self.mgr.tcg_tb_mib,
                                  **netfields, **self.mgr.process_flags())  # type: ignore[arg-type]
                    t1 = time.monotonic()
                    vm = await QemuProcess.start(spec)
                spec = vm.spec
                t2 = time.monotonic()
                await asyncio.to_thread(lambda: write_pages(vm.pid, ram_mapping(vm.pid, mem),  # type: ignore[union-attr]
                                                            delta.pages, delta.data))
                t3 = time.monotonic()
                await load_device_state(vm, await self.mgr.networks.device_state(d / "device-state"))
                t4 = time.monotonic()
                sbx = Sandbox(sid, tpl, vm, image, sdir, net=self.mgr.networks.get(sid))  # type: ignore[arg-type]
                port = sbx.envd_port
                await wait_http_ok(port, "/health", timeout=self.mgr.ready_timeout, alive=vm.alive,
                                   host=sbx.envd_host)
                t5 = time.monotonic()
                await asyncio.to_thread(self._init, port, rec.access_token, None, sbx.envd_host)
                t6 = time.monotonic()
            except BaseException:
                await self.mgr._teardown(sid, vm, image, sdir)
                raise
            sbx.created = rec.started_at
            self.mgr.sandboxes[sid] = sbx
            t = rec.timeout if timeout is None else timeout
            self.records.put(rec.replace(state=SandboxState.RUNNING, envd_port=port, end_at=time.time() + t,
                                         timeout=t, note=""))
            self.last_resume = ResumeTiming(fetch, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t4 - t0, t6 - t0)
            return sbx

    def _fetch(self, snap: SnapshotRef, d: Path) -> None:
        """Bring a committed pause back from the store into its local directory."""
        if not snap.committed or not snap.memory_id or not snap.state_id:
            raise SnapshotError(f"pause {snap.seq} is neither local ({d}) nor committed to the store")
        d.mkdir(parents=True, exist_ok=True)
        delta, _ = fetch_delta(self.mgr.store, Digest(bytes.fromhex(snap.memory_id)))
        write_delta(d / "memory.delta", delta)
        reader = self.mgr.store.open_blob(Digest(bytes.fromhex(snap.state_id)))
        durable_write(d / "device-state", reader.read(0, reader.size))

    @staticmethod
    def _init(port: int, old_token: str | None, new_token: str | None, host: str = "127.0.0.1") -> None:
        """envd /init after a restore: step the clock; optionally replace the access token."""
        body: dict[str, object] = {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        headers = {"Content-Type": "application/json"}
        if old_token:
            headers["X-Access-Token"] = old_token
        if new_token is not None:
            body["accessToken"] = new_token
        status, data = envd_request(port, "POST", "/init", json.dumps(body).encode(), headers, 10.0, host)
        if not 200 <= status < 300:
            raise SnapshotError(f"envd /init after restore answered HTTP {status}: {data[:200]!r}")

    # ------------------------------------------------------------ start / stop
    async def start(self) -> list[SandboxRecord]:
        """Recover after a restart: running sandboxes found dead become paused from their
        last pause (or lost); pauses not yet committed are committed. Returns changes."""
        from .recovery import recover
        changed = await recover(self)
        from ..ttl import TtlWatcher
        self._ttl_watcher = TtlWatcher(self)
        self._ttl = asyncio.get_running_loop().create_task(self._ttl_watcher.run())
        return changed

    async def close(self) -> None:
        if self._ttl is not None and self._ttl_watcher is not None:
            self._ttl_watcher.stop()          # lets a pause or kill in progress finish
            with contextlib.suppress(Exception):
                await self._ttl
            self._ttl = None
        for task in list(self._commits.values()) + list(self._fork_commits.values()):
            with contextlib.suppress(Exception):
                await task
        for sid in list(self._held) + list(self._standby):
            await self._release(sid)

    def close_records(self) -> None:
        self.records.close()
