"""Moving a paused sandbox between nodes that share one repository.

Every pause commits a ``paused-<id>`` catalog record (pause.py). Besides the
pause's manifests (disk, memory, base, state) its meta carries what another
node needs to take the sandbox over (docs/snapshots.md "Moving a paused
sandbox"):

* ``sandbox_v`` = ``"1"``: the version of the two fields below;
* ``sandbox_record``: the sandbox's record as canonical JSON, only the fields
  that mean the same on every node (template, times, TTL, metadata, env vars,
  access token, network policy, resources, pause mode, volume mounts, the API's
  annotations); never local paths, ports or the state;
* ``holder``: the node identity (``node_identity``) that made the pause or
  adopted it last, ``seq``: the pause's number.

``adopt`` (the node that takes it over) checks the record, rewrites it naming
itself as holder and puts a local ``paused`` record whose snapshot points into
its own run directory: the first resume finds no local files and fetches them
from the store (resume.py). ``release`` (the node that gives it up) waits for
the pause's commit and forgets the sandbox locally, leaving the repository as
it is.

Stale copies: a node that gave a sandbox up without ``release`` (it was
SIGKILLed, the fleet moved the sandbox, the node came back) still has a local
``paused`` record. Before it resumes, boots or commits a pause, and before a
kill removes the repository record, it reads the repository record: if that
names another holder, or a later pause than its own, the local copy is stale
(``Moved``, a 409): it is not resumed, its pending pause is not committed
over the newer one, and a kill forgets it locally without touching the
record.

Every write of a ``paused-<id>`` record (a pause's commit, the running mark of a
resume, an adopt) is a compare-and-swap over the version of it the writer read
and checked (``Store.swap_record``): of a stale holder and the node that took
the sandbox over, whichever writes first wins and the other is refused
(``Moved`` or ``ResumedElsewhere``), so two nodes never both believe they hold
it (the fencing invariant, docs/cluster.md). A forced adopt (the holder's lease
ran out) whose record says the sandbox runs on its holder first waits
``NodeRuntime.fence_wait`` for that holder's self-fence to write it (a pause,
adopted then as usual, or a reclaim: then the holder is alive and the adopt is
refused); only a record untouched all that time is taken over by force.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, fields
from pathlib import Path

from aenv_store.errors import AlreadyExists, Conflict, StoreError
from aenv_store.errors import StoreNotFound
from aenv_store.formats.catalog import CatalogRecord, check_name
from aenv_store.repository.repository import RecordVersion
from aenv_store.store import Store

from ..errors import AlreadyHeld, Moved, NotCommitted, NotMovable, NotPaused, ResumedElsewhere, SnapshotError, VmError
from .records import RecordStore, SandboxRecord, SandboxState, SnapshotRef
from .runtime import NodeRuntime

log = logging.getLogger(__name__)

PAUSED_KIND = "sandbox-snapshot"
RECORD_VERSION = 1
META_VERSION = "sandbox_v"
META_RECORD = "sandbox_record"
META_HOLDER = "holder"
META_SEQ = "seq"
META_RUNNING = "running_on"
NODE_ID_FILE = "node-id"

# SandboxRecord fields that travel with a pause (everything but id, state, local
# ports and paths, the snapshot reference and the note).
PORTABLE = ("template", "started_at", "end_at", "auto_pause", "timeout", "metadata", "env_vars", "access_token",
            "allow_internet_access", "network", "memory_mib", "vcpus", "pause_memory", "cold_boot",
            "envd_unresponsive", "volume_mounts", "annotations")


def paused_name(sid: str) -> str:
    return f"paused-{sid}"


SHARED_KIND = "fork-shared"   # record kind of the mark: a fork's snapshot is used beyond its node


def shared_mark(tid: str) -> str:
    return f"shared-{tid}"


def mark_shared(store: Store, tid: str) -> None:
    """Mark fork snapshot ``tid`` as used beyond the node that made it (a sandbox made
    from it, or moved, elsewhere): no node drops it with its last child any more, since
    none sees every user (worker thread). It is kept until deleted (docs/snapshots.md)."""
    try:
        store.put_record(CatalogRecord(name=shared_mark(tid), kind=SHARED_KIND, meta=(("template", tid),),
                                       created=time.time()), exclusive=True)
    except AlreadyExists:
        pass


def node_identity(run_root: Path) -> str:
    """This node's identity as a pause holder: 16 random hex digits made on first use
    and kept in ``<run_root>/node-id`` (a node is its run directory: two nodes never
    share one, and a node keeps its identity across restarts)."""
    path = run_root / NODE_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    run_root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{NODE_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(secrets.token_hex(8) + "\n")
    try:
        os.link(tmp, path)       # the first of two racing starts wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def portable_json(rec: SandboxRecord) -> str:
    """The travelling fields of ``rec``, version ``RECORD_VERSION``, canonical JSON."""
    body = {name: getattr(rec, name) for name in PORTABLE}
    return json.dumps({"v": RECORD_VERSION, **body}, sort_keys=True, separators=(",", ":"))


def parse_portable(raw: str) -> dict:
    """The fields ``portable_json`` wrote (SnapshotError if they are not a version-1 record)."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise SnapshotError(f"unreadable sandbox record in the pause: {e}") from None
    if not isinstance(obj, dict) or obj.get("v") != RECORD_VERSION:
        raise SnapshotError(f"sandbox record version {obj.get('v') if isinstance(obj, dict) else '?'!r} "
                            f"is not supported (this node reads version {RECORD_VERSION})")
    known = {f.name for f in fields(SandboxRecord)}
    body = {k: v for k, v in obj.items() if k != "v"}
    missing = [k for k in PORTABLE if k not in body]
    unknown = [k for k in body if k not in known]
    if missing or unknown:
        raise SnapshotError(f"sandbox record: missing {missing}, unknown {unknown}")
    return body


