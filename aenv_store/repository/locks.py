"""Repository locks: small JSON objects under ``locks/<uuid>`` in the repository backend.

Shared locks are held by writers (a workspace from its first dedup lookup until its
commit is durable); the exclusive lock is held by gc. Because a lock is just an
object written with ``Backend.create``/``put``, the same code works on posix_fs and
on S3, across hosts, with no lock server (restic's design).

Protocol (docs/admin.md):
- acquire: list locks; fail if a live lock conflicts; write ours; re-list and fail
  (removing ours) if a live conflicting lock appeared meanwhile. Every party
  re-lists *after* writing its own lock, so of two racers at least one sees the
  other; both may back off, never both proceed.
- a lock is refreshed (rewritten with a new ``refreshed`` time) by a background
  thread every ``timeout / 3`` while held.
- a lock is stale when its owner process on this host is gone (pid absent, a
  zombie, or a different process start time / boot id), or when it has not been
  refreshed for longer than its timeout (owners on other hosts, hung owners).
  Stale locks are ignored by acquirers and may be deleted by anyone.
- a holder whose lock object disappeared (someone judged it stale) has *lost*
  the lock: ``check()`` raises, and gc calls it before every destructive step.
"""
from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace
from enum import Enum
from typing import TypedDict, Unpack

from ..errors import BackendError, CorruptData, LockError, StoreNotFound
from .backends.base import Backend, ObjectInfo

log = logging.getLogger(__name__)

LOCK_PREFIX = "locks/"
LOCK_FORMAT = 1
DEFAULT_TIMEOUT = 30 * 60.0
# After writing an exclusive lock, wait this long before re-listing so a racing
# writer's lock (on an eventually consistent listing) has time to show up.
DEFAULT_SETTLE = 0.05


class LockKind(str, Enum):
    SHARED = "shared"
    EXCLUSIVE = "exclusive"


@dataclass(frozen=True)
class ProcessIdentity:
    """Who owns a lock: enough to tell, on the same host, whether the owner still runs."""

    host: str
    pid: int
    # Process start time in clock ticks since boot (/proc/<pid>/stat field 22):
    # a recycled pid has a different start time. None where /proc is unavailable.
    start_ticks: int | None
    # /proc/sys/kernel/random/boot_id: a lock from an earlier boot of this host is dead.
    boot_id: str

    @classmethod
    def current(cls) -> "ProcessIdentity":
        pid = os.getpid()
        return cls(host=socket.gethostname(), pid=pid, start_ticks=_start_ticks(pid), boot_id=_boot_id())


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start_ticks) of a live pid, None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ("?", -1)
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return ("?", -1)


def _start_ticks(pid: int) -> int | None:
    st = _proc_stat(pid)
    return st[1] if st and st[1] >= 0 else None


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether ``pid`` on this host is still the process that took the lock."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        st = _proc_stat(pid)
        if st is None:
            return False
        state, ticks = st
        if state in ("Z", "X"):  # killed but not yet reaped: it will never refresh or release
            return False
        if start_ticks is not None and ticks >= 0 and ticks != start_ticks:
            return False  # pid recycled by another process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class LockInfo:
    """The content of one lock object."""

    kind: LockKind
    host: str
    pid: int
    start_ticks: int | None
    boot_id: str
    created: float
    refreshed: float
    timeout: float
    purpose: str = ""
    key: str = ""  # backend key; not part of the JSON

    def encode(self) -> bytes:
        return json.dumps({
            "format": LOCK_FORMAT, "kind": self.kind.value, "host": self.host, "pid": self.pid,
            "start_ticks": self.start_ticks, "boot_id": self.boot_id, "created": self.created,
            "refreshed": self.refreshed, "timeout": self.timeout, "purpose": self.purpose,
        }, sort_keys=True).encode()

    @classmethod
    def decode(cls, key: str, data: bytes) -> "LockInfo":
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("format") != LOCK_FORMAT:
                raise ValueError(f"unknown lock format {d.get('format') if isinstance(d, dict) else d!r}")
            ticks = d.get("start_ticks")
            return cls(
                kind=LockKind(d["kind"]), host=str(d["host"]), pid=int(d["pid"]),
                start_ticks=None if ticks is None else int(ticks), boot_id=str(d.get("boot_id", "")),
                created=float(d["created"]), refreshed=float(d["refreshed"]),
                timeout=float(d["timeout"]), purpose=str(d.get("purpose", "")), key=key,
            )
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptData(f"lock object {key} is not a valid lock: {e}") from None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        what = f" ({self.purpose})" if self.purpose else ""
        return f"{self.kind.value} lock {self.key} held by pid {self.pid} on {self.host}{what} since {since}"

    def stale_reason(self, now: float, me: ProcessIdentity, mtime: float | None = None) -> str | None:
        """Why this lock is stale, or None if it must be respected."""
        if self.host == me.host and self.boot_id and me.boot_id:
            if self.boot_id != me.boot_id:
                return "its host has rebooted since it was taken"
            if not process_alive(self.pid, self.start_ticks):
                return f"its owner pid {self.pid} is no longer running"
        # The object's own mtime guards against a skewed clock in the JSON.
        last = max(self.refreshed, mtime or 0.0)
        if now - last > self.timeout:
            return f"not refreshed for {now - last:.0f}s (timeout {self.timeout:.0f}s)"
        return None


