"""Repository locks on a real posix_fs backend: shared vs exclusive, staleness by dead
owner / recycled pid / timeout, refresh, lost locks, and the write-then-re-list race."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_store.errors import CorruptData, LockError
from aenv_store.repository.backends.posix_fs import PosixFsBackend
from aenv_store.repository.locks import (
    LOCK_PREFIX,
    LockInfo,
    LockKind,
    ProcessIdentity,
    acquire,
    list_locks,
    lock_exclusive,
    lock_shared,
    remove_stale_locks,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def backend(tmp_path: Path) -> PosixFsBackend:
    return PosixFsBackend(tmp_path / "repo")


def _foreign_lock(backend: PosixFsBackend, kind: LockKind, refreshed_ago: float, timeout: float = 60.0,
                  host: str = "some-other-host", name: str = "f" * 32) -> str:
    now = time.time()
    info = LockInfo(kind=kind, host=host, pid=4242, start_ticks=1, boot_id="other-boot",
                    created=now - refreshed_ago, refreshed=now - refreshed_ago, timeout=timeout,
                    purpose="test holder")
    key = f"{LOCK_PREFIX}{name}"
    backend.create(key, info.encode())
    return key


def test_shared_locks_coexist_and_block_exclusive(backend: PosixFsBackend) -> None:
    a = lock_shared(backend, purpose="commit A")
    b = lock_shared(backend, purpose="commit B")
    with pytest.raises(LockError) as exc:
        lock_exclusive(backend, purpose="gc", settle=0)
    msg = str(exc.value)
    assert "shared lock" in msg and f"pid {os.getpid()}" in msg and "commit A" in msg
    a.release()
    with pytest.raises(LockError):
        lock_exclusive(backend, settle=0)
    b.release()
    with lock_exclusive(backend, purpose="gc", settle=0) as ex:
        assert ex.kind is LockKind.EXCLUSIVE
        assert [e.key for e in list_locks(backend)] == [ex.key]
        # exclusive blocks both shared and exclusive
        with pytest.raises(LockError, match=r"exclusive lock .*\(gc\)"):
            lock_shared(backend)
        with pytest.raises(LockError):
            lock_exclusive(backend, settle=0)
    assert list(backend.list(LOCK_PREFIX)) == []  # released on exit
    a.release()  # idempotent


def test_failed_acquire_leaves_no_lock_behind(backend: PosixFsBackend) -> None:
    with lock_exclusive(backend, settle=0):
        for _ in range(3):
            with pytest.raises(LockError):
                lock_shared(backend)
        assert len(list(backend.list(LOCK_PREFIX))) == 1


def test_wait_retries_until_conflict_goes_away(backend: PosixFsBackend) -> None:
    holder = lock_exclusive(backend, settle=0)
    threading.Timer(0.3, holder.release).start()
    t0 = time.monotonic()
    with lock_shared(backend, wait=5.0):
        assert time.monotonic() - t0 >= 0.25


def _spawn_holder(repo: Path, kind: str) -> subprocess.Popen[str]:
    code = textwrap.dedent(f"""
        import sys, time
        from aenv_store.repository.backends.posix_fs import PosixFsBackend
        from aenv_store.repository.locks import acquire, LockKind
        lock = acquire(PosixFsBackend({str(repo)!r}), LockKind({kind!r}), purpose="child", settle=0)
        print(lock.key, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith(LOCK_PREFIX), line
    return proc


@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_lock_of_killed_process_is_stale(backend: PosixFsBackend, reap: bool) -> None:
    proc = _spawn_holder(backend.root, "shared")
    try:
        with pytest.raises(LockError, match=f"pid {proc.pid}"):
            lock_exclusive(backend, settle=0)
        proc.send_signal(signal.SIGKILL)
        if reap:
            proc.wait()
        else:
            # An unreaped child is a zombie: its /proc entry still exists, it must count as dead.
            for _ in range(200):
                if open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
                time.sleep(0.01)
        entries = list_locks(backend)
        assert len(entries) == 1 and entries[0].stale and "no longer running" in entries[0].stale
        with lock_exclusive(backend, settle=0) as ex:
            # the stale lock was taken over (deleted), only ours remains
            assert [e.key for e in list_locks(backend)] == [ex.key]
    finally:
        proc.kill()
        proc.wait()


def test_recycled_pid_is_stale(backend: PosixFsBackend) -> None:
    me = ProcessIdentity.current()
    assert me.start_ticks is not None
    now = time.time()
    # Our own (live) pid, but a different start time: a previous process that had this pid.
    info = LockInfo(kind=LockKind.SHARED, host=me.host, pid=me.pid, start_ticks=me.start_ticks + 1,
                    boot_id=me.boot_id, created=now, refreshed=now, timeout=3600)
    backend.create(f"{LOCK_PREFIX}{'a' * 32}", info.encode())
    (entry,) = list_locks(backend)
    assert entry.stale is not None
    # and a lock from a previous boot of this host is stale too
    backend.put(entry.key, LockInfo(**{**info.__dict__, "start_ticks": me.start_ticks, "boot_id": "x"}).encode())
    (entry,) = list_locks(backend)
    assert entry.stale is not None and "rebooted" in entry.stale
    lock_exclusive(backend, settle=0).release()


def test_foreign_host_lock_respected_until_timeout(backend: PosixFsBackend) -> None:
    key = _foreign_lock(backend, LockKind.EXCLUSIVE, refreshed_ago=10, timeout=60)
    with pytest.raises(LockError, match="some-other-host"):
        lock_shared(backend)
    # Its owner host cannot be asked about its pid: only the refresh time tells.
    backend.put(key, json.dumps({**json.loads(backend.get(key)), "refreshed": time.time() - 120}).encode())
    os.utime(backend._path(key), (time.time() - 120, time.time() - 120))
    (entry,) = list_locks(backend)
    assert entry.stale and "not refreshed" in entry.stale
    removed = remove_stale_locks(backend)
    assert [e.key for e in removed] == [key]
    assert list(backend.list(LOCK_PREFIX)) == []


def test_object_mtime_keeps_lock_fresh_despite_skewed_clock(backend: PosixFsBackend) -> None:
    # The holder's clock says "2 hours ago" but the object was just written: respect it.
    _foreign_lock(backend, LockKind.EXCLUSIVE, refreshed_ago=7200, timeout=60)
    with pytest.raises(LockError):
        lock_shared(backend)


def test_refresh_keeps_lock_alive_and_detects_loss(backend: PosixFsBackend) -> None:
    lock = acquire(backend, LockKind.SHARED, timeout=0.6, refresh_interval=0.1)
    try:
        first = lock.info.refreshed
        time.sleep(1.0)
        assert lock.info.refreshed > first
        stored = LockInfo.decode(lock.key, backend.get(lock.key))
        assert stored.refreshed > first
        # judged from elsewhere (another host), the lock is still fresh thanks to the refresher
        other = ProcessIdentity(host="elsewhere", pid=1, start_ticks=None, boot_id="b")
        (entry,) = list_locks(backend, me=other)
        assert entry.stale is None
        lock.check()
        backend.delete(lock.key)  # someone judged it stale and removed it
        # the refresher (every 0.1 s) notices; on a loaded machine its thread may run late
        deadline = time.monotonic() + 10
        while not lock.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.lost
        with pytest.raises(LockError, match="lost"):
            lock.check()
        assert not backend.exists(lock.key)  # the refresher must not resurrect it
    finally:
        lock.release()


def test_unrefreshed_lock_goes_stale_by_timeout(backend: PosixFsBackend) -> None:
    lock = acquire(backend, LockKind.EXCLUSIVE, timeout=0.3, refresh_interval=None, settle=0)
    other = ProcessIdentity(host="elsewhere", pid=1, start_ticks=None, boot_id="b")
    assert list_locks(backend, me=other)[0].stale is None
    time.sleep(0.5)
    assert list_locks(backend, me=other)[0].stale is not None
    lock.release()


def test_unreadable_lock_object_is_respected(backend: PosixFsBackend) -> None:
    backend.create(f"{LOCK_PREFIX}{'b' * 32}", b"garbage")
    with pytest.raises(LockError, match="unreadable lock object"):
        lock_exclusive(backend, settle=0)


def test_exclusive_race_never_two_holders(backend: PosixFsBackend) -> None:
    """Many threads hammer exclusive + shared acquisition with no settle delay: the
    write-then-re-list protocol must never let an exclusive holder overlap anyone."""
    state = {"exclusive": 0, "shared": 0, "violations": 0, "ex_ok": 0, "sh_ok": 0}
    mutex = threading.Lock()
    stop = time.monotonic() + 2.0

    def worker(kind: LockKind) -> None:
        while time.monotonic() < stop:
            try:
                lock = acquire(backend, kind, refresh_interval=None, settle=0)
            except LockError:
                continue
            with mutex:
                state[kind.value] += 1
                if state["exclusive"] > 1 or (state["exclusive"] and state["shared"]):
                    state["violations"] += 1
                state["ex_ok" if kind is LockKind.EXCLUSIVE else "sh_ok"] += 1
            time.sleep(0.002)
            with mutex:
                state[kind.value] -= 1
            lock.release()

    threads = [threading.Thread(target=worker, args=(k,)) for k in
               (LockKind.EXCLUSIVE, LockKind.EXCLUSIVE, LockKind.EXCLUSIVE, LockKind.SHARED, LockKind.SHARED)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["violations"] == 0
    assert state["ex_ok"] > 0 and state["sh_ok"] > 0
    assert list(backend.list(LOCK_PREFIX)) == []


@settings(max_examples=50, deadline=None)
@given(kind=st.sampled_from(LockKind), host=st.text(max_size=30), pid=st.integers(0, 2**31),
       ticks=st.none() | st.integers(0, 2**40), t=st.floats(0, 2e9), timeout=st.floats(0.1, 1e6),
       purpose=st.text(max_size=50))
def test_lock_info_roundtrip(kind: LockKind, host: str, pid: int, ticks: int | None, t: float,
                             timeout: float, purpose: str) -> None:
    info = LockInfo(kind=kind, host=host, pid=pid, start_ticks=ticks, boot_id="b", created=t, refreshed=t,
                    timeout=timeout, purpose=purpose, key="locks/x")
    assert LockInfo.decode("locks/x", info.encode()) == info


@pytest.mark.parametrize("raw", [b"", b"{}", b"[1]", b'{"format": 2}', b'{"format": 1, "kind": "weird"}'])
def test_lock_info_rejects_garbage(raw: bytes) -> None:
    with pytest.raises(CorruptData):
        LockInfo.decode("locks/x", raw)


def test_writer_lock_hook_waits_for_gc(backend: PosixFsBackend) -> None:
    """``shared_lock`` is what Repository.writer_lock() uses: it waits out a running gc."""
    from aenv_store.repository.locks import shared_lock

    gc = lock_exclusive(backend, purpose="gc", settle=0)
    threading.Timer(0.3, gc.release).start()
    with shared_lock(backend, "workspace-test", wait=5.0) as lock:
        assert lock.kind is LockKind.SHARED and lock.info.purpose == "workspace-test"
        with pytest.raises(LockError):
            lock_exclusive(backend, settle=0)
    assert list(backend.list(LOCK_PREFIX)) == []
    with lock_exclusive(backend, settle=0):
        with pytest.raises(LockError):
            shared_lock(backend, "w", wait=0.2)


def test_cli_unlock_removes_only_stale_locks(repo, aenv) -> None:  # type: ignore[no-untyped-def]
    backend = PosixFsBackend(repo.path)
    live = lock_shared(backend, purpose="busy writer")  # (acquiring would itself clear stale locks)
    stale = _foreign_lock(backend, LockKind.EXCLUSIVE, refreshed_ago=7200, timeout=60, name="1" * 32)
    os.utime(backend._path(stale), (time.time() - 7200, time.time() - 7200))
    try:
        r = aenv(repo.data_dir, "repo", "unlock")
        assert r.rc == 0, r.err
        assert "1 lock(s) removed" in r.out and "kept live" in r.out and "busy writer" in r.out
        assert [e.key for e in list_locks(backend)] == [live.key]
        r = aenv(repo.data_dir, "repo", "unlock", "--remove-all")
        assert r.rc == 0 and list_locks(backend) == []
        assert live.lost or not backend.exists(live.key)
    finally:
        live.release()