def pause_meta(rec: SandboxRecord, seq: int, holder: str) -> dict[str, str]:
    """The meta of the ``paused-<id>`` record of pause ``seq`` of ``rec``."""
    return {"sandbox": rec.id, META_SEQ: str(seq), "template": rec.template, META_HOLDER: holder,
            META_VERSION: str(RECORD_VERSION), META_RECORD: portable_json(rec)}


@dataclass(frozen=True)
class CommittedPause:
    """A ``paused-<id>`` record as read from the repository, with the stored version it
    was read from (what a compare-and-swap of it replaces)."""
    record: CatalogRecord
    seq: int
    holder: str | None              # None: committed by a node that did not name itself
    version: RecordVersion

    @classmethod
    def of(cls, rec: CatalogRecord, version: RecordVersion) -> "CommittedPause":
        meta = rec.meta_dict()
        try:
            seq = int(meta.get(META_SEQ, "0"))
        except ValueError:
            seq = 0
        return cls(rec, seq, meta.get(META_HOLDER) or None, version)

    def with_meta(self, meta: dict[str, str]) -> CatalogRecord:
        """This record with ``meta`` instead of its own (manifests and time kept)."""
        return CatalogRecord(name=self.record.name, kind=PAUSED_KIND, manifests=self.record.manifests,
                             meta=tuple(sorted(meta.items())), created=self.record.created)

    @property
    def running_on(self) -> str | None:
        """The node that resumed the sandbox after this pause (None: it is paused)."""
        return self.record.meta_dict().get(META_RUNNING) or None


def read_committed(rt: NodeRuntime, sid: str) -> CommittedPause | None:
    """The repository's ``paused-<sid>`` record; None if there is none (or ``sid`` cannot
    name one: no sandbox has such an id)."""
    try:
        check_name(paused_name(sid))
    except ValueError:
        return None
    version = rt.store.get_record_version(paused_name(sid))
    rec = version.record()
    if rec is None or rec.name != paused_name(sid) or rec.kind != PAUSED_KIND:
        return None
    return CommittedPause.of(rec, version)