@dataclass(frozen=True)
class LockEntry:
    """A lock object as found in the backend, with its staleness judged."""

    key: str
    info: LockInfo | None  # None: unreadable object
    stale: str | None      # reason, or None when live

    def describe(self) -> str:
        return self.info.describe() if self.info else f"unreadable lock object {self.key}"


def list_locks(backend: Backend, now: float | None = None, me: ProcessIdentity | None = None) -> list[LockEntry]:
    """Every lock object in the repository with its staleness judged."""
    now = time.time() if now is None else now
    me = me or ProcessIdentity.current()
    out: list[LockEntry] = []
    for obj in backend.list(LOCK_PREFIX):
        out.append(_judge(backend, obj, now, me))
    out.sort(key=lambda e: e.key)
    return out


def _judge(backend: Backend, obj: ObjectInfo, now: float, me: ProcessIdentity) -> LockEntry:
    try:
        info = LockInfo.decode(obj.key, backend.get(obj.key))
    except StoreNotFound:
        return LockEntry(obj.key, None, "removed while listing")
    except CorruptData:
        # A garbage lock object (writes are atomic, so not a half-written one):
        # respect it for one default timeout after it was written, then ignore it.
        stale = "unreadable" if now - obj.mtime > DEFAULT_TIMEOUT else None
        return LockEntry(obj.key, None, stale)
    return LockEntry(obj.key, info, info.stale_reason(now, me, obj.mtime))


def remove_stale_locks(backend: Backend) -> list[LockEntry]:
    """Delete every stale lock object; returns what was removed."""
    removed = [e for e in list_locks(backend) if e.stale is not None]
    for e in removed:
        backend.delete(e.key)
        log.info("removed stale lock %s: %s", e.key, e.stale)
    return removed


def _conflicts(kind: LockKind, entries: list[LockEntry], own_key: str | None) -> list[LockEntry]:
    live = [e for e in entries if e.stale is None and e.key != own_key]
    if kind is LockKind.EXCLUSIVE:
        return live
    return [e for e in live if e.info is None or e.info.kind is LockKind.EXCLUSIVE]


