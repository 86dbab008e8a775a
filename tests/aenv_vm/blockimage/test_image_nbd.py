"""Block images served over NBD to real clients (qemu-img, qemu-io), bad
clients next to good ones, lazy fetch from a repository-only image, import of
a directory tree, read-ahead, the `aenv image` CLI, and pipelined
random operations through NBD against a byte model."""
from __future__ import annotations

import asyncio
import itertools
import os
import random
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_cli.main import main as aenv_main
from aenv_store.store import Store
from aenv_vm.blockimage import nbd_protocol as P
from aenv_vm.blockimage.image import BlockImage
from aenv_vm.blockimage.importer import export_raw, import_raw, import_tree
from aenv_vm.blockimage.layer import image_top
from aenv_vm.blockimage.nbd_client import NbdClient
from aenv_vm.blockimage.nbd_server import BackgroundNbdServer
from aenv_vm.blockimage.prefetch import Prefetcher

from .conftest import store_settings

MiB = 1 << 20
CHUNK = 64 * 1024
_pipe_names = itertools.count()


def _disk(path: Path, size: int = 4 * MiB, seed: int = 1) -> bytes:
    rnd = random.Random(seed)
    data = bytearray(rnd.randbytes(size))
    data[MiB:2 * MiB] = bytes(MiB)              # a zero region (skipped at import)
    if size > 3 * MiB + 5000:
        data[3 * MiB + 100:3 * MiB + 5000] = bytes(4900)
    path.write_bytes(data)
    return bytes(data)


def _url(sock: Path, name: str) -> str:
    return f"nbd+unix:///{name}?socket={sock}"


def test_qemu_convert_write_compare_commit_reopen(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src.raw"
    data = _disk(src)
    top = import_raw(store, src, "base").layer_id
    sock = tmp_path / "nbd.sock"
    img = BlockImage.open(store, top, "disk0", upper_dir=tmp_path / "upper")
    try:
        with BackgroundNbdServer(sock, [img]):
            out = tmp_path / "out.raw"
            subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", _url(sock, "disk0"), str(out)],
                           check=True, timeout=120)
            subprocess.run(["cmp", str(src), str(out)], check=True)
            # writes through the export: unaligned, multi-block, zeroes, discard
            expected = bytearray(data)
            cmds = ["write -P 0x5a 1000 20000", "write -z 3145728 65536", "write -P 0x11 4193000 576",
                    "discard 262144 131072", "flush"]
            subprocess.run(["qemu-io", "-f", "raw", *sum((["-c", c] for c in cmds), []), _url(sock, "disk0")],
                           check=True, timeout=120, capture_output=True)
            expected[1000:21000] = b"\x5a" * 20000
            expected[3 * MiB:3 * MiB + 65536] = bytes(65536)
            expected[4193000:4193576] = b"\x11" * 576
            expected[262144:393216] = bytes(131072)
            exp = tmp_path / "expected.raw"
            exp.write_bytes(expected)
            subprocess.run(["qemu-img", "compare", "-f", "raw", "-F", "raw", _url(sock, "disk0"), str(exp)],
                           check=True, timeout=120, capture_output=True)
            info = img.commit("disk0-snap")
            assert info.layer.parent == top
            assert info.data_bytes <= 20000 + 2 * 4096 + 4096
    finally:
        img.close()
    # reopen the committed image (fresh upper) and serve it again
    top2 = image_top(store.get_record("disk0-snap"))
    with BlockImage.open(store, top2, "disk0", upper_dir=tmp_path / "upper2") as img2:
        with BackgroundNbdServer(sock, [img2]):
            subprocess.run(["qemu-img", "compare", "-f", "raw", "-F", "raw", _url(sock, "disk0"), str(exp)],
                           check=True, timeout=120, capture_output=True)
    out2 = tmp_path / "flat.raw"
    assert export_raw(store, top2, out2) == len(data)
    assert out2.read_bytes() == bytes(expected)


