"""Pause: a running sandbox becomes files, then an artifact in the store.

What a pause captures and guarantees is in docs/snapshots.md. In short:

* **pause** (``PausedSandboxes.pause``): capture (capture.py), write
  ``memory.delta`` + ``device-state`` into ``<run_root>/paused/<id>/<seq>/``
  (renamed complete), fsync them and every directory entry they and the disk's
  upper layer depend on (durable against a host crash), then record the sandbox
  as paused (LMDB, synchronous): never a record naming files a crash could lose.
* **finish** (shielded from cancellation: the record already says paused):
  kill QEMU (its memory is released), keep the disk image open, and start a
  background commit that seals the disk's upper layer and commits delta,
  device state and a ``paused-<id>`` catalog record to the store. A resume waits for
  that commit, so a resumed VM never writes into an upper layer that is still
  being sealed. Up to ``standby_limit`` recently paused sandboxes also get
  their next QEMU started in advance (aenv_vm/machine ``start_standby``; a resume
  brings it up as a ``Standby``).

``PausedSandboxes`` owns what this node holds for paused sandboxes: the open
disk images, the standby QEMUs and the commit tasks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from aenv_store.formats.catalog import CatalogRecord
from aenv_store.errors import Conflict as StoreConflict, StoreError
from aenv_store.formats.ids import Digest

from ..blockimage.image import BlockImage
from ..blockimage.squash import MAX_DISK_CHAIN, squash
from ..blockimage.upper import upper_base
from ..errors import Moved, SnapshotError
from ..machine.bringup import Standby, start_standby
from ..machine.host import release_host
from ..memory.memory_image import (SPARE, Delta, hashes_match, parent_seq, read_delta, read_index, stage_delta,
                                   sync_file, write_delta, write_incremental)
from ..qemu.launcher import QemuProcess
from ..templates.template import DEVICE_STATE
from .capture import Capturer
from .handover import PAUSED_KIND, commit_version, delete_if_held, paused_name, pause_meta
from .records import RecordStore, SandboxRecord, SandboxState, SnapshotRef
from .runtime import NodeRuntime
from .sandbox import Sandbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PauseTiming:
    stop: float             # QMP stop
    device_state: float     # xen-save-devices-state + splice
    pages: float            # pagemap + read of the private pages + xxh3
    write: float            # memory.delta written, disk flush (ran concurrently since stop) done, fsyncs, record put
    total: float            # until the pause is durable (QEMU is killed right after)
    dirty_pages: int        # pages the sandbox holds privately (the flattened delta)
    written_pages: int = 0  # of those, written by this pause (new or changed since the previous one)


@dataclass(frozen=True)
class Paused:
    """A pause made durable: what ``finish`` needs."""
    record: SandboxRecord
    snap: SnapshotRef
    previous: SnapshotRef | None
    timing: PauseTiming


def hex_of(d: Digest | None) -> str | None:
    return None if d is None else d.hex()


def digest_of(h: str | None) -> Digest | None:
    return None if h is None else Digest(bytes.fromhex(h))


class PausedSandboxes:
    """This node's paused sandboxes: open disk images, standby QEMUs, background commits."""

    def __init__(self, rt: NodeRuntime, records: RecordStore, capturer: Capturer, running: Mapping[str, Sandbox],
                 standby_limit: int = 4, lock: Callable[[str], asyncio.Lock] | None = None) -> None:
        """``lock``: the manager's lock of a sandbox (operations on one sandbox never
        interleave); an eviction beyond the standby limit takes it too."""
        self.rt = rt
        self.records = records
        self.capturer = capturer
        self.running = running                  # the manager's table (read only here)
        self._locks: dict[str, asyncio.Lock] = {}
        self.lock = lock if lock is not None else (lambda sid: self._locks.setdefault(sid, asyncio.Lock()))
        # Paused sandboxes (most recent first) whose next QEMU is already started
        # (-incoming defer, base mapped, disk export kept): resume skips QEMU's start.
        self.standby_limit = standby_limit
        self._held: dict[str, tuple[BlockImage, Path]] = {}      # disk image kept open while paused
        self._standby: dict[str, asyncio.Task[QemuProcess]] = {}  # sid → task starting its standby QEMU
        self._commits: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------ pause
    async def pause(self, sbx: Sandbox, rec: SandboxRecord) -> Paused:
        """Capture ``sbx`` and make the pause durable; the VM is left stopped (``finish`` kills it)."""
        sid = sbx.id
        seq = (rec.snapshot.seq + 1) if rec.snapshot else 1
        d = self.rt.paused_dir(sid) / str(seq)
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            # written without fsync, then made durable together before the record says paused
            flush: list[asyncio.Future] = []
            try:
                cap = await self.capturer.capture(sbx, d / "device-state", sync=False, flush=flush)
                t1 = time.monotonic()
                try:
                    written = await asyncio.to_thread(write_pause_delta, d / "memory.delta", cap.delta, rec.snapshot)
                finally:
                    self.capturer.give_back(cap.delta.data)
            finally:
                for f in flush:
                    await f
            # A host crash keeps only what was fsynced: the record (LMDB, synchronous)
            # must never name a pause whose files could be lost, else the sandbox
            # resumes neither from it nor, its record moved on, from the intact one before.
            await asyncio.to_thread(make_pause_durable, d, self.rt.sandbox_dir(sid) / "upper")
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            with contextlib.suppress(Exception):
                if sbx.vm.alive() and sbx.vm.qmp is not None:
                    await sbx.vm.qmp.execute("cont")
            raise
        snap = SnapshotRef(seq=seq, local=str(d), base=sbx.template.memory.hex(), disk_top=hex_of(sbx.image.top),
                           committed=False, created=time.time())
        previous = rec.snapshot
        rec = rec.replace(state=SandboxState.PAUSED, snapshot=snap, envd_port=None)
        self.records.put(rec)
        t2 = time.monotonic()
        timing = PauseTiming(cap.stop, cap.device_state, cap.pages, t2 - t1, t2 - t0, len(cap.delta.pages), written)
        return Paused(rec, snap, previous, timing)

    async def finish(self, sbx: Sandbox, paused: Paused) -> None:
        """Kill the paused VM, hold its disk, start the commit and maybe a standby QEMU."""
        sid = sbx.id
        await sbx.vm.kill()
        await self.rt.networks.abort_connections(sid)
        if self.standby_limit <= 0:   # no QEMU left: namespace and uid go (a standby would keep them)
            await release_host(self.rt, sid)
        loop = asyncio.get_running_loop()
        self._held[sid] = (sbx.image, sbx.dir)
        self._commits[sid] = loop.create_task(self._commit(sid, sbx.image, paused.snap, paused.previous))
        if self.standby_limit > 0:
            self._standby[sid] = loop.create_task(start_standby(self.rt, sbx.vm.spec))
            for old in list(self._standby)[:-self.standby_limit]:
                loop.create_task(self._evict(old))

    async def _drop_standby(self, sid: str) -> None:
        task = self._standby.pop(sid, None)
        if task is not None:
            with contextlib.suppress(BaseException):
                await (await task).kill()

    async def _evict(self, sid: str) -> None:
        """Beyond the standby limit: stop the standby; free the rest once committed. Under
        the sandbox's lock: a resume of it in the meantime took over its export, network
        and uid, which a release beside it would tear away from the running sandbox."""
        async with self.lock(sid):
            if sid in self.running:     # resumed: nothing of the pause is left to evict
                return
            await self._drop_standby(sid)
            if sid not in self._commits:
                await self.release(sid)

    async def take_standby(self, sid: str, memory: Path) -> Standby | None:
        """The standby of ``sid`` for a resume (its QEMU and its disk image), if it has one
        that still fits: alive, mapping ``memory``, its namespace still there (tap)."""
        task = self._standby.pop(sid, None)
        if task is None or sid not in self._held:
            if task is not None:
                with contextlib.suppress(BaseException):
                    await (await task).kill()
            return None
        vm: QemuProcess | None = None
        with contextlib.suppress(Exception):
            vm = await task
        if vm is None:
            return None
        if not vm.alive() or vm.spec.mem_path != memory or (
                vm.spec.netns is not None and self.rt.networks.get(sid) is None):
            await vm.kill()
            return None
        image, _ = self._held.pop(sid)   # sealed by the commit: a fresh upper over the pause's layer
        return Standby(vm, image)

    async def release(self, sid: str, keep_dir: bool = False) -> None:
        """Give up what a paused sandbox holds on this node: standby QEMU, export, image,
        and (unless ``keep_dir``: a pause whose commit failed keeps its upper layer) run dir."""
        await self._drop_standby(sid)
        if sid not in self.running:   # no QEMU of it runs now: its namespace (tap) and uid go
            await release_host(self.rt, sid)
        held = self._held.pop(sid, None)
        self.rt.nbd.remove_export(sid)
        if held is not None:
            image, sdir = held
            await asyncio.to_thread(image.close)
            if not keep_dir:
                shutil.rmtree(sdir, ignore_errors=True)

    # ------------------------------------------------------------ commit
    def committing(self, sid: str) -> asyncio.Task[None] | None:
        """The background commit of ``sid``'s last pause while it runs."""
        return self._commits.get(sid)

    async def committed(self, sid: str) -> None:
        """Wait for the background commit of ``sid``'s last pause (if one runs); its
        failure is raised. Cancelling the wait does not cancel the commit."""
        task = self._commits.get(sid)
        if task is not None:
            await asyncio.shield(task)

    async def settle(self, sid: str) -> None:
        """Before a release: the last pause of ``sid`` committed (its background commit
        waited for, a pending one committed; one that finds the sandbox moved is dropped:
        nothing of this copy is to be kept), then everything it holds here given up."""
        with contextlib.suppress(Moved):
            await self.committed(sid)
            rec = self.records.get(sid)
            if rec is not None and rec.snapshot is not None and not rec.snapshot.committed:
                await self.commit_pending(rec)
        await self.release(sid)

    async def commit_pending(self, rec: SandboxRecord) -> None:
        """Commit a pause whose background commit did not finish (server restart, store
        error): its upper layer on disk is exactly that pause's disk."""
        assert rec.snapshot is not None
        ref = rec.snapshot
        sdir = self.rt.sandbox_dir(rec.id)
        upper = sdir / "upper"
        try:
            top = upper_base(upper)
        except FileNotFoundError:
            top = digest_of(ref.disk_top)
        image = await asyncio.to_thread(BlockImage.open, self.rt.store, top, rec.id, upper_dir=upper)
        self._held[rec.id] = (image, sdir)
        await self._commit(rec.id, image, ref, None)

    async def _commit(self, sid: str, image: BlockImage, snap: SnapshotRef, previous: SnapshotRef | None) -> None:
        """Seal the disk and commit the pause to the store (background)."""
        rec = self.records.get(sid)
        meta = {"sandbox": sid, "seq": str(snap.seq), "template": rec.template if rec else ""}
        # the catalog record also carries the sandbox's record, for a node adopting it (handover.py)
        record_meta = pause_meta(rec, snap.seq, self.rt.node_id) if rec is not None else meta
        try:
            done, squashed = await asyncio.to_thread(self._commit_work, sid, image, snap, previous, meta,
                                                     record_meta)
        except BaseException as e:
            await self.release(sid, keep_dir=True)
            if isinstance(e, Moved) and (now := self.records.get(sid)) is not None:
                self.records.put(now.replace(note=str(e)[:300]))
            raise
        finally:
            self._commits.pop(sid, None)
        # The record says committed before the release removes the sandbox's directory:
        # a crash in between left a pending pause without its sealed upper layer, and
        # commit_pending then took the disk as it was before the pause (ref.disk_top).
        rec = self.records.get(sid)
        if rec is not None and rec.snapshot is not None and rec.snapshot.seq == snap.seq:
            self.records.put(rec.replace(snapshot=done))
            if previous is not None and previous.local != done.local:
                retire(Path(previous.local))
        if sid not in self._standby or squashed:   # a squash: resume reopens on the new layer
            await self.release(sid)

    def _commit_work(self, sid: str, image: BlockImage, snap: SnapshotRef, previous: SnapshotRef | None,
                     meta: dict[str, str], record_meta: dict[str, str]) -> tuple[SnapshotRef, bool]:
        store = self.rt.store
        up = image.upper
        top = image.commit(meta=meta).layer_id if up is not None and up.touched() else image.top
        d = Path(snap.local)
        for f in (d / "memory.delta", d / "device-state", d):
            sync_file(f)
        delta = read_delta(d / "memory.delta")
        if not hashes_match(delta):   # torn by a host crash before the fsync
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
            # never over a newer pause or one another node took over: this copy is stale then
            # (Moved); the record is swapped over the version checked, so a takeover in between
            # refuses it too
            version = commit_version(self.rt, sid, snap.seq)
            try:
                ws.commit(CatalogRecord(name=paused_name(sid), kind=PAUSED_KIND, manifests=roles,
                                        meta=tuple(sorted(record_meta.items())), created=time.time()),
                          replaces=version)
            except StoreConflict:
                raise Moved(f"sandbox {sid} moved: its pause record changed during the commit of pause "
                            f"{snap.seq} (another node took it over); not committed (release it here)") from None
        parent = parent_seq(d / "memory.delta")
        if parent is not None:   # self-contained again (durably) before its parent is removed
            write_delta(d / "memory.delta", delta)
            retire(d.parent / str(parent))
        log.info("pause %s/%d committed: %d pages, %d staged", sid, snap.seq, stats.pages, stats.staged)
        return SnapshotRef(seq=snap.seq, local=snap.local, base=snap.base, disk_top=hex_of(top), committed=True,
                           memory_id=mid.hex(), state_id=state_id.hex(), created=snap.created), squashed

    # ------------------------------------------------------------ forget / close
    async def forget(self, sid: str) -> None:
        """A paused (or lost) sandbox is deleted: let its commit end, free what it holds,
        remove its store record and local files."""
        task = self._commits.pop(sid, None)
        if task is not None:
            with contextlib.suppress(BaseException):
                await task
        await self.release(sid)
        self.drop_files(sid)

    def drop_files(self, sid: str) -> None:
        """The store record and local pause files of ``sid`` (a killed or deleted sandbox)."""
        with contextlib.suppress(StoreError):
            delete_if_held(self.rt, sid)     # a stale copy's kill leaves the holder's pause alone
        shutil.rmtree(self.rt.paused_dir(sid), ignore_errors=True)
        shutil.rmtree(self.rt.sandbox_dir(sid), ignore_errors=True)

    async def close(self) -> None:
        for task in list(self._commits.values()):
            with contextlib.suppress(Exception):
                await task
        for sid in list(self._held) + list(self._standby):
            await self.release(sid)


