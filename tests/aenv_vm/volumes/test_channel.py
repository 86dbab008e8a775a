"""The volume channel without a VM: its framing (hypothesis round trips, arbitrary
splits, garbage), the node's VolumeServer answering crafted -- hostile -- requests
against a real tree, and envd's FUSE daemon mounted on this host (real /dev/fuse,
real kernel) over a socketpair to a VolumeServer, including a channel dropped and
re-dialled while a request waits."""
from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from aenv_vm.volumes.channel import VolumeServer
from aenv_vm.volumes.tree import VolumeTree
from envd import volwire as W
from envd.volfs import Nodes
from envd.volmounts import VolumeMounts, check_mountpoint, peer_is_local

# ------------------------------------------------------------------ framing

_json = hs.recursive(hs.none() | hs.booleans() | hs.integers(-2**53, 2**53) | hs.text(max_size=20),
                     lambda c: hs.lists(c, max_size=4) | hs.dictionaries(hs.text(max_size=8), c, max_size=4),
                     max_leaves=10)
frames = hs.builds(W.Frame, hs.sampled_from(list(W.Kind)), hs.integers(0, 2**32 - 1), hs.integers(0, 2**16 - 1),
                   hs.dictionaries(hs.text(max_size=10), _json, max_size=5), hs.binary(max_size=3000))


@given(hs.lists(frames, min_size=1, max_size=6), hs.lists(hs.integers(1, 500), min_size=1, max_size=20))
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_frames_round_trip_in_any_split(fs: list[W.Frame], cuts: list[int]) -> None:
    raw = b"".join(W.encode(f) for f in fs)
    dec, out, pos, i = W.FrameDecoder(), [], 0, 0
    while pos < len(raw):
        n = cuts[i % len(cuts)]
        out += dec.feed(raw[pos:pos + n])
        pos, i = pos + n, i + 1
    assert out == fs and dec.pending == 0
    one = W.encode(fs[0])
    assert W.decode_one(one[:W.HEADER_LEN], one[W.HEADER_LEN:]) == fs[0]


@given(hs.binary(max_size=200))
@settings(max_examples=300)
def test_garbage_is_a_wire_error_or_nothing(data: bytes) -> None:
    try:
        for f in W.FrameDecoder().feed(data):
            assert isinstance(f, W.Frame)
    except W.WireError:
        pass


def test_header_checks() -> None:
    good = W.request(7, W.Op.STAT, {"path": "a"})
    assert W.FrameDecoder().feed(good)[0].meta == {"path": "a"}
    for bad in (b"XX" + good[2:], good[:2] + bytes([2]) + good[3:], good[:3] + bytes([9]) + good[4:]):
        with pytest.raises(W.WireError):
            W.FrameDecoder().feed(bad)
    huge = W.HEADER.pack(W.MAGIC, W.VERSION, 1, 1, 1, 0, W.MAX_META + 1, 0)
    with pytest.raises(W.WireError):
        W.FrameDecoder().feed(huge)
    with pytest.raises(W.WireError):
        W.FrameDecoder().feed(W.HEADER.pack(W.MAGIC, W.VERSION, 1, 1, 1, 0, 2, 0) + b"[]")


# ------------------------------------------------------------------ the node's server, attacked

@pytest.fixture
def vol(tmp_path: Path) -> tuple[VolumeServer, Path]:
    root = tmp_path / "tree"
    root.mkdir()
    (tmp_path / "outside").write_text("host secret")
    return VolumeServer(VolumeTree(root)), root


def ask(srv: VolumeServer, op: W.Op, meta: dict[str, Any], data: bytes = b"") -> W.Frame:
    (reply,) = W.FrameDecoder().feed(srv.answer(W.Frame(W.Kind.REQUEST, 1, int(op), meta, data)))
    assert reply.kind is W.Kind.REPLY and reply.id == 1
    return reply


