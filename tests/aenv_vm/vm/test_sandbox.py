"""Templates and sandboxes end to end: build a template from the guest (root
disk over aenv's NBD server), restore sandboxes from it, drive them with the
real e2b SDK pointed straight at each sandbox's envd."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv_store.config import CacheConfig, RepositoryConfig, StoreConfig, StorePaths, StoreSettings
from aenv_store.formats.catalog import CatalogRecord
from aenv_store.store import Store
from aenv_vm.blockimage.prefetch import Prefetcher
from aenv_vm.envd_client import EnvdError
from aenv_vm.errors import NotFound, VmError
from aenv_vm.guest import GuestImage
from aenv_vm.sandboxes.manager import SandboxManager
from aenv_vm.templates.base import build_template
from aenv_vm.templates.template import DEVICE_STATE, TEMPLATE_KIND, Template, find_template, list_templates

pytestmark = pytest.mark.qemu


@dataclass(frozen=True)
class Built:
    store: Store
    template: Template
    seconds: float


@pytest.fixture(scope="module")
def built(guest: GuestImage, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("tplstore")
    settings = StoreSettings(paths=StorePaths(d / "data"), repository=RepositoryConfig(), store=StoreConfig(),
                             cache=CacheConfig(capacity=4 << 30, min_free_disk=0))
    store = Store.open(settings, create=True)
    try:
        t0 = time.monotonic()
        tpl = asyncio.run(build_template(store, guest, d / "work", alias="base", memory_mib=256))
        seconds = time.monotonic() - t0
        print(f"\n[vm] template build (import + NBD cold boot + snapshot + commit) {seconds:.1f} s")
        assert sorted(os.listdir(d / "work")) == []  # build leftovers removed
        yield Built(store, tpl, seconds)
    finally:
        store.close()


def test_template_is_addressable_by_id_and_alias(built: Built) -> None:
    assert find_template(built.store, "base") == built.template
    assert find_template(built.store, built.template.id) == built.template
    assert [(t.id, aliases) for t, aliases in list_templates(built.store)] == [(built.template.id, ["base"])]
    with pytest.raises(NotFound, match="unknown template"):
        find_template(built.store, "no-such-template")


def test_three_sandboxes_from_one_template(guest: GuestImage, built: Built, tmp_path: Path) -> None:
    from e2b import Sandbox as E2BSandbox

    async def run() -> None:
        async with SandboxManager(built.store, guest, tmp_path / "node") as mgr:
            sbxs = [await mgr.create("base", env_vars={"AENV_TEST": "yes"}) for _ in range(3)]
            for s in sbxs:
                assert s.timing is not None
                # every sandbox disk reads ahead of sequential guest reads ([vm] readahead_mib)
                assert [type(o) for o in s.image.observers] == [Prefetcher]
                print(f"\n[vm] create (no pool): QEMU start {s.timing.qemu_start * 1000:.0f} ms, state load "
                      f"{s.timing.state_load * 1000:.0f} ms, first answer {s.timing.first_answer * 1000:.0f} ms, "
                      f"identity {s.timing.identity * 1000:.0f} ms, /init {s.timing.init * 1000:.0f} ms, total {s.timing.total * 1000:.0f} ms")

            def check() -> None:
                clients = [E2BSandbox.create(debug=True, sandbox_url=s.envd_url, api_key="test") for s in sbxs]
                randoms: list[str] = []
                for i, c in enumerate(clients):
                    release = c.commands.run("uname -r").stdout.strip()
                    assert release == guest.kernel_release and release != os.uname().release
                    assert c.commands.run("echo $AENV_TEST").stdout.strip() == "yes"
                    assert c.commands.run("hostname").stdout.strip() == sbxs[i].id  # own identity
                    if i == 0:  # /etc/profile's root test (bash's $EUID, no `id` fork) per user
                        assert "/usr/sbin" in c.commands.run("echo $PATH", user="root").stdout.split(":")
                        assert "/usr/sbin" not in c.commands.run("echo $PATH", user="user").stdout.split(":")
                    randoms.append(c.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout)
                    c.files.write(f"/home/user/only-in-{i}", f"sandbox {i}")
                # Clones share the template's RNG state: only /init's entropy + reseed separates them.
                assert len(set(randoms)) == 3, randoms
                for i, c in enumerate(clients):
                    assert c.files.read(f"/home/user/only-in-{i}") == f"sandbox {i}"
                    others = [j for j in range(3) if j != i]
                    assert not any(c.files.exists(f"/home/user/only-in-{j}") for j in others)
                    assert "envd" in c.commands.run("ps -eo args").stdout

            await asyncio.to_thread(check)
            dirs = [s.dir for s in sbxs]
            for s in sbxs:
                await mgr.kill(s.id)
            assert not any(d.exists() for d in dirs)
        assert not (tmp_path / "node" / "nbd.sock").exists()
        assert not (tmp_path / "node" / "sandboxes").exists()

    asyncio.run(run())


def test_failed_creates_leave_nothing_behind(guest: GuestImage, built: Built, tmp_path: Path,
                                             qemu_children) -> None:  # type: ignore[no-untyped-def]
    tpl = built.template
    with built.store.workspace() as ws:
        w = ws.blob_writer(DEVICE_STATE, size=70_000)
        w.write(0, b"QEVM" + os.urandom(69_996))
        garbage = w.close()
        ws.commit(CatalogRecord(name="tpl-corrupt0", kind=TEMPLATE_KIND,
                                manifests=(("disk", tpl.disk), ("memory", tpl.memory), ("state", garbage)),
                                meta=(("accel", tpl.accel), ("guest_key", tpl.guest_key),
                                      ("kernel_cmdline", tpl.kernel_cmdline), ("memory_mib", str(tpl.memory_mib)),
                                      ("vcpus", str(tpl.vcpus)))))

    async def run() -> None:
        async with SandboxManager(built.store, guest, tmp_path / "node") as mgr:
            with pytest.raises(NotFound, match="unknown template"):
                await mgr.create("nope")
            with pytest.raises(VmError, match="exited while loading"):
                await mgr.create("tpl-corrupt0")
            assert mgr.sandboxes == {}
            assert os.listdir(tmp_path / "node" / "sandboxes") == []

            # QEMU dying mid-create (killed as soon as it exists).
            task = asyncio.create_task(mgr.create("base"))
            deadline = time.monotonic() + 30
            while not (pids := qemu_children()) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert pids, "no QEMU appeared"
            os.kill(pids[0], signal.SIGKILL)
            with pytest.raises(VmError):
                await task
            assert mgr.sandboxes == {}
            assert os.listdir(tmp_path / "node" / "sandboxes") == []

            # QEMU missing.
            os.environ["AENV_QEMU_BINARY"] = "qemu-system-missing"
            try:
                with pytest.raises(VmError, match="qemu-system-missing not found"):
                    await mgr.create("base")
            finally:
                del os.environ["AENV_QEMU_BINARY"]
            assert os.listdir(tmp_path / "node" / "sandboxes") == []

    asyncio.run(run())


def test_warm_pool_hands_out_ready_sandboxes(guest: GuestImage, built: Built, tmp_path: Path) -> None:
    async def run() -> None:
        async with SandboxManager(built.store, guest, tmp_path / "node", pool_size=1) as mgr:
            await mgr.fill_pool("base")
            [waiting] = mgr.pooled("base")
            # warmed (SDK command path + file I/O ran) at nice 10, then back to 0 to wait
            assert os.getpriority(os.PRIO_PROCESS, waiting.vm.pid) == 0
            assert waiting.timing is not None and waiting.timing.warm > 0
            assert waiting.serial_log.exists()
            # until it is handed out, the clone's envd answers nobody without its own secret:
            # not without a token, not with the template's secret
            secret = built.store.get_record(built.template.id).meta_dict()["envd_token"]
            assert waiting.guest_token and waiting.guest_token != secret
            for token in (None, secret):
                with pytest.raises(EnvdError, match="401"):
                    await waiting.envd.with_token(token).run("true", user="root")
            with pytest.raises(EnvdError, match="401"):
                await waiting.envd.write_file("/home/user/.profile", b"evil")
            assert (await waiting.envd.with_token(waiting.guest_token).run("true")).exit_code == 0
            s = await mgr.create("base")
            assert s.id == waiting.id
            assert s.timing is not None and s.timing.from_pool
            assert os.getpriority(os.PRIO_PROCESS, s.vm.pid) == 0  # handed out: normal priority again
            print(f"\n[vm] create from warm pool: total {s.timing.total * 1000:.0f} ms (/init "
                  f"{s.timing.init * 1000:.0f} ms)")
            from e2b import Sandbox as E2BSandbox

            def check() -> None:
                c = E2BSandbox.create(debug=True, sandbox_url=s.envd_url, api_key="test")
                assert c.commands.run("hostname").stdout.strip() == s.id
                assert c.commands.run("ls -A /tmp").stdout.strip() == ""  # warm-up left no file
            await asyncio.to_thread(check)
            await mgr.kill(s.id)

    asyncio.run(run())


def _ksm_kib_outside_guest_ram(pid: int) -> int:
    """KSM-merged KiB of a QEMU outside its guest RAM mapping (heap, TCG tables, ...). The
    RAM mapping is the file QEMU's memory backend names (``mem-path=``): a local memory
    file, or the lazy-memory mount's file on a node that does not hold the image."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    mem_path = next(part.split("mem-path=", 1)[1].split(",", 1)[0]
                    for part in (a.decode(errors="replace") for a in args) if "mem-path=" in part)
    total, guest_ram = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            guest_ram = len(fields) > 5 and fields[5] == mem_path
        elif line.startswith("KSM:") and not guest_ram:
            total += int(fields[1])
    return total


