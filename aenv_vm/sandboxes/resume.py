"""Resume: a paused sandbox runs again, from where its last pause stopped it.

A new QEMU (or the standby its pause started) maps the template's memory file
``share=off``; the pause's delta pages are written into it through
/proc/PID/mem and the device state is loaded (restore.py, a machine restore:
aenv_vm/machine); the disk restarts
on a fresh upper layer over the layer the pause sealed. The pause's files are
fetched from the store first when this node does not have them (another node
paused it, or they were lost). A resume always waits for the pause's commit,
so it never writes into an upper layer that is still being sealed.
"""
from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from aenv_store.formats.ids import Digest
from aenv_store.store import Store

from ..errors import Conflict, SnapshotError
from ..memory.device_state import durable_write
from ..memory.memory_image import fetch_delta, read_delta, write_delta
from .handover import claim_held
from .pause import PausedSandboxes, digest_of
from .records import SandboxRecord, SandboxState, SnapshotRef
from .restore import RestorePlan, greeting, restore
from .runtime import NodeRuntime
from .sandbox import Sandbox


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


async def resume(rt: NodeRuntime, paused: PausedSandboxes, rec: SandboxRecord) -> tuple[Sandbox, ResumeTiming]:
    """Run paused sandbox ``rec`` again (the caller holds its lock and records the result)."""
    t0 = time.monotonic()
    sid = rec.id
    if rec.state != SandboxState.PAUSED or rec.snapshot is None:
        raise Conflict(f"sandbox {sid} cannot be resumed (state {rec.state.value}"
                       f"{': ' + rec.note if rec.note else ''})")
    await paused.committed(sid)
    rec = paused.records.get(sid) or rec
    if rec.snapshot is not None and not rec.snapshot.committed:
        await paused.commit_pending(rec)   # an earlier commit failed: never resume over an unsealed disk
        rec = paused.records.get(sid) or rec
    snap = rec.snapshot
    assert snap is not None and snap.committed
    # Moved: another node holds it now; else the repository says it runs here from now on,
    # before the guest runs (a takeover racing this write is refused, or refuses it)
    await asyncio.to_thread(claim_held, rt, rec)
    tpl = rt.templates.resolve(rec.template)
    mem, _ = await rt.templates.files(tpl)
    d = Path(snap.local)
    tf = time.monotonic()
    if not ((d / "memory.delta").is_file() and (d / "device-state").is_file()):
        await asyncio.to_thread(fetch_pause, rt.store, snap, d)
    fetch = time.monotonic() - tf
    delta = await asyncio.to_thread(read_delta, d / "memory.delta")
    if delta.base != tpl.memory:
        raise SnapshotError(f"sandbox {sid}: memory delta is over {delta.base.short()}, "
                            f"template {tpl.id} has {tpl.memory.short()}")
    standby = await paused.take_standby(sid, mem)
    if standby is None:
        await paused.release(sid)
        shutil.rmtree(rt.sandbox_dir(sid), ignore_errors=True)
    plan = RestorePlan(sid, tpl, mem, d / "device-state", digest_of(snap.disk_top),
                       greeting(rt, {}, rec.access_token), fresh_upper=True, delta=delta,
                       policy=rec.policy)
    sbx, t = await restore(rt, plan, standby)
    sbx.created = rec.started_at
    done = time.monotonic()
    return sbx, ResumeTiming(fetch, t.qemu_start, t.inject, t.state_load, t.first_answer, t.init,
                             t.running_at - t0, done - t0)


def fetch_pause(store: Store, snap: SnapshotRef, d: Path) -> None:
    """Bring a committed pause back from the store into its local directory."""
    if not snap.committed or not snap.memory_id or not snap.state_id:
        raise SnapshotError(f"pause {snap.seq} is neither local ({d}) nor committed to the store")
    d.mkdir(parents=True, exist_ok=True)
    delta, _ = fetch_delta(store, Digest(bytes.fromhex(snap.memory_id)))
    write_delta(d / "memory.delta", delta)
    reader = store.open_blob(Digest(bytes.fromhex(snap.state_id)))
    durable_write(d / "device-state", reader.read(0, reader.size))
