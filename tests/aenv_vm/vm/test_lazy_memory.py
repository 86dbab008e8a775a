"""Cold-node restores with lazy memory (aenv_vm/memory/lazyfs.py): a second node, whose
data dir and node cache are empty but whose repository is the first node's (posix_fs),
creates sandboxes from a snapshot the first node made. The memory image is served page
by page through FUSE; the VM runs on exactly the memory it had (a process and its
value, a file in /dev/shm), having fetched less than the image before its first
answer. A corrupted chunk stops the restore with a clear error; mounts never outlive
their node, and a crashed node's stale mount is cleaned at the next start."""
from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_store.store import Store
from aenv_vm.guest import GuestImage
from aenv_vm.memory import workingset
from aenv_vm.memory.lazyfs import LazyMemoryError, mounts_under
from aenv_vm.sandboxes.manager import SandboxManager
from aenv_vm.sandboxes.sandbox import Sandbox
from aenv_vm.templates.template import Template, find_template
from tests.seed import BaseSeed

pytestmark = pytest.mark.qemu

SECRET = "lazy-7f3a9c"


def node_settings(data: Path, repo: Path) -> StoreSettings:
    return StoreSettings(paths=StorePaths(data), repository=RepositoryConfig(path=str(repo)), store=StoreConfig(),
                         cache=CacheConfig(capacity=4 << 30, min_free_disk=0))


@dataclass(frozen=True)
class Made:
    """What node A left in the shared repository: a snapshot and what its guest held."""
    root: Path
    repo: Path
    snapshot: Template
    shm_sha: str


def run(sbx: Sandbox, cmd: str, timeout: float = 60.0) -> str:
    from e2b import Sandbox as E2BSandbox
    c = E2BSandbox.create(debug=True, sandbox_url=sbx.envd_url, api_key="test")
    r = c.commands.run(cmd, timeout=timeout)
    assert r.exit_code == 0, (cmd, r.stderr)
    return r.stdout


@pytest.fixture(scope="module")
def made(guest: GuestImage, tmp_path_factory: pytest.TempPathFactory, base_seed: BaseSeed):  # type: ignore[no-untyped-def]
    """Node A: the run's ``base`` (tests/seed.py), a sandbox that fills /dev/shm and runs a
    process holding a value, a named snapshot of it committed to the shared repository."""
    root = tmp_path_factory.mktemp("lazymem")
    repo = root / "repo"
    base_seed.copy_repository(repo)
    store = Store.open(node_settings(root / "a", repo))
    try:

        async def make() -> tuple[Template, str]:
            async with SandboxManager(store, guest, root / "run-a") as mgr:
                sbx = await mgr.create("base")
                out = await asyncio.to_thread(run, sbx, (
                    "head -c 48M /dev/urandom > /dev/shm/blob && "
                    f"(setsid bash -c 'v={SECRET}; while :; do echo $v-$$ > /dev/shm/beat; sleep 0.1; done' "
                    ">/dev/null 2>&1 < /dev/null &) && sleep 0.3 && sha256sum /dev/shm/blob"))
                sid, _, _ = await mgr.snapshot(sbx.id, "lazy-src")
                await mgr.kill(sbx.id)
                return find_template(store, sid), out.split()[0]
        snap, sha = asyncio.run(make())
        yield Made(root, repo, snap, sha)
    finally:
        store.close()


def cold_store(made: Made, name: str) -> Store:
    return Store.open(node_settings(made.root / name, made.repo))


def check(s: Sandbox, made: Made) -> None:
    # the process from before the snapshot runs on with the value it held in memory
    beat = run(s, "rm -f /dev/shm/beat; sleep 0.5; cat /dev/shm/beat").strip()
    assert beat.startswith(SECRET + "-"), beat
    assert run(s, "sha256sum /dev/shm/blob").split()[0] == made.shm_sha


