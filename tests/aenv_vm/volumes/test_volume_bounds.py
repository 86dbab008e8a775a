"""The bounds of a volume on the node (issue 28), without a VM: listing pages that fit a
frame whatever the names (getdents64 records fuzzed, real directories paged), every
request answered with an errno, the per-volume quota of bytes and inodes kept exact by
the guest's requests and the content API, the free-disk floor's inodes; and through
envd's FUSE daemon mounted on this host (real /dev/fuse) a directory of 1,000 long
names listed whole and ``touch`` stopped by the quota with EDQUOT."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from aenv_store.diskfloor import DiskFloor, free_space
from aenv_vm.volumes.channel import VolumeServer
from aenv_vm.volumes.charged import ChargedTree
from aenv_vm.volumes.dirpage import DIRENT, parse_dirents, read_page
from aenv_vm.volumes.quota import VolumeQuota, VolumeUsage, scan
from aenv_vm.volumes.registry import VolumeRegistry
from aenv_vm.volumes.tree import VolumeTree
from envd import volwire as W

from .test_channel import LocalMount, ask, local  # noqa: F401  (the FUSE fixture)

LONG = 220          # bytes of each long name (the issue: ~240 such names overflowed a page)


def _long_names(n: int) -> list[str]:
    return [f"{i:05d}-" + "n" * (LONG - 6) for i in range(n)]


# ------------------------------------------------------------------ getdents64 records

def _record(ino: int, off: int, dtype: int, name: bytes) -> bytes:
    reclen = (DIRENT.size + len(name) + 1 + 7) // 8 * 8
    return DIRENT.pack(ino, off, reclen, dtype) + name + b"\0" * (reclen - DIRENT.size - len(name))


_names = hs.binary(min_size=1, max_size=255).filter(lambda b: b"\0" not in b and b"/" not in b)


@given(hs.lists(hs.tuples(hs.integers(0, 2**64 - 1), hs.integers(-2**63, 2**63 - 1), hs.integers(0, 255), _names),
                max_size=20))
@settings(max_examples=200)
def test_dirent_records_parse_back(records: list[tuple[int, int, int, bytes]]) -> None:
    buf = b"".join(_record(*r) for r in records)
    got = [(d.ino, d.cookie, d.dtype, d.name) for d in parse_dirents(buf)]
    assert got == records


@given(hs.binary(max_size=300))
@settings(max_examples=300)
def test_dirent_garbage_is_a_value_error_or_records(data: bytes) -> None:
    try:
        for d in parse_dirents(data):
            assert len(d.name) <= len(data)
    except ValueError:        # never struct.error: the parser checks lengths first
        pass


# ------------------------------------------------------------------ pages

def _page_all(srv: VolumeServer, path: str, by_cookie: bool) -> list[str]:
    names: list[str] = []
    offset, cookie = 0, 0
    for _ in range(10_000):
        meta: dict[str, Any] = {"path": path, "offset": offset}
        if by_cookie:
            meta["cookie"] = cookie
        reply = srv.answer(W.Frame(W.Kind.REQUEST, 9, int(W.Op.READDIR), meta))
        assert len(reply) <= W.HEADER_LEN + W.MAX_META            # a page always fits a frame
        (frame,) = W.FrameDecoder().feed(reply)
        assert frame.code == 0, os.strerror(frame.code)
        names += [e[0] for e in frame.meta["entries"]]
        offset += len(frame.meta["entries"])
        cookie = frame.meta["cookie"]
        if not frame.meta["more"]:
            return names
    raise AssertionError("the listing never ended")


@pytest.mark.parametrize("by_cookie", [True, False], ids=["cookie", "count"])
def test_a_directory_of_long_names_lists_whole(tmp_path: Path, by_cookie: bool) -> None:
    root = tmp_path / "t"
    (root / "d").mkdir(parents=True)
    names = _long_names(1000)
    for n in names:
        (root / "d" / n).touch()
    # names that are not UTF-8 cost 6 bytes each in JSON (\udcxx): the page still fits
    odd = [b"\xff" * 250 + bytes([0x41 + i]) for i in range(40)]
    for b in odd:
        os.close(os.open(os.path.join(os.fsencode(root / "d"), b), os.O_CREAT | os.O_WRONLY, 0o644))
    srv = VolumeServer(VolumeTree(root))
    got = _page_all(srv, "d", by_cookie)
    assert len(got) == len(set(got)) == 1040
    assert set(got) == set(names) | {os.fsdecode(b) for b in odd}


def test_a_page_is_cut_by_size_not_count(tmp_path: Path) -> None:
    for n in _long_names(600):
        (tmp_path / n).touch()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        first = read_page(fd, 0)
        assert first.more and 200 < len(first.entries) < 600
        assert len(json.dumps({"entries": [list(e) for e in first.entries]}, separators=(",", ":")).encode()) <= W.MAX_META
        rest = read_page(fd, first.cookie)
        assert not {e[0] for e in first.entries} & {e[0] for e in rest.entries}
        with pytest.raises(OSError) as e:
            read_page(fd, -1)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)


# ------------------------------------------------------------------ every request answered

def test_every_request_is_answered(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    srv = VolumeServer(VolumeTree(tmp_path / "t"))
    assert ask(srv, W.Op.READDIR, {"path": 7}).code == errno.EINVAL
    assert ask(srv, W.Op.READDIR, {"path": "", "cookie": "x"}).code == errno.EINVAL
    assert ask(srv, W.Op.STAT, {"path": ["a"]}).code == errno.EINVAL
    assert ask(srv, W.Op.WRITE, {"path": "nope", "offset": -1}).code == errno.EINVAL

    async def talk() -> list[W.Frame]:
        a, b = socket.socketpair()
        hr, hw = await asyncio.open_connection(sock=b)
        task = asyncio.get_running_loop().create_task(srv.serve(hr, hw))
        gr, gw = await asyncio.open_connection(sock=a)
        bad_json = b"{not json"
        nested = b"[" * 30000 + b"]" * 30000
        gw.write(W.HEADER.pack(W.MAGIC, W.VERSION, 1, 11, int(W.Op.STAT), 0, len(bad_json), 0) + bad_json)
        gw.write(W.HEADER.pack(W.MAGIC, W.VERSION, 1, 12, int(W.Op.STAT), 0, len(nested), 0) + nested)
        big = W.MAX_DATA + 10
        gw.write(W.HEADER.pack(W.MAGIC, W.VERSION, 1, 13, int(W.Op.WRITE), 0, 0, big) + b"\0" * big)
        gw.write(W.request(14, W.Op.STATFS, {}))
        await gw.drain()
        dec = W.FrameDecoder()
        out: list[W.Frame] = []
        while len(out) < 4:
            out += dec.feed(await asyncio.wait_for(gr.read(1 << 16), 10))
        gw.close()
        await asyncio.wait_for(task, 10)
        return out

    replies = {f.id: f.code for f in asyncio.run(talk())}
    assert replies == {11: errno.EINVAL, 12: errno.EINVAL, 13: errno.E2BIG, 14: 0}


# ------------------------------------------------------------------ quotas

def _usage_server(root: Path, max_bytes: int = 0, max_inodes: int = 0) -> tuple[VolumeServer, VolumeUsage]:
    usage = VolumeUsage(root, VolumeQuota(max_bytes, max_inodes))
    return VolumeServer(VolumeTree(root), usage=usage), usage


def test_the_inode_quota_stops_creates_with_edquot(tmp_path: Path) -> None:
    root = tmp_path / "t"
    (root / "pre").mkdir(parents=True)           # what was there before counts (the scan)
    srv, usage = _usage_server(root, max_inodes=5)
    assert ask(srv, W.Op.MKDIR, {"path": "d"}).code == 0
    assert ask(srv, W.Op.SYMLINK, {"path": "l", "target": "/etc"}).code == 0
    assert ask(srv, W.Op.CREATE, {"path": "d/a"}).code == 0
    assert ask(srv, W.Op.CREATE, {"path": "d/b"}).code == 0
    assert usage.used()[1] == 5
    for op, meta in ((W.Op.CREATE, {"path": "c"}), (W.Op.MKDIR, {"path": "e"}),
                     (W.Op.SYMLINK, {"path": "m", "target": "x"})):
        assert ask(srv, op, meta).code == errno.EDQUOT
    assert ask(srv, W.Op.CREATE, {"path": "d/a"}).code == 0          # an existing file needs no inode
    assert ask(srv, W.Op.CREATE, {"path": "d/a", "excl": True}).code == errno.EDQUOT
    assert ask(srv, W.Op.UNLINK, {"path": "d/a"}).code == 0
    assert ask(srv, W.Op.CREATE, {"path": "c"}).code == 0
    assert ask(srv, W.Op.RENAME, {"path": "c", "to": "d/b"}).code == 0    # d/b replaced: one inode less
    assert usage.used() == scan(root)
    assert sorted(os.listdir(root)) == ["d", "l", "pre"]


def test_the_byte_quota_stops_writes_with_edquot(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    srv, usage = _usage_server(root, max_bytes=1 << 20)
    assert ask(srv, W.Op.CREATE, {"path": "f"}).code == 0
    assert ask(srv, W.Op.WRITE, {"path": "f", "offset": 0}, b"x" * (512 << 10)).code == 0
    assert ask(srv, W.Op.WRITE, {"path": "f", "offset": 512 << 10}, b"y" * (400 << 10)).code == 0
    assert ask(srv, W.Op.WRITE, {"path": "f", "offset": 912 << 10}, b"z" * (200 << 10)).code == errno.EDQUOT
    assert (root / "f").stat().st_size == 912 << 10                      # nothing of it written
    assert ask(srv, W.Op.WRITE, {"path": "f", "offset": 0}, b"w" * (256 << 10)).code == 0  # in place: free
    assert ask(srv, W.Op.SETATTR, {"path": "f", "size": 4096}).code == 0
    assert ask(srv, W.Op.WRITE, {"path": "f", "offset": 4096}, b"z" * (200 << 10)).code == 0
    assert usage.used() == scan(root)
    assert ask(srv, W.Op.SETATTR, {"path": "f", "size": 1 << 40}).code == 0     # sparse: costs nothing
    assert usage.used() == scan(root)


@given(hs.lists(hs.tuples(hs.sampled_from(["create", "mkdir", "write", "trunc", "unlink", "rmdir", "rename",
                                           "symlink"]),
                          hs.sampled_from(["a", "b", "d/a", "d/b", "d"]), hs.sampled_from(["a", "d/b", "e"]),
                          hs.integers(0, 70_000), hs.integers(0, 70_000)), max_size=30))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_usage_matches_a_scan_after_any_requests(tmp_path_factory: pytest.TempPathFactory,
                                                 ops: list[tuple[str, str, str, int, int]]) -> None:
    root = tmp_path_factory.mktemp("q")
    srv, usage = _usage_server(root, max_bytes=300_000, max_inodes=6)
    for op, path, other, n, offset in ops:
        if op == "create":
            ask(srv, W.Op.CREATE, {"path": path})
        elif op == "mkdir":
            ask(srv, W.Op.MKDIR, {"path": path})
        elif op == "symlink":
            ask(srv, W.Op.SYMLINK, {"path": path, "target": other})
        elif op == "write":
            ask(srv, W.Op.WRITE, {"path": path, "offset": offset}, b"q" * n)
        elif op == "trunc":
            ask(srv, W.Op.SETATTR, {"path": path, "size": n})
        elif op == "unlink":
            ask(srv, W.Op.UNLINK, {"path": path})
        elif op == "rmdir":
            ask(srv, W.Op.RMDIR, {"path": path})
        else:
            ask(srv, W.Op.RENAME, {"path": path, "to": other})
        used = usage.used()
        assert used == scan(root)
        assert used[0] <= 300_000 + 8192 and used[1] <= 6


def test_the_content_api_is_charged_too(tmp_path: Path) -> None:
    reg = VolumeRegistry(tmp_path / "volumes", VolumeQuota(1 << 20, 4))
    rec = reg.create("v")
    own = reg.create("w", max_bytes=0, max_inodes=100)
    assert reg.quota(own) == VolumeQuota(0, 100) and reg.usage(own.volume_id) is not None
    assert reg.quota(reg.create("x", 0, 0)) == VolumeQuota(0, 0)
    tree = reg.tree(rec.volume_id)
    usage = reg.usage(rec.volume_id)
    assert usage is not None
    tree.write_file("/a/b/c", b"x" * 1000, force=True)               # three new inodes
    assert usage.used() == scan(tree.root) and usage.used()[1] == 3
    with pytest.raises(OSError) as e:
        tree.make_dir("/p/q", force=True)                             # two more: over 4
    assert e.value.errno == errno.EDQUOT and not (tree.root / "p").exists()
    with pytest.raises(OSError) as e:
        tree.write_file("/a/big", [b"y" * (512 << 10)] * 3)
    assert e.value.errno == errno.EDQUOT
    assert usage.used() == scan(tree.root)
    tree.remove("/a")
    assert usage.used() == (0, 0) == scan(tree.root)
    # what the registry gives the node's mounts is the same object: one count per volume
    assert reg.usage(rec.volume_id) is usage and isinstance(tree, ChargedTree)


# ------------------------------------------------------------------ the floor's inodes

def test_the_floor_counts_inodes(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    free = free_space(root)
    if free.inodes is None:
        pytest.skip("this filesystem does not count inodes")
    srv = VolumeServer(VolumeTree(root), floor=DiskFloor(0, free.inodes + 10))    # already below
    for op, meta in ((W.Op.CREATE, {"path": "f"}), (W.Op.MKDIR, {"path": "d"}),
                     (W.Op.SYMLINK, {"path": "l", "target": "x"})):
        assert ask(srv, op, meta).code == errno.ENOSPC
    (root / "old").write_text("x")
    assert ask(srv, W.Op.UNLINK, {"path": "old"}).code == 0
    assert DiskFloor(0, free.inodes + 10).shortage(root) is not None
    assert "min_free_inodes" in str(DiskFloor(0, free.inodes + 10).shortage(root))
    assert DiskFloor(0, max(1, free.inodes - 100_000)).shortage(root) is None
    tree = ChargedTree(root, None, DiskFloor(0, free.inodes + 10))
    with pytest.raises(OSError) as e:
        tree.write_file("/new", b"x")
    assert e.value.errno == errno.ENOSPC


# ------------------------------------------------------------------ through a real FUSE mount

def test_long_names_and_the_quota_through_fuse(local: LocalMount) -> None:  # noqa: F811
    names = _long_names(1000)
    (local.mnt / "many").mkdir()
    for n in names:
        (local.root / "many" / n).touch()
    assert sorted(os.listdir(local.mnt / "many")) == names            # every name, nothing hangs
    local.server.usage = VolumeUsage(local.root, VolumeQuota(0, 1000 + 1 + 20))
    made = 0
    with pytest.raises(OSError) as e:
        for i in range(100):
            (local.mnt / f"e{i}").touch()
            made += 1
    assert e.value.errno == errno.EDQUOT and made == 20
    os.unlink(local.mnt / "e0")
    (local.mnt / "again").touch()