class RepositoryLock:
    """A held lock. Use as a context manager; ``release()`` is idempotent."""

    def __init__(self, backend: Backend, info: LockInfo, refresh_interval: float | None) -> None:
        self.backend = backend
        self.info = info
        self._lost: str | None = None
        self._released = False
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if refresh_interval and refresh_interval > 0:
            self._thread = threading.Thread(target=self._refresher, args=(refresh_interval,),
                                            name=f"aenv-lock-refresh-{info.key[-8:]}", daemon=True)
            self._thread.start()

    @property
    def key(self) -> str:
        return self.info.key

    @property
    def kind(self) -> LockKind:
        return self.info.kind

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def check(self) -> None:
        """Raise ``LockError`` if the lock was released or taken away (judged stale by another process)."""
        if self._released:
            raise LockError(f"{self.info.kind.value} lock {self.key} was already released")
        if self._lost is not None:
            raise LockError(f"lost the {self.info.kind.value} repository lock {self.key}: {self._lost}")
        if not self.backend.exists(self.key):
            self._lost = "the lock object was removed by another process (judged stale)"
            raise LockError(f"lost the {self.info.kind.value} repository lock {self.key}: {self._lost}")

    def refresh(self) -> None:
        """Rewrite the lock with a new ``refreshed`` time; marks it lost if it vanished."""
        with self._mutex:
            if self._released or self._lost is not None:
                return
            if not self.backend.exists(self.key):
                self._lost = "the lock object was removed by another process (judged stale)"
                log.error("repository lock %s lost: %s", self.key, self._lost)
                return
            info = replace(self.info, refreshed=time.time())
            self.backend.put(self.key, info.encode())
            self.info = info

    def _refresher(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.refresh()
            except BackendError as e:
                # Keep trying; a lock not refreshed within its timeout goes stale on its own.
                log.warning("could not refresh repository lock %s: %s", self.key, e)
                if time.time() - self.info.refreshed > self.info.timeout:
                    self._lost = f"could not refresh it within its timeout: {e}"
            if self._lost is not None:
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._mutex:
            if self._released:
                return
            self._released = True
            try:
                self.backend.delete(self.key)
            except BackendError as e:
                log.warning("could not remove repository lock %s (it will go stale): %s", self.key, e)

    def __enter__(self) -> "RepositoryLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RepositoryLock({self.info.kind.value}, {self.key})"


def acquire(
    backend: Backend,
    kind: LockKind,
    *,
    purpose: str = "",
    timeout: float = DEFAULT_TIMEOUT,
    refresh_interval: float | None = -1.0,
    wait: float = 0.0,
    settle: float = DEFAULT_SETTLE,
    remove_stale: bool = True,
) -> RepositoryLock:
    """Take a lock of ``kind``; retry for up to ``wait`` seconds while it conflicts.

    ``refresh_interval``: -1 = ``timeout / 3``; None or 0 = never refresh (tests).
    ``remove_stale``: delete stale lock objects found on the way (taking them over).
    Raises ``LockError`` naming the holder of a conflicting lock.
    """
    if timeout <= 0:
        raise LockError(f"lock timeout must be positive, got {timeout}")
    deadline = time.monotonic() + max(wait, 0.0)
    delay = 0.05
    while True:
        try:
            return _try_acquire(backend, kind, purpose, timeout, refresh_interval, settle, remove_stale)
        except LockError:
            if time.monotonic() >= deadline:
                raise
        # Jittered exponential backoff so two racers that both backed off do not collide again.
        time.sleep(min(delay * (0.5 + random.random()), max(deadline - time.monotonic(), 0.0)))
        delay = min(delay * 2, 2.0)


def _try_acquire(backend: Backend, kind: LockKind, purpose: str, timeout: float,
                 refresh_interval: float | None, settle: float, remove_stale: bool) -> RepositoryLock:
    me = ProcessIdentity.current()
    entries = list_locks(backend, me=me)
    _raise_on_conflict(kind, entries, None)
    if remove_stale:
        for e in entries:
            if e.stale is not None:
                backend.delete(e.key)
                log.info("removed stale lock %s: %s", e.key, e.stale)
    now = time.time()
    key = f"{LOCK_PREFIX}{uuid.uuid4().hex}"
    info = LockInfo(kind=kind, host=me.host, pid=me.pid, start_ticks=me.start_ticks, boot_id=me.boot_id,
                    created=now, refreshed=now, timeout=timeout, purpose=purpose, key=key)
    backend.create(key, info.encode())
    try:
        if settle > 0 and kind is LockKind.EXCLUSIVE:
            time.sleep(settle)
        _raise_on_conflict(kind, list_locks(backend, me=me), key)
    except BaseException:
        backend.delete(key)
        raise
    interval = timeout / 3 if refresh_interval is not None and refresh_interval < 0 else refresh_interval
    return RepositoryLock(backend, info, interval)


def _raise_on_conflict(kind: LockKind, entries: list[LockEntry], own_key: str | None) -> None:
    conflicts = _conflicts(kind, entries, own_key)
    if not conflicts:
        return
    want = "an exclusive" if kind is LockKind.EXCLUSIVE else "a shared"
    holders = "; ".join(e.describe() for e in conflicts[:3])
    more = f" (and {len(conflicts) - 3} more)" if len(conflicts) > 3 else ""
    raise LockError(f"cannot take {want} repository lock: it is locked by {holders}{more}. "
                    f"If that process is gone on another host, the lock goes stale after its timeout; "
                    f"`aenv repo unlock` removes stale locks")


class LockOptions(TypedDict, total=False):
    """``acquire``'s keyword arguments, for the two shorthands below."""
    purpose: str
    timeout: float
    refresh_interval: float | None
    wait: float
    settle: float
    remove_stale: bool


def lock_shared(backend: Backend, **options: Unpack[LockOptions]) -> RepositoryLock:
    return acquire(backend, LockKind.SHARED, **options)


def lock_exclusive(backend: Backend, **options: Unpack[LockOptions]) -> RepositoryLock:
    return acquire(backend, LockKind.EXCLUSIVE, **options)


# Writers wait this long for a running gc (the only exclusive holder) before failing.
DEFAULT_WRITER_WAIT = 600.0


def shared_lock(backend: Backend, owner: str, wait: float = DEFAULT_WRITER_WAIT) -> RepositoryLock:
    """The writer's lock (Repository.writer_lock): shared, waits out a running gc.
    Taken when called; release it with ``with`` or ``release()``."""
    return acquire(backend, LockKind.SHARED, purpose=owner, wait=wait)
