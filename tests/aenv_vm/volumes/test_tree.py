"""VolumeTree and VolumeRegistry on a real filesystem: the symlink rule (a guest's
symlink never lets the host read or write outside the tree), special files,
E2B's create/force semantics, durable records. No VM."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_vm.volumes.registry import (InvalidVolumeName, VolumeInUse, VolumeNameTaken, VolumeNotFound,
                                      VolumeRegistry)
from aenv_vm.volumes.tree import MAX_DEPTH, VolumeTree, split_path

SECRET = b"host secret, never to be read through a volume\n"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A directory outside the tree standing for the host's files."""
    d = tmp_path / "host"
    d.mkdir()
    (d / "secret").write_bytes(SECRET)
    (d / "sub").mkdir()
    return d


@pytest.fixture
def tree(tmp_path: Path, host: Path) -> VolumeTree:
    """A tree with guest-made traps: symlinks out (absolute and relative), a symlink loop,
    a FIFO."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "dir").mkdir()
    (root / "dir" / "f").write_bytes(b"inside")
    os.symlink(host, root / "out")                       # x -> /etc
    os.symlink(host / "secret", root / "outfile")        # x -> /etc/passwd
    os.symlink("../host", root / "rel")                  # relative escape
    os.symlink("../../host/secret", root / "dir" / "up")
    os.symlink("loop", root / "loop")
    os.symlink("dir", root / "inlink")                   # a symlink that stays inside: not followed either
    os.mkfifo(root / "fifo")
    return VolumeTree(root)


def _host_state(host: Path) -> list[tuple[str, bytes | None, int]]:
    out = []
    for p in sorted(host.rglob("*")):
        s = p.lstat()
        out.append((str(p.relative_to(host)), p.read_bytes() if p.is_file() else None, s.st_mode))
    return out


def _errno(fn, *args, **kw) -> int:
    with pytest.raises(OSError) as info:
        fn(*args, **kw)
    return info.value.errno


# ---------------------------------------------------------------- the symlink rule

@pytest.mark.parametrize("link", ["out", "rel", "inlink"])
def test_no_operation_goes_through_a_directory_symlink(tree: VolumeTree, host: Path, link: str) -> None:
    before = _host_state(host)
    through = f"/{link}/secret"
    assert _errno(tree.get_info, through) == errno.ENOTDIR
    assert _errno(lambda: b"".join(tree.read_file(through))) == errno.ENOTDIR
    assert _errno(tree.write_file, through, b"pwned", force=True) == errno.ENOTDIR
    assert _errno(tree.write_file, f"/{link}/new", b"pwned", force=True) == errno.ENOTDIR
    assert _errno(tree.make_dir, f"/{link}/newdir", force=True) == errno.ENOTDIR
    assert _errno(tree.make_dir, f"/{link}/a/b/c", force=True) == errno.ENOTDIR
    assert _errno(tree.remove, through) == errno.ENOTDIR
    assert _errno(tree.remove, f"/{link}/sub") == errno.ENOTDIR
    assert _errno(tree.update_metadata, through, mode=0o777) == errno.ENOTDIR
    assert _errno(tree.list_dir, f"/{link}") == errno.ELOOP
    assert _errno(tree.list_dir, f"/{link}/sub") == errno.ENOTDIR
    assert _errno(tree.open_beneath, through, os.O_RDONLY) == errno.ENOTDIR
    assert _errno(tree.open_parent_beneath, through) == errno.ENOTDIR
    assert _host_state(host) == before


def test_a_final_symlink_is_reported_never_followed(tree: VolumeTree, host: Path) -> None:
    before = _host_state(host)
    e = tree.get_info("/outfile")
    assert (e.type, e.target, e.path, e.name) == ("symlink", str(host / "secret"), "/outfile", "outfile")
    assert tree.get_info("/out").type == "symlink"
    assert _errno(lambda: b"".join(tree.read_file("/outfile"))) == errno.ELOOP
    assert _errno(lambda: b"".join(tree.read_file("/dir/up"))) == errno.ELOOP
    assert _errno(tree.write_file, "/outfile", b"pwned") == errno.EEXIST          # no force: it exists
    assert _errno(tree.write_file, "/outfile", b"pwned", force=True) == errno.ELOOP
    assert _errno(tree.make_dir, "/out") == errno.EEXIST
    assert _errno(tree.make_dir, "/out", force=True) == errno.ENOTDIR
    assert _errno(tree.update_metadata, "/outfile", mode=0o777) == errno.ELOOP
    assert _errno(tree.update_metadata, "/out", mode=0o777) == errno.ELOOP
    assert _errno(tree.open_beneath, "/outfile", os.O_RDONLY) == errno.ELOOP
    assert _errno(tree.open_beneath, "/loop", os.O_RDONLY) == errno.ELOOP
    assert _errno(tree.open_beneath, "/outfile", os.O_WRONLY | os.O_CREAT | os.O_TRUNC) == errno.ELOOP
    # the owner of the link itself may be set; the target's stays
    tree.update_metadata("/outfile", uid=1234, gid=1234)
    assert os.lstat(tree.root / "outfile").st_uid == 1234 and (host / "secret").stat().st_uid != 1234
    # O_PATH gives the link itself
    fd = tree.open_beneath("/outfile", os.O_PATH)
    try:
        assert stat.S_ISLNK(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    # removing a symlink removes the link, not what it points at
    tree.remove("/out")
    tree.remove("/outfile")
    assert not os.path.lexists(tree.root / "out") and _host_state(host) == before


def test_listing_shows_symlinks_and_never_enters_them(tree: VolumeTree) -> None:
    names = {e.path: e.type for e in tree.list_dir("/", depth=MAX_DEPTH)}
    assert names["/out"] == names["/rel"] == names["/inlink"] == names["/dir/up"] == "symlink"
    assert names["/fifo"] == "unknown" and names["/dir/f"] == "file"
    assert not any(p.startswith(("/out/", "/rel/", "/inlink/")) for p in names)


def test_special_files_are_never_opened(tree: VolumeTree) -> None:
    # opening a FIFO for reading would block the server forever; it is refused before any open
    assert _errno(lambda: b"".join(tree.read_file("/fifo"))) == errno.EINVAL
    assert _errno(tree.write_file, "/fifo", b"x", force=True) == errno.EINVAL
    assert _errno(tree.open_beneath, "/fifo", os.O_RDONLY) == errno.EINVAL


def test_a_recursive_remove_stays_inside(tree: VolumeTree, host: Path) -> None:
    before = _host_state(host)
    tree.make_dir("/d/e", force=True)
    os.symlink(host, tree.root / "d" / "e" / "hostlink")
    os.symlink(host / "secret", tree.root / "d" / "secretlink")
    tree.remove("/d")
    assert not (tree.root / "d").exists() and _host_state(host) == before


def test_a_guest_swapping_directories_for_symlinks_mid_operation(tree: VolumeTree, host: Path) -> None:
    """A guest renames a directory away and puts a symlink to the host in its place, over
    and over, while the node works in that directory: every operation either acts on
    the real directory or fails; none ever lands on the host."""
    import threading
    import time

    before = _host_state(host)
    root = tree.root
    (root / "d").mkdir()
    (root / "d" / "f").write_bytes(b"inside")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            try:
                os.rename(root / "d", root / "d_real")
                os.symlink(host, root / "d")
                time.sleep(0)
                os.unlink(root / "d")
                os.rename(root / "d_real", root / "d")
            except OSError:
                for p in (root / "d",):
                    if p.is_symlink():
                        p.unlink()
                if (root / "d_real").exists() and not os.path.lexists(root / "d"):
                    os.rename(root / "d_real", root / "d")

    t = threading.Thread(target=swap)
    t.start()
    done = 0
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for op in (lambda: tree.write_file("/d/x", b"pwned", force=True),
                       lambda: b"".join(tree.read_file("/d/f")),
                       lambda: b"".join(tree.read_file("/d/secret")),
                       lambda: tree.make_dir("/d/n/m", force=True),
                       lambda: tree.update_metadata("/d/f", mode=0o600),
                       lambda: tree.update_metadata("/d/secret", mode=0o777),
                       lambda: tree.list_dir("/d", 2),
                       lambda: tree.remove("/d/x"),
                       lambda: tree.remove("/d/sub"),
                       lambda: tree.remove("/d/n")):
                try:
                    got = op()
                    done += 1
                except OSError:
                    continue
                if isinstance(got, bytes):
                    assert SECRET not in got
    finally:
        stop.set()
        t.join()
    assert done > 0
    assert _host_state(host) == before


@pytest.mark.parametrize("bad", ["..", "/..", "a/../b", "../host/secret", "dir/../../host", "a\x00b", "x" * 5000])
def test_bad_paths_are_refused(tree: VolumeTree, bad: str) -> None:
    assert _errno(tree.get_info, bad) == errno.EINVAL
    assert _errno(tree.write_file, bad, b"x", force=True) == errno.EINVAL


def test_path_forms() -> None:
    assert split_path("") == split_path("/") == split_path("//./") == []
    assert split_path("/a//b/./c/") == split_path("a/b/c") == ["a", "b", "c"]
    assert _errno(split_path, "a/" + "x" * 256) == errno.ENAMETOOLONG


# ---------------------------------------------------------------- E2B semantics

def test_write_read_and_force(tree: VolumeTree) -> None:
    e = tree.write_file("/a/b/c.txt", [b"hello ", b"world"], force=True, mode=0o600, uid=1000, gid=1001)
    assert (e.type, e.size, e.mode, e.uid, e.gid, e.path, e.name) == ("file", 11, 0o600, 1000, 1001, "/a/b/c.txt",
                                                                       "c.txt")
    assert tree.get_info("/a").uid == 1000 and tree.get_info("/a/b").gid == 1001   # made parents: same owner
    assert b"".join(tree.read_file("a/b/c.txt")) == b"hello world"
    assert _errno(tree.write_file, "/a/b/c.txt", b"again") == errno.EEXIST           # no force: no overwrite
    assert _errno(tree.write_file, "/nodir/c.txt", b"x") == errno.ENOENT            # no force: no parents
    tree.write_file("/a/b/c.txt", b"short", force=True)
    assert b"".join(tree.read_file("/a/b/c.txt")) == b"short"
    assert _errno(tree.write_file, "/a/b/c.txt/x", b"x", force=True) == errno.ENOTDIR
    assert _errno(lambda: b"".join(tree.read_file("/a"))) == errno.EISDIR
    assert _errno(tree.write_file, "/", b"x") == errno.EISDIR


def test_make_dir_list_remove_patch(tree: VolumeTree) -> None:
    e = tree.make_dir("/m", mode=0o750, uid=5, gid=6)
    assert (e.type, e.mode, e.uid, e.gid) == ("directory", 0o750, 5, 6)
    assert _errno(tree.make_dir, "/m") == errno.EEXIST
    assert tree.make_dir("/m", force=True).mode == 0o750                             # exists: answered as it is
    assert _errno(tree.make_dir, "/x/y") == errno.ENOENT
    tree.make_dir("/x/y/z", force=True)
    assert _errno(tree.make_dir, "/dir/f", force=True) == errno.EEXIST              # a file is there
    tree.write_file("/x/y/z/f", b"1", force=True)
    assert [e.path for e in tree.list_dir("/x")] == ["/x/y"]
    assert [e.path for e in tree.list_dir("/x", depth=3)] == ["/x/y", "/x/y/z", "/x/y/z/f"]
    assert _errno(tree.list_dir, "/x", depth=MAX_DEPTH + 1) == errno.EINVAL
    assert _errno(tree.list_dir, "/dir/f") == errno.ENOTDIR
    p = tree.update_metadata("/x/y/z/f", mode=0o604, uid=7)
    assert (p.mode, p.uid) == (0o604, 7)
    tree.remove("/x")
    assert not tree.exists("/x") and tree.exists("/m")
    assert _errno(tree.remove, "/x") == errno.ENOENT
    assert _errno(tree.remove, "/") == errno.EINVAL
    assert tree.get_info("/").type == "directory" and tree.get_info("").path == "/"


def test_public_primitives(tree: VolumeTree) -> None:
    dfd, name = tree.open_parent_beneath("/dir/f")
    try:
        assert name == "f" and os.path.realpath(f"/proc/self/fd/{dfd}") == str(tree.root / "dir")
        assert os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size == 6
    finally:
        os.close(dfd)
    assert _errno(tree.open_parent_beneath, "/") == errno.EINVAL
    fd = tree.open_beneath("/dir/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        os.write(fd, b"made")
    finally:
        os.close(fd)
    assert (tree.root / "dir" / "new").read_bytes() == b"made"
    fd = tree.open_beneath("/dir", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert "new" in os.listdir(fd)
    finally:
        os.close(fd)
    fd = tree.open_beneath("/", os.O_RDONLY | os.O_DIRECTORY)
    os.close(fd)
    assert _errno(tree.open_beneath, "/dir", os.O_WRONLY) == errno.EISDIR
    assert _errno(tree.open_beneath, "/dir/f", os.O_RDONLY | os.O_DIRECTORY) == errno.ENOTDIR
    assert _errno(tree.open_beneath, "/dir/nothing", os.O_RDONLY) == errno.ENOENT


# ---------------------------------------------------------------- property: never outside

_COMPONENTS = st.sampled_from(["out", "rel", "inlink", "outfile", "loop", "fifo", "dir", "up", "f", "secret", "sub",
                               "..", ".", "", "new", "host", "\x00", "x" * 300])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_COMPONENTS, max_size=6), lead=st.booleans(),
       text=st.text(alphabet=st.sampled_from("/.ab\x00\\~"), max_size=12))
def test_no_path_reaches_outside(tree: VolumeTree, host: Path, parts: list[str], lead: bool, text: str) -> None:
    """Whatever the path, an operation either fails with an OSError or acts on an
    entry strictly beneath the root; the host's files are never read or changed."""
    before = _host_state(host)
    root = os.path.realpath(tree.root)
    for path in (("/" if lead else "") + "/".join(parts), text):
        for op in (lambda: tree.get_info(path), lambda: b"".join(tree.read_file(path)),
                   lambda: tree.list_dir(path, 2), lambda: tree.write_file(path, b"w", force=True),
                   lambda: tree.make_dir(path, force=True), lambda: tree.update_metadata(path, mode=0o700),
                   lambda: tree.open_beneath(path, os.O_RDONLY)):
            try:
                got = op()
            except OSError:
                continue
            if isinstance(got, bytes):
                assert SECRET not in got
            if isinstance(got, int):        # an fd: where it really is
                try:
                    real = os.path.realpath(f"/proc/self/fd/{got}")
                finally:
                    os.close(got)
                assert real == root or real.startswith(root + "/")
        try:
            fd, name = tree.open_parent_beneath(path)
        except OSError:
            pass
        else:
            try:
                real = os.path.realpath(f"/proc/self/fd/{fd}")
                assert (real == root or real.startswith(root + "/")) and "/" not in name and name not in ("..", ".")
            finally:
                os.close(fd)
    assert _host_state(host) == before