def test_cold_node_restores_a_snapshot_made_elsewhere(guest: GuestImage, made: Made) -> None:
    store = cold_store(made, "b")
    run_root = made.root / "run-b"
    image_size = made.snapshot.memory_mib << 20

    async def go() -> None:
        async with SandboxManager(store, guest, run_root) as mgr:
            assert store.cache is not None and store.cache.stats().entries == 0   # a node that never saw it
            assert workingset.load(store, made.snapshot.memory) is None           # nobody restored it yet
            assert mounts_under(run_root / "lazymem")                             # the mount is up
            sbx = await mgr.create(made.snapshot.id)
            img = mgr.rt.templates.lazy_image(sbx.vm.spec.mem_path)
            assert img is not None, "the cold restore did not take the lazy path"
            fetched_first = img.fetched_bytes
            # the QEMU that faulted those pages in is a confined one (its own uid), answered as such
            status = Path(f"/proc/{sbx.vm.pid}/status").read_text().splitlines()
            uid = int(next(line for line in status if line.startswith("Uid:")).split()[1])
            jail = mgr.rt.confinement.jail(sbx.id)
            if jail is not None and jail.uid is not None:
                assert uid == jail.uid and uid in mgr.rt.confinement.qemu_uids()
            print(f"[lazymem] QEMU uid {uid} ({'confined' if uid else 'root'})")
            assert mgr.rt.templates.lazy is not None and mgr.rt.templates.lazy.denied == 0
            print(f"\n[lazymem] cold create: fetched {fetched_first >> 20} MiB of memory before the first answer "
                  f"(image {image_size >> 20} MiB, {img.manifest.stored_bytes() >> 20} MiB stored, "
                  f"{img.reads} reads)")
            assert 0 < fetched_first < image_size
            assert fetched_first < img.manifest.stored_bytes()
            assert not (mgr.rt.templates.dir(made.snapshot.id) / "memory").exists()   # nothing assembled

            await asyncio.to_thread(check, sbx, made)

            # a second sandbox of that snapshot maps the same file: shared page cache, little more fetched
            before = img.fetched_bytes
            sbx2 = await mgr.create(made.snapshot.id)
            assert sbx2.vm.spec.mem_path == sbx.vm.spec.mem_path
            print(f"[lazymem] second create on the node fetched {(img.fetched_bytes - before) >> 20} MiB more")
            await asyncio.to_thread(check, sbx2, made)

            # pause and resume over the lazy base keeps everything too
            await mgr.pause(sbx2.id)
            sbx3 = await mgr.resume(sbx2.id)
            await asyncio.to_thread(check, sbx3, made)
        assert mounts_under(run_root / "lazymem") == []     # unmounted with the node
        # node B recorded what its first restore touched: the next cold node prefetches it
        ws = workingset.load(store, made.snapshot.memory)
        assert ws is not None and 0 < len(ws.units) * ws.unit < image_size

        store_e = cold_store(made, "e")
        try:
            async with SandboxManager(store_e, guest, made.root / "run-e") as mgr:
                sbx = await mgr.create(made.snapshot.id)
                img = mgr.rt.templates.lazy_image(sbx.vm.spec.mem_path)
                assert img is not None
                await asyncio.to_thread(check, sbx, made)
                print(f"[lazymem] cold create with the recorded working set ({len(ws.units) * ws.unit >> 20} MiB): "
                      f"{img.filled_bytes >> 20} MiB put in the page cache ahead, {img.reads} reads")
                assert img.filled_bytes > 0
        finally:
            store_e.close()
    try:
        asyncio.run(go())
    finally:
        store.close()


def _corrupt_memory_chunks(store: Store, tpl: Template) -> list[tuple[Path, int, bytes]]:
    """Flip a byte inside every stored chunk of the template's memory image (posix_fs
    packs); returns what to put back."""
    repo = store.repository
    undo = []
    for cid in dict.fromkeys(store.load_manifest(tpl.memory).chunks):
        entry = repo.lookup(cid)
        assert entry is not None
        path = next(Path(store.settings.repository.path).rglob(entry.pack.hex()))
        pos = entry.offset + entry.length // 2
        with open(path, "r+b") as f:
            f.seek(pos)
            old = f.read(1)
            f.seek(pos)
            f.write(bytes([old[0] ^ 0xFF]))
        undo.append((path, pos, old))
    return undo


