"""What a restarted node does with the sandbox records it finds.

QEMU processes die with the server (PR_SET_PDEATHSIG), so after a restart no
sandbox is running. For each record:

* ``running`` with a committed pause → ``paused`` from that pause. Its disk
  upper layer holds writes made after the pause, which do not match the
  paused memory: it is discarded (the pause's sealed layer is the disk).
* ``running`` without a pause → ``lost`` (kept and reported, never dropped).
* ``paused`` with a pause not yet committed (the server died in the
  background commit) → committed now: its upper layer is exactly the disk of
  that pause (resume waits for the commit, so no VM wrote to it since).
* Directories under ``sandboxes/`` and ``paused/`` that no record names are
  removed, and so are this node's tap-mode network namespaces, and
  ``templates/<id>/`` whose template the store does not have (a snapshot or a
  fork's hidden snapshot that was not committed when the server died).
"""
from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

from aenv_store.errors import StoreNotFound
from aenv_store.errors import StoreError

from ..memory.memory_image import SPARE
from ..net import netns
from .pause import PausedSandboxes
from .records import RecordStore, SandboxRecord, SandboxState
from .runtime import NodeRuntime

log = logging.getLogger(__name__)


async def recover(rt: NodeRuntime, records: RecordStore, paused: PausedSandboxes) -> list[SandboxRecord]:
    """Bring the records of a node that just started in line with what survived (no
    sandbox runs yet); returns the records it changed."""
    changed: list[SandboxRecord] = []
    all_records = records.all()
    known = {r.id for r in all_records}
    for rec in all_records:
        if rec.state == SandboxState.RUNNING:
            if rec.snapshot is not None and rec.snapshot.committed:
                new = rec.replace(state=SandboxState.PAUSED, envd_port=None,
                                  note=f"found dead at start; paused from pause {rec.snapshot.seq}")
            else:
                new = rec.replace(state=SandboxState.LOST, envd_port=None,
                                  note="found dead at start with no committed pause to resume from")
            shutil.rmtree(rt.sandbox_dir(rec.id), ignore_errors=True)
            records.put(new)
            changed.append(new)
            log.warning("sandbox %s: %s", rec.id, new.note)
        elif rec.state == SandboxState.PAUSED and rec.snapshot is not None and not rec.snapshot.committed:
            ref = rec.snapshot
            try:
                await paused.commit_pending(rec)
                changed.append(records.get(rec.id) or rec)
            except Exception as e:  # noqa: BLE001 - keep the record, say why
                new = rec.replace(note=f"pause {ref.seq} could not be committed at start: {e}")
                records.put(new)
                changed.append(new)
                log.error("sandbox %s: %s", rec.id, new.note)
    # Tap-mode namespaces of this node: no sandbox runs yet, so every one is an orphan.
    for name in netns.list_namespaces(netns.node_tag(rt.run_root)):
        try:
            await asyncio.to_thread(netns.destroy, name)  # pyroute2 runs its own event loop
            log.warning("removed orphaned network namespace %s", name)
        except netns.NetError as e:
            log.error("%s", e)
    shutil.rmtree(rt.vm_root, ignore_errors=True)   # QEMUs' run dirs: none survived
    for root in (rt.sandboxes_root, rt.paused_root):
        if root.is_dir():
            for d in root.iterdir():
                if d.is_dir() and d.name not in known:
                    shutil.rmtree(d, ignore_errors=True)
    templates = rt.templates.root
    for d in sorted(templates.iterdir()) if templates.is_dir() else []:
        try:
            await asyncio.to_thread(rt.store.get_record, d.name)
        except StoreNotFound:
            shutil.rmtree(d, ignore_errors=True)
            log.warning("removed local files of template %s: not in the store", d.name)
        except StoreError as e:  # the store cannot tell now: keep them
            log.warning("template %s: %s", d.name, e)
    for rec in records.all():
        keep = ({Path(rec.snapshot.local).name} if rec.snapshot else set()) | {SPARE}
        pdir = rt.paused_dir(rec.id)
        if pdir.is_dir() and rec.snapshot is not None and rec.snapshot.committed:
            for d in pdir.iterdir():
                if d.name not in keep:
                    shutil.rmtree(d, ignore_errors=True)
    return changed