def commit_version(rt: NodeRuntime, sid: str, seq: int) -> RecordVersion:
    """The version of ``paused-<sid>`` this node's pause ``seq`` may replace (worker
    thread): Moved if another node holds the sandbox now or the repository has a newer
    pause. The commit swaps over exactly this version, so a takeover between this read
    and the write still refuses it."""
    cp = read_committed(rt, sid)
    if cp is not None:
        if cp.holder is not None and cp.holder != rt.node_id:
            raise Moved(f"sandbox {sid} moved: node {cp.holder} holds it now (its pause {cp.seq} in the "
                        f"repository); pause {seq} of this node is not committed (release it here)")
        if cp.seq > seq:
            raise Moved(f"sandbox {sid} moved: the repository has its pause {cp.seq}, newer than this node's "
                        f"pause {seq}, which is not committed (release it here)")
        return cp.version
    return rt.store.get_record_version(paused_name(sid))


def stale_reason(rt: NodeRuntime, sid: str, seq: int, committed: bool) -> tuple[str | None, CommittedPause | None]:
    """Why this node's pause ``seq`` of ``sid`` is not the sandbox's latest (None: it is,
    or the repository cannot tell now), and the record read. ``committed``: this node
    committed that pause, so the repository must still have it."""
    try:
        cp = read_committed(rt, sid)
    except (StoreError, ValueError) as e:   # unreachable or unreadable: no verdict, keep working
        log.warning("sandbox %s: cannot read its pause record (%s); not checking for a move", sid, e)
        return None, None
    if cp is None:
        return ("its pause record is gone from the repository (killed on another node?)" if committed else None), None
    if cp.holder is not None and cp.holder != rt.node_id:
        return f"node {cp.holder} holds it now (its pause {cp.seq} in the repository)", cp
    if cp.seq > seq:
        return f"the repository has its pause {cp.seq}, newer than this node's pause {seq}", cp
    return None, cp


def check_held(rt: NodeRuntime, rec: SandboxRecord) -> CommittedPause | None:
    """Before a resume or boot: Moved if this node's copy of paused ``rec`` is stale;
    else the repository's record of it (None if it cannot be read) for ``mark_running``
    (worker thread)."""
    snap = rec.snapshot
    if snap is None:
        return None
    why, cp = stale_reason(rt, rec.id, snap.seq, snap.committed)
    if why is not None:
        raise Moved(f"sandbox {rec.id} moved: {why}; this node's copy is stale (release it here)")
    return cp


def mark_running(rt: NodeRuntime, cp: CommittedPause) -> None:
    """Say in the repository that this node resumes the sandbox after that pause, so
    that an adopt elsewhere refuses it unless forced (worker thread, before the resume
    starts the guest; the next pause's commit replaces the record). Moved if the record
    changed since ``cp`` was read (another node took the sandbox over in between: the
    resume must not run a second copy). Any other failure is logged: the resume does
    not depend on it."""
    rec = cp.with_meta({**cp.record.meta_dict(), META_RUNNING: rt.node_id})
    try:   # the manifests are those of the record just read: no need to check them again
        rt.store.repository.swap_record(rec, cp.version)
    except Conflict:
        raise Moved(f"sandbox {cp.record.name.removeprefix('paused-')} moved: its pause record changed while "
                    f"this node resumed it (another node took it over); this node's copy is stale") from None
    except (StoreError, OSError) as e:
        log.warning("%s: the running mark was not written: %s", cp.record.name, e)


def claim_held(rt: NodeRuntime, rec: SandboxRecord) -> None:
    """Before a resume or boot of paused ``rec`` (worker thread): ``check_held``, then
    ``mark_running`` over the version it read. Moved: this node's copy is stale."""
    cp = check_held(rt, rec)
    if cp is not None:
        mark_running(rt, cp)


