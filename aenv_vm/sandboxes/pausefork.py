"""A batch from a paused sandbox: its last pause named as a hidden snapshot.

``POST /snapshots/{id}/fork`` with the id of a paused sandbox (docs/api.md) starts
sandboxes from that sandbox's last committed pause: its files and its processes. The
pause is in the store already (pause.py commits a ``paused-<id>`` record naming its disk
layer, its memory delta over the template's image, its device state), so nothing is
copied: a **hidden template record** (``hidden: pause``, templates/meta.py) names the
same manifests, its ``memory`` role the delta and ``base`` the full image it is over
(templates/template.py, written by templates/freeze.py ``freeze_pause``). A create from
it restores like one from any template, the delta's pages written over the mapped image
before the device state loads, as a resume does (restore.py); the paused sandbox and its
``paused-<id>`` record are not touched, so it resumes afterwards as before.

Lifetime: the record is made per batch, held while the batch is made
(``SandboxManager.pause_snapshot``, fork.py ``Forks.hold``) and then kept by the
sandboxes made from it, running or paused (their records name it as their template),
whatever happens to the paused sandbox: killing it deletes ``paused-<id>``, and the
hidden record is then what keeps the pause's manifests reachable for ``aenv repo gc``.
With the batch made and its last sandbox killed, the node that made it drops it
(``Forks.drop_unused``, as a fork's hidden snapshot); one of its sandboxes moved to
another node marks it shared (``shared-<tid>``) and it is kept until deleted; a node
that died mid-batch drops it at its next start (``Forks.sweep``).

Locally a pause's snapshot keeps only its device state and its delta
(``templates/<tid>/``; copied from the paused sandbox's own files when this node holds
them, else fetched from the store); its sandboxes map the memory file of the template
the sandbox was paused over (templates/local.py).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from aenv_store.errors import StoreNotFound

from ..errors import Conflict, Moved, NotFound, SnapshotError, VmError
from ..memory.memory_image import read_delta, write_delta
from ..service import SandboxState
from ..states import Op, Phase, check, phase_of
from ..templates.freeze import freeze_pause
from ..templates.local import DELTA_FILE
from ..templates.meta import HIDDEN_PAUSE
from ..templates.template import Template
from .handover import META_RECORD, META_RUNNING, CommittedPause, parse_portable, read_committed, stale_reason
from .records import SandboxRecord
from .runtime import NodeRuntime
from .snapshots import snapshot_meta


@dataclass(frozen=True)
class PauseSource:
    """The pause a batch starts from."""
    record: SandboxRecord           # the paused sandbox (this node's record, or the repository's copy)
    pause: CommittedPause           # its ``paused-<id>`` record
    local: Path | None              # this node's directory of that very pause, if it has one


def held_source(rt: NodeRuntime, rec: SandboxRecord) -> PauseSource:
    """The last pause of ``rec``, a paused sandbox this node holds, its commit done
    (worker thread; the caller holds the sandbox's lock). Moved: a stale copy."""
    snap = rec.snapshot
    if snap is None or not snap.committed:
        raise SnapshotError(f"sandbox {rec.id}: its pause is not committed to the store")
    why, cp = stale_reason(rt, rec.id, snap.seq, committed=True)
    if why is not None:
        raise Moved(f"sandbox {rec.id} moved: {why}; this node's copy is stale")
    if cp is None:
        raise SnapshotError(f"sandbox {rec.id}: its pause record cannot be read from the repository now")
    same = snap.memory_id is not None and snap.memory_id == cp.record.manifest("memory").hex()
    return PauseSource(rec, cp, Path(snap.local) if same else None)


def committed_source(rt: NodeRuntime, sid: str) -> PauseSource:
    """The last pause of ``sid``, a sandbox this node does not hold, from the shared
    repository (paused by another node, or released; worker thread)."""
    cp = read_committed(rt, sid)
    if cp is None:
        raise NotFound(f"unknown sandbox {sid!r}")
    meta = cp.record.meta_dict()
    if META_RECORD not in meta:
        raise Conflict(f"sandbox {sid} was paused by a node that did not commit its sandbox record: "
                       f"only that node starts sandboxes from its pause")
    try:
        body = parse_portable(meta[META_RECORD])
    except SnapshotError as e:
        raise Conflict(f"sandbox {sid}: {e}") from None
    phase = Phase.RUNNING if META_RUNNING in meta else phase_of(
        SandboxState.PAUSED, bool(body["cold_boot"]), bool(body["envd_unresponsive"]))
    check(phase, Op.FORK_PAUSE, sid)
    return PauseSource(SandboxRecord(id=sid, state=SandboxState.PAUSED, **body), cp, None)


def make_pause_snapshot(rt: NodeRuntime, tid: str, source: PauseSource) -> Template:
    """Template ``tid``: ``source``'s pause named as a hidden snapshot made by this node
    (worker thread). NotFound: the pause is gone from the repository meanwhile."""
    rec, cp = source.record, source.pause
    tpl = rt.templates.resolve(rec.template)     # what the sandbox ran: the machine, the build's settings
    roles = dict(cp.record.manifests)
    try:
        base, delta, state = roles["base"], roles["memory"], roles["state"]
    except KeyError as e:
        raise SnapshotError(f"sandbox {rec.id}: its pause record lacks {e}") from None
    if base != tpl.memory:
        raise SnapshotError(f"sandbox {rec.id}: its pause is over memory image {base.short()}, its template "
                            f"{tpl.id} has {tpl.memory.short()}")
    disk = roles.get("disk", tpl.disk)      # no disk role: its disk was never written
    meta = snapshot_meta(tpl.meta, rec.id, tpl.id, rec.access_token, rec, rt.node_id, hidden=HIDDEN_PAUSE)
    d = rt.templates.dir(tid)
    d.mkdir(parents=True)       # before the record: a start after a crash finds it (Forks.sweep)
    try:
        if source.local is not None:
            _seed(source.local, d)
        freeze_pause(rt.store, tid, disk=disk, base=base, delta=delta, device_state=state, meta=meta)
    except StoreNotFound:
        shutil.rmtree(d, ignore_errors=True)
        raise NotFound(f"sandbox {rec.id}: its pause is gone from the repository (killed meanwhile?)") from None
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return Template(id=tid, disk=disk, memory=base, device_state=state, created=time.time(), meta=meta,
                    delta=delta)


def _seed(pause_dir: Path, d: Path) -> None:
    """The pause's files as the snapshot's local ones (read from this node's page cache
    instead of the store); best effort: what is missing is fetched on first use."""
    with contextlib.suppress(OSError, VmError):
        write_delta(d / DELTA_FILE, read_delta(pause_dir / "memory.delta"))    # version 1, whole
        tmp = d / f"device-state.tmp-{os.getpid()}"
        shutil.copyfile(pause_dir / "device-state", tmp)
        os.replace(tmp, d / "device-state")
