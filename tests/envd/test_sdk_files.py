"""files.* and watch_dir through the real e2b SDK (sync) against a host envd."""

from __future__ import annotations

import io
import os
import time

import pytest
from e2b import FileType
from e2b.exceptions import FileNotFoundException, InvalidArgumentException
from e2b.sandbox.filesystem.filesystem import WriteEntry


def test_write_read_text_bytes_stream(sandbox, workdir, test_user) -> None:
    p = workdir / "sub" / "dir" / "a.txt"
    info = sandbox.files.write(str(p), "héllo\n")
    assert (info.name, info.path, info.type) == ("a.txt", str(p), FileType.FILE)
    assert p.read_text() == "héllo\n"
    # created as the default user, parent directories included
    assert p.stat().st_uid == test_user.pw_uid
    assert (workdir / "sub").stat().st_uid == test_user.pw_uid
    assert sandbox.files.read(str(p)) == "héllo\n"
    blob = bytes(range(256)) * 1000
    sandbox.files.write(str(p), blob)
    assert sandbox.files.read(str(p), format="bytes") == bytearray(blob)
    assert b"".join(sandbox.files.read(str(p), format="stream")) == blob
    assert sandbox.files.read(str(p), format="bytes", gzip=True) == bytearray(blob)


def test_write_octet_stream_and_gzip(sandbox, workdir) -> None:
    p = workdir / "stream.bin"
    data = os.urandom(300_000)
    sandbox.files.write(str(p), io.BytesIO(data))  # file-like -> octet-stream upload
    assert p.read_bytes() == data
    sandbox.files.write(str(p), b"zz" * 50_000, gzip=True)
    assert p.read_bytes() == b"zz" * 50_000


def test_relative_paths_start_at_home(sandbox, test_user) -> None:
    sandbox.files.write("rel/note.txt", "x")
    assert open(os.path.join(test_user.pw_dir, "rel/note.txt")).read() == "x"
    assert sandbox.files.read("~/rel/note.txt") == "x"


def test_write_files_multipart(sandbox, workdir) -> None:
    entries = [WriteEntry(path=str(workdir / f"m{i}.txt"), data=f"file {i}") for i in range(3)]
    infos = sandbox.files.write_files(entries)
    assert [i.path for i in infos] == [e["path"] for e in entries]
    for i in range(3):
        assert (workdir / f"m{i}.txt").read_text() == f"file {i}"


def test_list_depth_exists_info(sandbox, workdir) -> None:
    (workdir / "d1" / "d2" / "d3").mkdir(parents=True)
    (workdir / "d1" / "f1").write_text("1")
    (workdir / "d1" / "d2" / "f2").write_text("22")
    os.symlink(workdir / "d1" / "f1", workdir / "link")
    names = lambda entries: sorted(os.path.relpath(e.path, workdir) for e in entries)  # noqa: E731
    assert names(sandbox.files.list(str(workdir))) == ["d1", "link"]
    assert names(sandbox.files.list(str(workdir), depth=2)) == ["d1", "d1/d2", "d1/f1", "link"]
    assert names(sandbox.files.list(str(workdir), depth=3)) == ["d1", "d1/d2", "d1/d2/d3", "d1/d2/f2", "d1/f1", "link"]
    with pytest.raises(InvalidArgumentException):
        sandbox.files.list(str(workdir), depth=0)

    assert sandbox.files.exists(str(workdir / "d1" / "f1")) is True
    assert sandbox.files.exists(str(workdir / "nope")) is False
    info = sandbox.files.get_info(str(workdir / "d1" / "d2" / "f2"))
    assert info.type == FileType.FILE and info.size == 2 and info.name == "f2"
    assert info.permissions == "-rw-r--r--" and info.mode == 0o644
    assert info.owner == "root" and info.group == "root"
    assert abs(info.modified_time.timestamp() - (workdir / "d1" / "d2" / "f2").stat().st_mtime) < 1e-3
    d = sandbox.files.get_info(str(workdir / "d1"))
    assert d.type == FileType.DIR and d.permissions.startswith("d")
    link = sandbox.files.get_info(str(workdir / "link"))
    # E2B's envd: a link reports its target's type, and the resolved target
    assert link.type == FileType.FILE and link.symlink_target == str(workdir / "d1" / "f1")
    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(str(workdir / "missing"))