def write_pause_delta(path: Path, delta: Delta, previous: SnapshotRef | None) -> int:
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


def make_pause_durable(pause_dir: Path, upper: Path) -> None:
    """fsync what a paused record depends on, files and every directory entry
    leading to them: ``memory.delta`` and ``device-state`` (written without fsync),
    their directory up to the run root (``paused/<sid>/<seq>`` may be new, so may
    ``paused/<sid>``), and the directories holding the disk's upper layer (its data
    and block map are fsynced by the flush; the entries of ``upper/`` and
    ``sandboxes/<sid>/`` were made when the sandbox started, without fsync)."""
    for f in (pause_dir / "memory.delta", pause_dir / "device-state"):
        sync_file(f)
    for d in (pause_dir, pause_dir.parent, pause_dir.parent.parent, pause_dir.parent.parent.parent):
        sync_file(d)
    if upper.is_dir():
        for d in (upper, upper.parent, upper.parent.parent):
            sync_file(d)


def retire(pause_dir: Path) -> None:
    """Remove a pause directory nothing references any more, keeping its memory.delta
    as the sandbox's spare: the next pause overwrites it instead of a new file."""
    with contextlib.suppress(OSError):
        os.replace(pause_dir / "memory.delta", pause_dir.parent / SPARE)
    shutil.rmtree(pause_dir, ignore_errors=True)