def test_server_basic_ops(vol: tuple[VolumeServer, Path]) -> None:
    srv, root = vol
    assert ask(srv, W.Op.CREATE, {"path": "f", "mode": 0o640, "excl": True, "uid": 1000, "gid": 1000}).code == 0
    assert ask(srv, W.Op.WRITE, {"path": "f", "offset": 3}, b"xyz").meta == {"size": 3}
    assert ask(srv, W.Op.READ, {"path": "f", "offset": 0, "size": 100}).data == b"\0\0\0xyz"
    s = (root / "f").stat()
    assert (stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid) == (0o640, 1000, 1000)
    assert ask(srv, W.Op.MKDIR, {"path": "d", "mode": 0o755}).code == 0
    assert ask(srv, W.Op.RENAME, {"path": "f", "to": "d/g"}).code == 0
    assert ask(srv, W.Op.READDIR, {"path": "d"}).meta["entries"][0][:2] == ["g", "f"]
    assert ask(srv, W.Op.SETATTR, {"path": "d/g", "size": 1, "mtime": 10**18}).meta["size"] == 1
    assert ask(srv, W.Op.STATFS, {}).meta["bsize"] > 0
    assert ask(srv, W.Op.UNLINK, {"path": "d/g"}).code == 0
    assert ask(srv, W.Op.RMDIR, {"path": "d"}).code == 0
    assert ask(srv, 999, {}).code == errno.ENOSYS    # type: ignore[arg-type]


def test_hostile_paths_never_leave_the_volume(vol: tuple[VolumeServer, Path], tmp_path: Path) -> None:
    srv, root = vol
    # '..' anywhere, NUL, wrong types: refused before any syscall
    for meta in ({"path": "../outside"}, {"path": "a/../../outside"}, {"path": "x\0y"}, {"path": 5}, {}):
        assert ask(srv, W.Op.STAT, meta).code == errno.EINVAL, meta
        assert ask(srv, W.Op.READ, {**meta, "offset": 0, "size": 10}).code == errno.EINVAL
    # an absolute path is a path in the volume, not on the host
    assert ask(srv, W.Op.READ, {"path": str(tmp_path / "outside"), "offset": 0, "size": 99}).code == errno.ENOENT
    assert ask(srv, W.Op.READ, {"path": "/etc/passwd", "offset": 0, "size": 99}).code == errno.ENOENT
    # symlinks the guest made are stored as text and never followed here
    assert ask(srv, W.Op.SYMLINK, {"path": "etc", "target": "/etc"}).code == 0
    assert ask(srv, W.Op.SYMLINK, {"path": "up", "target": "../outside"}).code == 0
    assert ask(srv, W.Op.SYMLINK, {"path": "updir", "target": str(tmp_path)}).code == 0
    assert os.readlink(root / "etc") == "/etc"
    assert ask(srv, W.Op.READ, {"path": "etc/passwd", "offset": 0, "size": 99}).code == errno.ENOTDIR
    assert ask(srv, W.Op.READ, {"path": "up", "offset": 0, "size": 99}).code == errno.ELOOP
    assert ask(srv, W.Op.WRITE, {"path": "up", "offset": 0}, b"pwned").code == errno.ELOOP
    assert ask(srv, W.Op.CREATE, {"path": "updir/new", "mode": 0o644}).code == errno.ENOTDIR
    assert ask(srv, W.Op.CREATE, {"path": "up", "mode": 0o644}).code in (errno.ELOOP, errno.EEXIST)
    assert ask(srv, W.Op.SETATTR, {"path": "up", "size": 0}).code == errno.ELOOP
    assert ask(srv, W.Op.SETATTR, {"path": "up", "mode": 0o777}).code == 0      # the link's own: no target
    assert ask(srv, W.Op.MKDIR, {"path": "updir/d"}).code == errno.ENOTDIR
    assert ask(srv, W.Op.RENAME, {"path": "etc", "to": "../moved"}).code == errno.EINVAL
    assert ask(srv, W.Op.RENAME, {"path": "up", "to": "updir/x"}).code == errno.ENOTDIR
    assert ask(srv, W.Op.READDIR, {"path": "updir"}).code in (errno.ENOTDIR, errno.ELOOP)
    assert ask(srv, W.Op.FSYNC, {"path": "up"}).code == errno.ELOOP
    assert ask(srv, W.Op.STAT, {"path": "up"}).meta["mode"] & stat.S_IFMT(0o170000) == stat.S_IFLNK
    assert (tmp_path / "outside").read_text() == "host secret"
    assert sorted(os.listdir(tmp_path)) == ["outside", "tree"]