def test_bad_clients_next_to_image_exports(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src.raw"
    data = _disk(src, 2 * MiB)
    top = import_raw(store, src, "base").layer_id
    a = BlockImage.open(store, top, "a", upper_dir=tmp_path / "ua")
    b = BlockImage.open(store, top, "b")                     # read-only export
    sock = tmp_path / "nbd.sock"
    try:
        with BackgroundNbdServer(sock, [a, b]) as srv:
            # a client that sends garbage after the greeting, one that vanishes mid-request
            for junk in (b"\x00" * 4, struct.pack(">I", 1) + b"\xff" * 40):
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(sock))
                s.recv(18)
                s.sendall(junk)
                s.settimeout(5)
                assert s.recv(4096) == b""          # closed: that client only
                s.close()

            async def go() -> None:
                ca = await NbdClient.connect(str(sock), "a")
                cb = await NbdClient.connect(str(sock), "b")
                assert cb.flags & P.TF_READ_ONLY and not ca.flags & P.TF_READ_ONLY
                with pytest.raises(Exception) as ei:
                    await cb.write(0, b"nope")
                assert getattr(ei.value, "errno", None) == P.EPERM
                with pytest.raises(Exception) as ei:
                    await ca.read(len(data) - 512, 1024)
                assert getattr(ei.value, "errno", None) == P.EINVAL
                with pytest.raises(Exception) as ei:
                    await ca.read(0, 64 * MiB)
                assert getattr(ei.value, "errno", None) == P.EINVAL
                # abrupt disconnect of a third client with 16 reads in flight
                cc = await NbdClient.connect(str(sock), "a")
                futs = [cc._submit(P.Cmd.READ, i * CHUNK, CHUNK, reply_len=CHUNK) for i in range(16)]
                cc._w.transport.abort()
                await asyncio.gather(*futs, return_exceptions=True)
                # queue depth 16 on both good exports at once, all correct
                offs = [random.Random(i).randrange(0, len(data) - 4096) for i in range(16)]
                ra, rb = await asyncio.gather(asyncio.gather(*(ca.read(o, 4096) for o in offs)),
                                              asyncio.gather(*(cb.read(o, 4096) for o in offs)))
                assert ra == rb == [data[o:o + 4096] for o in offs]
                await ca.write(7, b"still-here", fua=True)
                assert await ca.read(0, 32) == data[:7] + b"still-here" + data[17:32]
                await ca.close()
                await cb.close()
            asyncio.run(go())
            for _ in range(200):
                if srv.server.connection_count == 0:
                    break
                time.sleep(0.01)
            assert srv.server.connection_count == 0
    finally:
        a.close()
        b.close()