# ---------------------------------------------------------------- registry

def test_registry_records_trees_and_mounts(tmp_path: Path) -> None:
    reg = VolumeRegistry(tmp_path / "volumes")
    a = reg.create("data_1")
    b = reg.create("other-2")
    assert len(a.token) >= 40 and a.token != b.token and a.token_matches(a.token) and not a.token_matches(b.token)
    assert not a.token_matches("") and not a.token_matches(a.token + "x")
    with pytest.raises(VolumeNameTaken):
        reg.create("data_1")
    for bad in ("", "a b", "a/b", "..", "ä", "x" * 256, "a\x00"):
        with pytest.raises(InvalidVolumeName):
            reg.create(bad)
    assert [r.name for r in reg.list()] == ["data_1", "other-2"]
    assert reg.get(a.volume_id) == a and reg.by_name("other-2") == b and reg.by_name("nope") is None
    reg.tree(a.volume_id).write_file("/k/v", b"kept", force=True)
    rec = tmp_path / "volumes" / a.volume_id / "volume.json"
    assert json.loads(rec.read_text())["token"] == a.token and stat.S_IMODE(rec.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "volumes").stat().st_mode) == 0o700

    again = VolumeRegistry(tmp_path / "volumes")          # a restarted node
    assert again.get(a.volume_id) == a
    assert b"".join(again.tree(a.volume_id).read_file("/k/v")) == b"kept"

    again.mark_mounted(a.volume_id, "sbx-1")
    again.mark_mounted(a.volume_id, "sbx-2")
    assert again.mounted_by(a.volume_id) == {"sbx-1", "sbx-2"}
    with pytest.raises(VolumeInUse):
        again.delete(a.volume_id)
    again.unmark(a.volume_id, "sbx-1")
    again.unmark(a.volume_id, "sbx-2")
    again.unmark(a.volume_id, "never")
    tree_path = again.tree_path(a.volume_id)
    again.delete(a.volume_id)
    assert not tree_path.exists() and again.find(a.volume_id) is None
    with pytest.raises(VolumeNotFound):
        again.delete(a.volume_id)
    with pytest.raises(VolumeNotFound):
        again.tree("../../etc")
    with pytest.raises(VolumeNotFound):
        again.mark_mounted(a.volume_id, "sbx")
    assert sorted(os.listdir(tmp_path / "volumes")) == [b.volume_id]


def test_registry_finishes_interrupted_work(tmp_path: Path) -> None:
    root = tmp_path / "volumes"
    reg = VolumeRegistry(root)
    v = reg.create("v")
    (root / ".new-1234").mkdir()
    (root / ".trash-5678").mkdir()
    (root / "not-a-volume").mkdir()
    assert [r.volume_id for r in VolumeRegistry(root).list()] == [v.volume_id]
    assert sorted(os.listdir(root)) == sorted([v.volume_id, "not-a-volume"])