def reclaim(rt: NodeRuntime, sid: str) -> bool:
    """This node kept running ``sid`` through a lapse of its lease (frozen, not paused):
    rewrite its pause record, still naming this node as where it runs, over the version
    read (worker thread). True: this node still holds it, and a forced adopt that read
    the older version is refused; False: another node adopted it meanwhile (or the
    record names another holder): this node's running copy is stale."""
    cp = read_committed(rt, sid)
    if cp is None:
        return True     # never paused: nothing in the repository another node could adopt
    if (cp.holder is not None and cp.holder != rt.node_id) or cp.running_on not in (None, rt.node_id):
        return False
    rec = cp.with_meta({**cp.record.meta_dict(), META_RUNNING: rt.node_id,
                        "reclaimed_at": str(round(time.time(), 3))})
    try:
        rt.store.repository.swap_record(rec, cp.version)
    except Conflict:        # written in between: by another node, or by this one (a pause, a reclaim)
        now = read_committed(rt, sid)
        return now is None or (now.holder in (None, rt.node_id) and now.running_on in (None, rt.node_id))
    return True


def delete_if_held(rt: NodeRuntime, sid: str) -> None:
    """Remove the repository's ``paused-<sid>`` record if this node holds it (a kill):
    a stale copy's kill must not delete the pause another node holds."""
    try:
        cp = read_committed(rt, sid)
        if cp is None:
            return
        if cp.holder is not None and cp.holder != rt.node_id:
            log.info("sandbox %s: its pause record is node %s's: left in the repository", sid, cp.holder)
            return
        rt.store.delete_record(paused_name(sid))
    except StoreNotFound:
        pass


FENCE_POLL = 0.5       # seconds between reads of the record while a holder's self-fence is awaited


async def await_fence(rt: NodeRuntime, sid: str, cp: CommittedPause) -> tuple[CommittedPause, bool]:
    """Before a forced adopt of ``sid``, whose record ``cp`` says it runs on a node whose
    lease ran out: wait up to ``rt.fence_wait`` for that node's self-fence to write the
    record (its pause, or a reclaim). Returns the record to adopt from and whether the
    adopt is still forced: the newer version, unforced, if the holder wrote it (a pause is
    then adopted as any; a record still naming where it runs is refused); ``cp``, forced,
    if nothing changed (the holder is gone: its running state since that pause is lost)."""
    deadline = time.monotonic() + rt.fence_wait
    while time.monotonic() < deadline:
        await asyncio.sleep(FENCE_POLL)
        now = await asyncio.to_thread(read_committed, rt, sid)
        if now is None:
            raise NotCommitted(f"sandbox {sid}: its pause record left the repository while this node waited "
                               f"to adopt it (killed?)")
        if now.version != cp.version:
            log.info("sandbox %s: its holder %s wrote its pause record while this node waited to adopt it",
                     sid, cp.running_on)
            return now, False
    log.info("sandbox %s: its record still says it runs on %s after %.0f s: adopted by force from pause %d",
             sid, cp.running_on, rt.fence_wait, cp.seq)
    return cp, True