def test_corrupted_chunk_is_a_clear_error_not_a_running_guest(guest: GuestImage, made: Made) -> None:
    store = cold_store(made, "c")
    undo = _corrupt_memory_chunks(store, made.snapshot)
    run_root = made.root / "run-c"

    async def go() -> None:
        async with SandboxManager(store, guest, run_root) as mgr:
            with pytest.raises(LazyMemoryError, match=r"cannot run: memory image .* (does not match|corrupt|pack)"):
                await mgr.create(made.snapshot.id)
        assert mounts_under(run_root / "lazymem") == []
    try:
        asyncio.run(go())
    finally:
        for path, pos, old in undo:
            with open(path, "r+b") as f:
                f.seek(pos)
                f.write(old)
        store.close()


_CRASHER = """
import sys, time
from pathlib import Path
from aenv_store.store import Store
from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_vm.memory.lazyfs import MemoryFs
s = Store.open(StoreSettings(paths=StorePaths(Path(sys.argv[1])), repository=RepositoryConfig(path=sys.argv[2]),
               store=StoreConfig(), cache=CacheConfig(capacity=1 << 30, min_free_disk=0)))
fs = MemoryFs(s, Path(sys.argv[3]), lambda uid: uid == 0)
fs.mount()
print("mounted", flush=True)
time.sleep(600)
"""


def test_stale_mount_of_a_crashed_node_is_cleaned_and_guests_uids_are_kept_out(guest: GuestImage,
                                                                              made: Made) -> None:
    run_root = made.root / "run-d"
    mnt = run_root / "lazymem" / "mnt"
    tree = str(Path(__file__).resolve().parents[3])
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, str(made.root / "d0"), str(made.repo), str(mnt)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": tree})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "mounted"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert [m.point for m in mounts_under(mnt)] == [mnt]          # the crashed node left its mount

    store = cold_store(made, "d")

    async def go() -> None:
        async with SandboxManager(store, guest, run_root) as mgr:
            assert len(mounts_under(mnt)) == 1                     # the stale one gone, a live one in its place
            assert (os.stat(mnt.parent).st_mode & 0o777) == 0o700   # no other host user reaches it
            lazy = mgr.rt.templates.lazy
            assert lazy is not None
            path = lazy.expose(store.load_manifest(made.snapshot.memory))
            await asyncio.to_thread(_try_other_uid, mnt, path.name)
            await asyncio.to_thread(_try_writes, path)
            assert lazy.denied >= 1
        assert mounts_under(mnt) == []
    try:
        asyncio.run(go())
    finally:
        store.close()


def _try_other_uid(mnt: Path, name: str) -> None:
    """A uid that is neither the node's nor one of its QEMUs' is refused even when it holds
    a descriptor of the mount's directory (the 0700 parent is the first wall)."""
    code = ("import os,sys; d=os.open(sys.argv[1], os.O_RDONLY|os.O_DIRECTORY); os.setgid(54321); os.setuid(54321)\n"
            "try:\n    os.open(sys.argv[2], os.O_RDONLY, dir_fd=d); print('opened')\n"
            "except OSError as e: print(e.errno)\n"
            "try:\n    os.stat(sys.argv[3]); print('reached')\n"
            "except OSError as e: print(e.errno)\n")
    out = subprocess.run([sys.executable, "-c", code, str(mnt), name, str(mnt / name)], capture_output=True,
                         text=True, timeout=30)
    assert out.stdout.split() == [str(errno.EACCES), str(errno.EACCES)], out


def _try_writes(path: Path) -> None:
    """Nobody, root included, changes an image: every write is EROFS."""
    with open(path, "r+b", buffering=0) as f:
        with pytest.raises(OSError) as e:
            f.write(b"x")
        assert e.value.errno == errno.EROFS
        with pytest.raises(OSError) as e:
            os.ftruncate(f.fileno(), 0)
        assert e.value.errno == errno.EROFS
        assert len(os.pread(f.fileno(), 4096, 0)) == 4096    # reads work (pread drops the GIL)