def test_lazy_fetch_only_touched_chunks(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    src = tmp_path / "src.raw"
    data = _disk(src, 8 * MiB)
    with Store.open(store_settings(tmp_path / "builder", repo=repo), create=True) as builder:
        top = import_raw(builder, src, "base").layer_id
    # a fresh node: same repository, empty node cache
    with Store.open(store_settings(tmp_path / "node", repo=repo)) as node:
        assert node.cache.stats().entries == 0
        # count every chunk the node reads from the repository (single and batched reads)
        fetched: list[bytes] = []
        repository = node.repository
        read_chunk, read_run = repository.read_chunk, repository.read_run

        def counting_read_chunk(chunk, *a, **k):  # type: ignore[no-untyped-def]
            fetched.append(bytes(chunk))
            return read_chunk(chunk, *a, **k)

        def counting_read_run(run, *a, **k):  # type: ignore[no-untyped-def]
            fetched.extend(bytes(e.chunk) for e in run)
            return read_run(run, *a, **k)

        repository.read_chunk = counting_read_chunk  # type: ignore[method-assign]
        repository.read_run = counting_read_run  # type: ignore[method-assign]
        with BlockImage.open(node, top, "lazy") as img:
            ranges = [(0, 100), (5000, 4096), (CHUNK - 10, 20), (MiB + 7, 300),   # zero region: no fetch
                      (5 * MiB + 3, 3 * CHUNK)]
            for off, n in ranges:
                assert img.read(off, n) == data[off:off + n]
            touched = set()
            for off, n in ranges:
                touched |= set(img.extent_map.chunks_in(off, n))
            # chunk 0 (twice), chunk 1 boundary: 0 and 1, zero region: none, 5 MiB: 4 chunks
            assert len(touched) == 6
            assert sorted(fetched) == sorted(bytes(c) for c in touched)    # each touched chunk once
            st = node.cache.stats()
            assert st.entries == len(touched)
            assert st.pinned == len(touched)             # pinned while open
            assert img.read(0, 100) == data[:100]
            img.memory.clear()
            assert img.read(5 * MiB + 3, 3 * CHUNK) == data[5 * MiB + 3:5 * MiB + 3 + 3 * CHUNK]
            assert len(fetched) == len(touched)          # later reads: memory / node cache
        assert node.cache.stats().pinned == 0            # unpinned on close


def test_images_on_one_stack_share_its_map_and_one_set_of_pins(tmp_path: Path) -> None:
    """The hundredth sandbox of a template neither rebuilds the stack's map nor pins its
    chunks again: images on one stack share the map and one pin of each chunk, held
    until the last of them closes; a commit's new chunks are pinned by their image."""
    src = tmp_path / "src.raw"
    data = _disk(src, 4 * MiB)
    with Store.open(store_settings(tmp_path / "node"), create=True) as node:
        top = import_raw(node, src, "base").layer_id
        assert node.load_manifest(top) is node.load_manifest(top)      # decoded once
        a = BlockImage.open(node, top, "a", upper_dir=tmp_path / "ua")
        b = BlockImage.open(node, top, "b", upper_dir=tmp_path / "ub")
        chunks = a.extent_map.chunks()
        assert b.extent_map is a.extent_map and chunks
        assert node.cache is not None
        held = node.cache.pins_held
        assert all(held(c) == 1 for c in chunks)           # one pin for both images
        b.write(0, b"\x01" * 4096)
        b.commit("b-1")
        fresh = b.extent_map.chunks() - chunks
        assert fresh and all(held(c) == 1 for c in fresh)
        b.close()
        assert all(held(c) == 1 for c in chunks)           # a still reads them
        assert not any(held(c) for c in fresh)             # b's own went with it
        assert a.read(0, 4096) == data[:4096]
        a.close()
        assert not any(held(c) for c in chunks)


def test_readahead_fetches_ahead_of_sequential_reads(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    src = tmp_path / "src.raw"
    data = _disk(src, 8 * MiB)
    with Store.open(store_settings(tmp_path / "builder", repo=repo), create=True) as builder:
        top = import_raw(builder, src, "base").layer_id
    with Store.open(store_settings(tmp_path / "n2", repo=repo)) as node:
        with BlockImage.open(node, top, "readahead") as img:
            pf = Prefetcher(img)
            img.read(6 * MiB, CHUNK)                        # a lone read: nothing ahead of it
            pf.wait_idle()
            assert img.read_nowait(6 * MiB + CHUNK, CHUNK) is None and pf.fetched == 0
            # sequential reads trigger read-ahead of the following chunks
            for i in range(4):
                img.read(2 * MiB + i * CHUNK, CHUNK)
            pf.wait_idle()
            assert pf.fetched > 0
            assert img.read_nowait(2 * MiB + 10 * CHUNK, CHUNK) == data[2 * MiB + 10 * CHUNK:2 * MiB + 11 * CHUNK]


def test_import_tree_is_mountable_ext4(store: Store, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hostname").write_text("aenv\n")
    (tree / "big.bin").write_bytes(os.urandom(300_000))
    res = import_tree(store, tree, "rootfs", size=16 * MiB)
    assert res.size == 16 * MiB and res.data_bytes < 8 * MiB      # mostly zeros, skipped
    out = tmp_path / "rootfs.ext4"
    export_raw(store, res.layer_id, out)
    fsck = subprocess.run(["e2fsck", "-fn", str(out)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    listing = subprocess.run(["debugfs", "-R", "cat /etc/hostname", str(out)], capture_output=True, text=True)
    assert listing.stdout == "aenv\n"


def test_import_rounds_size_to_blocks(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "odd.raw"
    data = os.urandom(MiB + 4900)
    src.write_bytes(data)
    res = import_raw(store, src, "odd")
    assert res.size == MiB + 8192
    out = tmp_path / "out.raw"
    export_raw(store, res.layer_id, out)
    assert out.read_bytes() == data + bytes(8192 - 4900)


def test_cli_import_ls_inspect_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dd = tmp_path / "data"
    src = tmp_path / "src.raw"
    data = _disk(src, 2 * MiB)
    assert aenv_main(["--data-dir", str(dd), "image", "import", "--init", str(src), "img1"]) == 0
    assert "imported" in capsys.readouterr().out
    assert aenv_main(["--data-dir", str(dd), "image", "import", str(src), "img1"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert aenv_main(["--data-dir", str(dd), "image", "ls"]) == 0
    assert "img1" in capsys.readouterr().out
    assert aenv_main(["--data-dir", str(dd), "image", "inspect", "img1", "--json"]) == 0
    assert '"layers"' in capsys.readouterr().out
    out = tmp_path / "out.raw"
    assert aenv_main(["--data-dir", str(dd), "image", "export", "img1", str(out)]) == 0
    assert out.read_bytes() == data
    capsys.readouterr()
    assert aenv_main(["--data-dir", str(dd), "image", "export", "img1", str(tmp_path / "no-dir" / "x.raw")]) == 2
    assert "cannot write" in capsys.readouterr().err and not (tmp_path / "no-dir").exists()
    assert aenv_main(["--data-dir", str(dd), "image", "inspect", "nope"]) == 1
    assert "no image named" in capsys.readouterr().err
    assert aenv_main(["--data-dir", str(dd), "image", "import", str(tmp_path / "missing"), "x"]) == 2


def test_cli_serve_real_client(tmp_path: Path) -> None:
    """`aenv image serve` as its own process, read by qemu-img, stopped by SIGTERM."""
    import signal
    import sys
    dd = tmp_path / "data"
    src = tmp_path / "src.raw"
    _disk(src, 2 * MiB)
    assert aenv_main(["--data-dir", str(dd), "image", "import", "--init", str(src), "img1"]) == 0
    sock = tmp_path / "serve.sock"
    proc = subprocess.Popen([sys.executable, "-m", "aenv_cli.main", "--data-dir", str(dd), "image", "serve",
                             "img1", "--socket", str(sock)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert "serving img1" in (proc.stdout.readline() if proc.stdout else "")
        out = tmp_path / "out.raw"
        conv = subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", _url(sock, "img1"), str(out)],
                              timeout=60, capture_output=True, text=True)
        if conv.returncode:
            proc.send_signal(signal.SIGTERM)
            raise AssertionError(conv.stderr + proc.communicate(timeout=30)[1])
        assert out.read_bytes() == src.read_bytes()
        subprocess.run(["qemu-io", "-f", "raw", "-c", "write -P 0x77 0 4096", _url(sock, "img1")],
                       check=True, timeout=60, capture_output=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    # the write went to the image's upper layer, flushed on exit
    upper = dd / "images" / "img1" / "upper"
    assert (upper / "upper.map").exists()
    with open(upper / "upper.data", "rb") as f:
        assert f.read(4096) == b"\x77" * 4096


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.tuples(st.sampled_from(["write", "zero", "trim", "read"]),
                                   st.integers(0, 63), st.integers(1, 3), st.integers(0, 4095)),
                         min_size=1, max_size=16), min_size=1, max_size=6))
def test_pipelined_nbd_ops_match_model(store: Store, tmp_path_factory: pytest.TempPathFactory,
                                       batches: list[list[tuple[str, int, int, int]]]) -> None:
    """Batches of up to 16 requests in flight at once on one connection (pipelined,
    replies in any order), a commit between batches, all against a byte model."""
    work = tmp_path_factory.mktemp("pipe")
    size = 64 * 16384
    base = random.Random(len(batches)).randbytes(size)
    (work / "b.raw").write_bytes(base)
    name = f"pipe{next(_pipe_names)}"
    top = import_raw(store, work / "b.raw", name).layer_id
    model = bytearray(base)
    img = BlockImage.open(store, top, name, upper_dir=work / "up")
    sock = work / "s.sock"
    try:
        with BackgroundNbdServer(sock, [img]):
            async def run() -> None:
                c = await NbdClient.connect(str(sock), name)
                try:
                    for batch in batches:
                        used: set[int] = set()
                        futs, checks = [], []
                        for kind, slot, nslots, skew in batch:
                            # requests of one batch touch disjoint 16 KiB slots: their order is free
                            slots = set(range(slot, min(slot + nslots, 64)))
                            if slots & used:
                                continue
                            used |= slots
                            off = min(slots) * 16384 + skew
                            n = len(slots) * 16384 - skew
                            if kind == "write":
                                data = bytes([slot + 1]) * n
                                futs.append(c.write(off, data))
                                model[off:off + n] = data
                            elif kind == "zero":
                                futs.append(c.write_zeroes(off, n))
                                model[off:off + n] = bytes(n)
                            elif kind == "trim":
                                futs.append(c.trim(off, n))
                                a0, a1 = -(-off // 4096) * 4096, (off + n) // 4096 * 4096
                                if a1 > a0:
                                    model[a0:a1] = bytes(a1 - a0)
                            else:
                                futs.append(c.read(off, n))
                                checks.append((len(futs) - 1, bytes(model[off:off + n])))
                        got = await asyncio.gather(*futs)
                        for i, want in checks:
                            assert got[i] == want
                        await c.flush()
                        await asyncio.get_running_loop().run_in_executor(None, img.commit, name)
                    assert await c.read(0, size) == bytes(model)
                finally:
                    await c.close()
            asyncio.run(run())
    finally:
        img.close()
    with BlockImage.open(store, image_top(store.get_record(name)), name) as ro:
        assert ro.read(0, size) == bytes(model)