class Moves:
    """Adopt and release of paused sandboxes on this node (the manager holds the lock)."""

    def __init__(self, rt: NodeRuntime, records: RecordStore) -> None:
        self.rt = rt
        self.records = records

    def adopt(self, sid: str, force: bool = False, cp: CommittedPause | None = None) -> SandboxRecord:
        """Take over sandbox ``sid`` that another node paused and committed (worker thread):
        NotCommitted if the repository has no pause of it, AlreadyHeld if this node holds
        it, NotMovable if it cannot move (volume mounts, an older record format, its
        template gone), ResumedElsewhere if its holder resumed it after that pause, unless
        ``force`` (the caller knows that node is gone: the sandbox then continues from that
        pause). ``cp``: the record as the caller read it (else read here); the takeover is
        written over exactly that version (ResumedElsewhere if it changed since)."""
        held = self.records.get(sid)
        if held is not None:
            raise AlreadyHeld(f"this node already holds sandbox {sid} ({held.state.value})")
        if cp is None:
            cp = read_committed(self.rt, sid)
        if cp is None:
            raise NotCommitted(f"the repository has no paused sandbox {sid!r}")
        meta = cp.record.meta_dict()
        if META_RECORD not in meta:
            raise NotMovable(f"sandbox {sid} was paused by a node that did not commit its sandbox record "
                           f"(no {META_VERSION} in its pause): it can only be resumed where it was paused")
        try:
            body = parse_portable(meta[META_RECORD])
        except SnapshotError as e:      # a newer (or broken) format: the node that wrote it resumes it
            raise NotMovable(f"sandbox {sid} cannot be adopted here: {e}") from None
        running = meta.pop(META_RUNNING, None)
        if running is not None and not force:
            raise ResumedElsewhere(f"sandbox {sid} was resumed on node {running} after its pause {cp.seq} and may be "
                           f"running there; adopt it with force only if that node is gone (it then continues "
                           f"from pause {cp.seq})")
        if body["volume_mounts"]:
            paths = ", ".join(sorted(m.get("path", "?") for m in body["volume_mounts"]))
            raise NotMovable(f"sandbox {sid} has volumes mounted ({paths}); volumes are directories of the node "
                           f"that made them (docs/volumes.md), so it cannot move to another node")
        try:
            tpl = self.rt.templates.resolve(body["template"])
        except VmError as e:
            raise NotMovable(f"sandbox {sid} cannot be adopted: its template {body['template']}: {e}") from None
        if tpl.hidden_fork_node is not None:   # a fork child moving: its snapshot outlives its node's children
            mark_shared(self.rt.store, tpl.id)
        try:
            disk = cp.record.manifest("disk").hex()
        except KeyError:
            disk = None
        snap = SnapshotRef(seq=cp.seq, local=str(self.rt.paused_dir(sid) / str(cp.seq)),
                           base=cp.record.manifest("base").hex(), disk_top=disk, committed=True,
                           memory_id=cp.record.manifest("memory").hex(), state_id=cp.record.manifest("state").hex(),
                           created=cp.record.created)
        # From here on the repository names this node: a stale copy elsewhere refuses to resume.
        meta[META_HOLDER] = self.rt.node_id
        if cp.holder:
            meta["adopted_from"] = cp.holder
        try:
            self.rt.store.swap_record(cp.with_meta(meta), cp.version)
        except Conflict:
            raise ResumedElsewhere(f"sandbox {sid}: its pause record changed while this node adopted it (its "
                                   f"holder {cp.holder or '?'} wrote it: alive after all); not adopted") from None
        for d in (self.rt.paused_dir(sid), self.rt.sandbox_dir(sid)):
            shutil.rmtree(d, ignore_errors=True)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        rec = SandboxRecord(id=sid, state=SandboxState.PAUSED, snapshot=snap, envd_port=None,
                            note=f"adopted from node {cp.holder or '?'} at {when}", **body)
        self.records.put(rec)
        log.info("sandbox %s adopted (pause %d, from node %s%s)", sid, cp.seq, cp.holder,
                 f", forced: it was resumed on node {running}" if running else "")
        return rec

    def forget(self, sid: str) -> None:
        """The local side of ``release``: record and local pause files go, the repository
        keeps everything (worker thread, after the pause's commit and ``PausedSandboxes.release``)."""
        rec = self.records.get(sid)
        if rec is not None:
            try:
                if self.rt.templates.resolve(rec.template).hidden_fork_node is not None:
                    mark_shared(self.rt.store, rec.template)    # kept for whoever adopts it
            except VmError as e:
                log.warning("sandbox %s: its template %s: %s", sid, rec.template, e)
        shutil.rmtree(self.rt.paused_dir(sid), ignore_errors=True)
        shutil.rmtree(self.rt.sandbox_dir(sid), ignore_errors=True)
        self.records.delete(sid)


def check_releasable(rec: SandboxRecord, running: bool) -> None:
    """NotPaused or NotMovable unless ``rec`` is a paused sandbox another node could adopt."""
    if running or rec.state == SandboxState.RUNNING:
        raise NotPaused(f"sandbox {rec.id} is running: pause it before releasing it")
    if rec.state != SandboxState.PAUSED or rec.snapshot is None:
        raise NotPaused(f"sandbox {rec.id} is {rec.state.value}: only a paused sandbox can be released")
    if rec.volume_mounts:
        raise NotMovable(f"sandbox {rec.id} has volumes mounted; volumes are directories of this node "
                       f"(docs/volumes.md), so it cannot move to another node")