def test_ksm_whole_qemu(guest: GuestImage, built: Built, tmp_path: Path) -> None:
    """With [vm] ksm every clone's QEMU is mergeable as a whole, with a fixed layout, and
    ksmd merges pages beyond guest RAM; without it QEMU keeps its own defaults."""
    from aenv_vm import ksm

    if not (ksm.available() and ksm.process_merge_supported()):
        if os.environ.get("CI"):
            pytest.fail("KSM with PR_SET_MEMORY_MERGE is required in CI (Linux >= 6.4)")
        pytest.skip("no KSM / PR_SET_MEMORY_MERGE in this kernel")

    async def run() -> None:
        settings = ksm.KsmSettings(pages_to_scan=4000, sleep_ms=10)   # fast, for the test only
        async with SandboxManager(built.store, guest, tmp_path / "ksm", ksm=settings) as mgr, \
                SandboxManager(built.store, guest, tmp_path / "plain") as plain:
            a, b = await mgr.create("base"), await mgr.create("base")
            c = await plain.create("base")
            assert ksm.read_stats() is not None and ksm.read_stats().run == 1   # type: ignore[union-attr]
            heaps = []
            for s in (a, b):
                assert "ksm_merge_any: yes" in Path(f"/proc/{s.vm.pid}/ksm_stat").read_text()
                assert int(Path(f"/proc/{s.vm.pid}/personality").read_text(), 16) & ksm.ADDR_NO_RANDOMIZE
                heaps += [ln.split("-")[0] for ln in Path(f"/proc/{s.vm.pid}/maps").read_text().splitlines()
                          if ln.endswith("[heap]")]
            assert len(heaps) == 2 and heaps[0] == heaps[1]   # same layout in both clones
            assert "ksm_merge_any: no" in Path(f"/proc/{c.vm.pid}/ksm_stat").read_text()
            assert not int(Path(f"/proc/{c.vm.pid}/personality").read_text(), 16) & ksm.ADDR_NO_RANDOMIZE
            # pages merge on the second scan that finds them unchanged; a clone still warming
            # up under load (the suite's other worker) changes its pages for longer: more
            # scans, never a smaller bound
            for _ in range(6):
                assert await ksm.wait_full_scans(2, timeout=120) >= 2
                merged = [_ksm_kib_outside_guest_ram(s.vm.pid) for s in (a, b, c)]
                if min(merged[:2]) >= 1024:
                    break
            print(f"\n[vm] KSM-merged KiB outside guest RAM: clones {merged[:2]}, plain QEMU {merged[2]}")
            # QEMU itself marks only its RAM blocks mergeable (a few ROM pages beside guest RAM)
            assert min(merged[:2]) >= 1024 and merged[2] < 512
            for s in (a, b):
                await mgr.kill(s.id)
            await plain.kill(c.id)

    with ksm.knobs_restored():
        asyncio.run(run())