def test_no_setuid_on_the_host_and_bounded_io(vol: tuple[VolumeServer, Path]) -> None:
    srv, root = vol
    ask(srv, W.Op.CREATE, {"path": "sh", "mode": 0o4755, "uid": 0, "gid": 0})
    ask(srv, W.Op.MKDIR, {"path": "d", "mode": 0o2775})
    ask(srv, W.Op.SETATTR, {"path": "sh", "mode": 0o6755})
    assert stat.S_IMODE((root / "sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "d").stat().st_mode) == 0o775
    (root / "big").write_bytes(b"x" * (3 << 20))
    assert len(ask(srv, W.Op.READ, {"path": "big", "offset": 0, "size": 1 << 30}).data) == 1 << 20
    os.mkfifo(root / "fifo")
    assert ask(srv, W.Op.READ, {"path": "fifo", "offset": 0, "size": 1}).code == errno.EINVAL   # never opened
    assert ask(srv, W.Op.WRITE, {"path": "fifo", "offset": 0}, b"x").code == errno.EINVAL
    assert ask(srv, W.Op.SYMLINK, {"path": "l", "target": "x" * 5000}).code == errno.EINVAL
    assert ask(srv, W.Op.RENAME, {"path": "sh", "to": "sh2", "flags": 4}).code == errno.EINVAL  # WHITEOUT


def test_writes_leave_the_node_its_free_space(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    v = os.statvfs(tmp_path)
    free = v.f_bavail * v.f_frsize
    srv = VolumeServer(VolumeTree(tmp_path / "t"), min_free=free + (1 << 30))   # already below the floor
    for op, meta in ((W.Op.CREATE, {"path": "f"}), (W.Op.MKDIR, {"path": "d"}),
                     (W.Op.WRITE, {"path": "f", "offset": 0}), (W.Op.SYMLINK, {"path": "l", "target": "x"})):
        assert ask(srv, op, meta, b"x").code == errno.ENOSPC
    assert os.listdir(tmp_path / "t") == []
    (tmp_path / "t" / "old").write_text("x")
    assert ask(srv, W.Op.UNLINK, {"path": "old"}).code == 0       # freeing space always works
    ok = VolumeServer(VolumeTree(tmp_path / "t"), min_free=max(free - (64 << 20), 1))
    assert ask(ok, W.Op.CREATE, {"path": "f"}).code == 0
    assert ask(ok, W.Op.WRITE, {"path": "f", "offset": 0}, b"x" * 1000).code == 0


@given(hs.lists(hs.sampled_from(["..", ".", "", "a", "etc", "up", "/", "\0", "x" * 300]), max_size=6),
       hs.sampled_from(list(W.Op)))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_paths_stay_inside(vol: tuple[VolumeServer, Path], parts: list[str], op: W.Op) -> None:
    srv, root = vol
    for name, target in (("up", "../outside"), ("etc", "/etc")):
        if not os.path.lexists(root / name):
            os.symlink(target, root / name)
    path = "/".join(parts)
    ask(srv, op, {"path": path, "to": path + "2", "target": "/", "offset": 0, "size": 8, "mode": 0o777}, b"w")
    assert (root.parent / "outside").read_text() == "host secret"
    assert sorted(os.listdir(root.parent)) == ["outside", "tree"]


def test_guest_side_checks() -> None:
    n = Nodes()
    a = n.remember("a")
    n.remember("a/b")
    n.renamed("a", "z")
    assert n.path(a) == "z" and n.by_path["z/b"]
    with pytest.raises(OSError):
        n.child("", b"..")
    with pytest.raises(OSError):
        n.child("", b"a/b")
    for bad in ("relative", "/", "/proc/x", "/dev", "/a/../b"):
        with pytest.raises(Exception):
            check_mountpoint(bad)
    assert check_mountpoint("/mnt/data/") == "/mnt/data"
    assert peer_is_local("127.0.0.1") and peer_is_local("::1") and not peer_is_local("192.0.2.1")


# ------------------------------------------------------------------ envd's FUSE daemon on this host

class LocalMount:
    """envd's VolumeMounts mounted at ``mnt`` on this host, its channel a socketpair to a
    VolumeServer on ``root`` served by an event loop in a thread (file calls block in the
    kernel); the FUSE daemon runs on VolumeMounts' own thread, as in envd."""

    def __init__(self, root: Path, mnt: Path) -> None:
        self.root, self.mnt = root, mnt
        self.loop = asyncio.new_event_loop()
        self.mounts = VolumeMounts()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = VolumeServer(VolumeTree(root))
        self.dial()

    def dial(self) -> None:
        async def go() -> None:
            a, b = socket.socketpair()
            hr, hw = await asyncio.open_connection(sock=b)
            self.host_writer = hw
            self.loop.create_task(self.server.serve(hr, hw))
            await self.mounts.attach(str(self.mnt), "local", a)    # envd's side: its own thread
        asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def drop(self) -> None:
        self.loop.call_soon_threadsafe(self.host_writer.close)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.mnt)], check=False)

        async def shut() -> None:
            self.mounts.close()
            self.host_writer.close()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalMount]:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        if os.environ.get("CI"):
            pytest.fail("the FUSE tests need root and /dev/fuse (required in CI)")
        pytest.skip("needs root and /dev/fuse")
    (tmp_path / "root").mkdir()
    m = LocalMount(tmp_path / "root", tmp_path / "mnt")
    try:
        yield m
    finally:
        m.close()