def test_remove_rename_make_dir(sandbox, workdir) -> None:
    (workdir / "old.txt").write_text("o")
    moved = sandbox.files.rename(str(workdir / "old.txt"), str(workdir / "new" / "new.txt"))
    assert moved.path == str(workdir / "new" / "new.txt") and moved.name == "new.txt"
    assert not (workdir / "old.txt").exists() and (workdir / "new" / "new.txt").read_text() == "o"
    with pytest.raises(FileNotFoundException):
        sandbox.files.rename(str(workdir / "old.txt"), str(workdir / "x"))

    assert sandbox.files.make_dir(str(workdir / "a" / "b")) is True
    assert (workdir / "a" / "b").is_dir()
    assert sandbox.files.make_dir(str(workdir / "a" / "b")) is False

    sandbox.files.remove(str(workdir / "a"))
    assert not (workdir / "a").exists()
    sandbox.files.remove(str(workdir / "new" / "new.txt"))
    assert not (workdir / "new" / "new.txt").exists()
    sandbox.files.remove(str(workdir / "a"))  # already gone: no error (Go's os.RemoveAll, as E2B's envd)


def test_read_missing_and_directory(sandbox, workdir) -> None:
    with pytest.raises(FileNotFoundException):
        sandbox.files.read(str(workdir / "missing.txt"))
    with pytest.raises(InvalidArgumentException):
        sandbox.files.read(str(workdir))


def test_watch_dir_sync(sandbox, workdir) -> None:
    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

    (workdir / "sub").mkdir()
    h = sandbox.files.watch_dir(str(workdir), recursive=True)
    try:
        (workdir / "f.txt").write_text("1")
        (workdir / "sub" / "deep.txt").write_text("2")
        os.rename(workdir / "f.txt", workdir / "g.txt")
        os.remove(workdir / "g.txt")
        time.sleep(0.2)
        events = h.get_new_events()
        got = {(e.name, e.type) for e in events}
        assert ("f.txt", FilesystemEventType.CREATE) in got
        assert ("f.txt", FilesystemEventType.WRITE) in got
        assert ("sub/deep.txt", FilesystemEventType.CREATE) in got
        assert ("f.txt", FilesystemEventType.RENAME) in got
        assert ("g.txt", FilesystemEventType.CREATE) in got
        assert ("g.txt", FilesystemEventType.REMOVE) in got
        assert h.get_new_events() == []  # drained
    finally:
        h.stop()
    with pytest.raises(Exception):
        h.get_new_events()  # the watcher is gone on the server
    with pytest.raises(FileNotFoundException):
        sandbox.files.watch_dir(str(workdir / "missing"))


def test_is_running(sandbox) -> None:
    assert sandbox.is_running() is True


def test_file_metadata_roundtrip(sandbox, workdir) -> None:
    p = str(workdir / "meta.txt")
    info = sandbox.files.write(p, "m", metadata={"Owner": "alice", "stage": "raw"})
    assert info.metadata == {"owner": "alice", "stage": "raw"}  # keys are lower-cased
    assert sandbox.files.get_info(p).metadata == {"owner": "alice", "stage": "raw"}
    assert os.getxattr(p, "user.e2b.owner") == b"alice"
    # an upload replaces the metadata; one without metadata clears it
    sandbox.files.write(p, "m2", metadata={"stage": "clean"})
    assert sandbox.files.get_info(p).metadata == {"stage": "clean"}
    sandbox.files.write(p, "m3")
    assert sandbox.files.get_info(p).metadata is None
    assert [e.metadata for e in sandbox.files.list(str(workdir)) if e.name == "meta.txt"] == [None]


def test_user_parameter_on_files(sandbox, workdir, test_user) -> None:
    root_file = workdir / "by-root.txt"
    sandbox.files.write(str(root_file), "r", user="root")
    assert root_file.stat().st_uid == 0
    sandbox.files.write(str(workdir / "by-user.txt"), "u", user=test_user.pw_name)
    assert (workdir / "by-user.txt").stat().st_uid == test_user.pw_uid
    # relative paths follow the chosen user's home
    sandbox.files.write("home-rel.txt", "h", user=test_user.pw_name)
    assert os.path.exists(os.path.join(test_user.pw_dir, "home-rel.txt"))
    assert sandbox.files.read("home-rel.txt", user=test_user.pw_name) == "h"
    from e2b.exceptions import AuthenticationException

    with pytest.raises(AuthenticationException):
        sandbox.files.read(str(root_file), user="no-such-user-q")