def test_local_fuse_mount(local: LocalMount) -> None:
    mnt, root = local.mnt, local.root
    (mnt / "a").write_text("hi\n")
    assert (root / "a").read_text() == "hi\n"
    (root / "b").write_text("from the host")
    assert (mnt / "b").read_text() == "from the host"
    (mnt / "d" / "e").mkdir(parents=True)
    with open(mnt / "d" / "e" / "f", "a") as f:
        f.write("x")
    with open(mnt / "d" / "e" / "f", "a") as f:
        f.write("y")
    os.rename(mnt / "d", mnt / "d2")
    assert (mnt / "d2" / "e" / "f").read_text() == "xy"
    os.symlink("/etc", mnt / "etc")
    assert os.readlink(mnt / "etc") == "/etc" and os.readlink(root / "etc") == "/etc"
    for i in range(1300):            # more names than one listing page
        (root / f"n{i:04d}").touch()
    names = os.listdir(mnt)
    assert len(names) == 1300 + 4 and "n1299" in names
    data = os.urandom(3 << 20)
    (mnt / "big").write_bytes(data)
    assert (mnt / "big").read_bytes() == data == (root / "big").read_bytes()
    os.truncate(mnt / "big", 5)
    assert (mnt / "big").stat().st_size == 5
    shutil.rmtree(mnt / "d2")
    assert not (root / "d2").exists()
    with pytest.raises(OSError) as e:
        os.link(mnt / "a", mnt / "hard")
    assert e.value.errno == errno.EPERM
    assert os.statvfs(mnt).f_bsize > 0


def test_requests_wait_for_a_new_channel(local: LocalMount) -> None:
    (local.root / "f").write_text("before")
    local.drop()
    time.sleep(0.3)
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append((local.mnt / "f").read_text()))
    t.start()
    t.join(1.0)
    assert t.is_alive() and not got          # no channel: the read waits, as on a hard NFS mount
    local.dial()                              # the node dials again (a resume, a fork child)
    t.join(10)
    assert got == ["before"]
    (local.mnt / "g").write_text("after")
    assert (local.root / "g").read_text() == "after"
