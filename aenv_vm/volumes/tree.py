"""A volume's directory tree on the host, reached only strictly beneath its root.

Guests write into these trees (a volume is mounted into sandboxes), so every name
in one is hostile: a guest can leave ``x -> /etc`` or ``x -> ../../..`` anywhere,
swap a directory for a symlink between two of our system calls, or leave FIFOs
and device nodes. The rules that keep the host safe:

* A path is split into components by hand. ``..``, NUL, empty paths of more than
  ``MAX_PATH`` bytes are refused (``EINVAL``); leading and doubled ``/`` and
  ``.`` are dropped, so ``/a//./b`` is ``a/b``.
* Directories are walked one component at a time from an fd of the root, each
  opened ``O_PATH | O_NOFOLLOW | O_DIRECTORY`` relative to the one before: a
  symlink at any intermediate component fails the walk with ``ENOTDIR``; a
  swap after a step is harmless, the walk holds the fd, not the name.
* The final component is never followed: ``stat`` reports a symlink as a
  symlink (with its target text), a read or write of one fails with ``ELOOP``.
  Anything that opens an existing entry opens it ``O_PATH | O_NOFOLLOW`` first,
  checks its type on that fd, and only then reopens that very inode through
  ``/proc/self/fd`` for I/O, so a FIFO, a socket or a device node is never
  opened (``EINVAL``) and no swap between the check and the open can redirect it.
* Metadata changes go through fds too (``fchown``-like calls on the
  ``/proc/self/fd`` name of an ``O_PATH`` fd), never through a name that could
  be swapped for a symlink after it was checked.

Errors are ``OSError`` with the errno that says what went wrong; the API layer maps
errno to HTTP status. Every method is blocking (call it from a thread when on an
event loop); an instance holds no fds between calls and is safe to share between
threads.

``open_beneath`` and ``open_parent_beneath`` are the primitives the rest is built
on, public for other users of a tree (the FUSE server that mounts volumes into
sandboxes): fds from them are the caller's to close.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat as st
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator

MAX_PATH = 4096            # bytes of a path given to a tree (Linux PATH_MAX)
MAX_DEPTH = 10             # list_dir depth, as E2B's volume service
MAX_LIST_ENTRIES = 100_000  # one listing answers at most this many entries (bounded memory)
DEFAULT_DIR_MODE = 0o777   # E2B's defaults for what a request creates without a mode
DEFAULT_FILE_MODE = 0o666
CHUNK = 1 << 20

_WALK = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
_PEEK = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_ONLY = os.O_CREAT | os.O_EXCL


def _err(code: int, message: str, path: str) -> OSError:
    return OSError(code, message, path)


def split_path(rel: str) -> list[str]:
    """The components of ``rel`` beneath a root ("" and "/" are the root: []).

    ``EINVAL`` for NUL, ``..``, a path over ``MAX_PATH`` bytes or one that is not
    a string; ``ENAMETOOLONG`` for a component over 255 bytes."""
    if not isinstance(rel, str):
        raise _err(errno.EINVAL, "a path must be a string", repr(rel)[:100])
    try:
        raw = rel.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise _err(errno.EINVAL, "the path is not valid UTF-8", rel[:100]) from None
    if len(raw) > MAX_PATH:
        raise _err(errno.EINVAL, f"the path is longer than {MAX_PATH} bytes", rel[:100])
    if "\x00" in rel:
        raise _err(errno.EINVAL, "the path contains a NUL byte", rel[:100].replace("\x00", "\\0"))
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    for p in parts:
        if p == "..":
            raise _err(errno.EINVAL, "the path may not contain '..'", rel[:200])
        if len(p.encode("utf-8", "surrogateescape")) > 255:
            raise _err(errno.ENAMETOOLONG, "a path component is longer than 255 bytes", rel[:200])
    return parts


def volume_path(parts: list[str]) -> str:
    """The absolute in-volume path of ``parts`` (``/`` for the root)."""
    return "/" + "/".join(parts)


def _proc(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _kind(mode: int) -> str:
    if st.S_ISDIR(mode):
        return "directory"
    if st.S_ISREG(mode):
        return "file"
    if st.S_ISLNK(mode):
        return "symlink"
    return "unknown"


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


@dataclass(frozen=True)
class Entry:
    """One file, directory or symlink as E2B's ``VolumeEntryStat`` describes it."""

    name: str
    type: str          # "file" | "directory" | "symlink" | "unknown"
    path: str          # absolute in the volume: /a/b
    size: int
    mode: int          # permission bits only (& 0o777), as E2B answers
    uid: int
    gid: int
    atime: float
    mtime: float
    ctime: float
    target: str | None = None   # a symlink's target text (never resolved)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "type": self.type, "path": self.path, "size": self.size,
                                  "mode": self.mode, "uid": self.uid, "gid": self.gid, "atime": _time(self.atime),
                                  "mtime": _time(self.mtime), "ctime": _time(self.ctime)}
        if self.target is not None:
            out["target"] = self.target
        return out


def _entry(parts: list[str], s: os.stat_result, target: str | None = None) -> Entry:
    return Entry(name=parts[-1] if parts else "/", type=_kind(s.st_mode), path=volume_path(parts),
                 size=s.st_size, mode=st.S_IMODE(s.st_mode) & 0o777, uid=s.st_uid, gid=s.st_gid,
                 atime=s.st_atime, mtime=s.st_mtime, ctime=s.st_ctime, target=target)


def _check_owner(uid: int | None, gid: int | None) -> None:
    for what, v in (("uid", uid), ("gid", gid)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 0xFFFFFFFF):
            raise _err(errno.EINVAL, f"{what} must be an integer in 0..4294967294", str(v))


def _check_mode(mode: int | None) -> None:
    if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777):
        raise _err(errno.EINVAL, "mode must be an integer in 0..0o7777", str(mode))


class VolumeTree:
    """Operations on the tree under ``root`` (an existing directory, itself trusted:
    the node made it). Paths are in-volume paths: ``/a/b``, ``a/b`` and ``a//b/``
    are the same entry; ``/`` and ``""`` are the root."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # ------------------------------------------------------------- primitives

    def _root_fd(self) -> int:
        return os.open(self.root, _WALK)

    def _walk(self, parts: list[str], rel: str, make: bool = False, uid: int | None = None,
              gid: int | None = None) -> int:
        """An ``O_PATH`` fd of the directory ``parts`` (each component a real
        directory, never a symlink). ``make``: create missing ones
        (``DEFAULT_DIR_MODE``, owned by ``uid``/``gid`` when given)."""
        fd = self._root_fd()
        try:
            for i, p in enumerate(parts):
                try:
                    nfd = os.open(p, _WALK, dir_fd=fd)
                except FileNotFoundError:
                    if not make:
                        raise _err(errno.ENOENT, "no such directory", volume_path(parts[:i + 1])) from None
                    self._mkdir_at(fd, p, DEFAULT_DIR_MODE, uid, gid, exist_ok=True)
                    nfd = os.open(p, _WALK, dir_fd=fd)
                except NotADirectoryError:
                    raise _err(errno.ENOTDIR, "a component of the path is not a directory (symlinks are never "
                                              "followed)", volume_path(parts[:i + 1])) from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _mkdir_at(self, dfd: int, name: str, mode: int, uid: int | None, gid: int | None,
                  exist_ok: bool = False) -> bool:
        """mkdir ``name`` in ``dfd`` and set its mode and owner through an fd of it; False
        when it already was a directory (``exist_ok``; untouched then)."""
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
        except FileExistsError:
            if not exist_ok:
                raise
            s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not st.S_ISDIR(s.st_mode):
                raise _err(errno.EEXIST if not st.S_ISLNK(s.st_mode) else errno.ENOTDIR,
                           "exists and is not a directory", name) from None
            return False
        fd = os.open(name, _WALK, dir_fd=dfd)
        try:
            self._set_meta(fd, uid, gid, mode)
        finally:
            os.close(fd)
        return True

    @staticmethod
    def _set_meta(fd: int, uid: int | None, gid: int | None, mode: int | None) -> None:
        """chown/chmod the inode of the ``O_PATH`` fd ``fd`` (never a symlink's target)."""
        if uid is not None or gid is not None:
            os.chown(_proc(fd), -1 if uid is None else uid, -1 if gid is None else gid)
        if mode is not None:
            os.chmod(_proc(fd), mode)    # after chown: chown clears setuid/setgid bits

    def open_parent_beneath(self, rel: str) -> tuple[int, str]:
        """``(dir_fd, name)``: an ``O_PATH`` fd of the directory that holds ``rel``'s
        final component, and that component (one name: never empty, ``.`` or ``..``).

        Use ``dir_fd`` with the ``*at`` calls (``os.stat(name, dir_fd=..,
        follow_symlinks=False)``, ``os.mkdir``, ``os.unlink``, ``os.rename`` with
        ``src_dir_fd``/``dst_dir_fd``, ``os.symlink``, ``os.readlink``); the name is
        not resolved, so it may be a symlink — pass ``follow_symlinks=False`` or
        ``O_NOFOLLOW`` on whatever you do with it. ``EINVAL`` for the root (it has no
        parent), ``ENOENT``/``ENOTDIR`` when the parent is missing or not a directory.
        The caller closes ``dir_fd``."""
        parts = split_path(rel)
        if not parts:
            raise _err(errno.EINVAL, "the volume root has no parent", "/")
        return self._walk(parts[:-1], rel), parts[-1]

    def open_beneath(self, rel: str, flags: int, mode: int = 0o644) -> int:
        """An fd of ``rel`` opened with ``flags`` (``os.O_RDONLY``, ``O_WRONLY |
        O_CREAT | O_TRUNC``, ``O_DIRECTORY``, ``O_PATH``...), never following a
        symlink anywhere in the path. ``mode`` is for a file ``O_CREAT`` makes.

        The final component: a symlink is ``ELOOP`` (unless ``O_PATH``, which gives
        an fd of the link itself); a FIFO, socket or device node is ``EINVAL``
        unless ``O_PATH`` (it is never opened for I/O, so opening cannot block or
        touch a device). ``O_CLOEXEC`` is always added. The caller closes the fd."""
        dfd, name = (self._root_fd(), "") if not split_path(rel) else self.open_parent_beneath(rel)
        try:
            return self._open_at(dfd, name, flags, mode, rel)
        finally:
            os.close(dfd)

    def _open_at(self, dfd: int, name: str, flags: int, mode: int, rel: str) -> int:
        if name == "":       # the root itself: dfd is its O_PATH fd
            pfd = os.dup(dfd)
        else:
            if flags & _CREATE_ONLY == _CREATE_ONLY:
                # a fresh file: O_EXCL never follows a symlink (EEXIST) and never opens a FIFO
                return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
            try:
                pfd = os.open(name, _PEEK, dir_fd=dfd)
            except FileNotFoundError:
                if not flags & os.O_CREAT:
                    raise _err(errno.ENOENT, "no such file or directory", rel) from None
                try:
                    return os.open(name, flags | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
                except FileExistsError:   # made meanwhile: open it as an existing entry
                    pfd = os.open(name, _PEEK, dir_fd=dfd)
        try:
            if flags & os.O_PATH:
                fd, pfd = pfd, -1
                return fd
            s = os.fstat(pfd)
            if st.S_ISLNK(s.st_mode):
                raise _err(errno.ELOOP, "is a symlink (symlinks in volumes are never followed)", rel)
            if not (st.S_ISREG(s.st_mode) or st.S_ISDIR(s.st_mode)):
                raise _err(errno.EINVAL, "is not a regular file or directory", rel)
            if st.S_ISDIR(s.st_mode) and flags & (os.O_WRONLY | os.O_RDWR):
                raise _err(errno.EISDIR, "is a directory", rel)
            if flags & os.O_DIRECTORY and not st.S_ISDIR(s.st_mode):
                raise _err(errno.ENOTDIR, "is not a directory", rel)
            # the same inode, reopened for I/O: no name is resolved again
            return os.open(_proc(pfd), (flags & ~(os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)) | os.O_CLOEXEC)
        finally:
            if pfd >= 0:
                os.close(pfd)

    # ------------------------------------------------------------- queries

    def get_info(self, rel: str) -> Entry:
        """The entry at ``rel`` (a symlink as a symlink). ``ENOENT`` when missing."""
        parts = split_path(rel)
        if not parts:
            fd = self._root_fd()
            try:
                return _entry(parts, os.fstat(fd))
            finally:
                os.close(fd)
        dfd = self._walk(parts[:-1], rel)
        try:
            return self._entry_at(dfd, parts)
        finally:
            os.close(dfd)

    stat = get_info

    @staticmethod
    def _entry_at(dfd: int, parts: list[str]) -> Entry:
        name = parts[-1]
        try:
            s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise _err(errno.ENOENT, "no such file or directory", volume_path(parts)) from None
        target = None
        if st.S_ISLNK(s.st_mode):
            try:
                target = os.readlink(name, dir_fd=dfd)
            except OSError:
                target = ""
        return _entry(parts, s, target)

    def exists(self, rel: str) -> bool:
        try:
            self.get_info(rel)
        except FileNotFoundError:
            return False
        return True

    def list_dir(self, rel: str, depth: int = 1) -> list[Entry]:
        """The entries under the directory ``rel``, each directory's followed by its own
        down to ``depth`` levels (1..``MAX_DEPTH``), by name. Symlinked directories are
        listed as symlinks, never entered. ``E2BIG`` past ``MAX_LIST_ENTRIES``."""
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
            raise _err(errno.EINVAL, f"depth must be in 1..{MAX_DEPTH}", str(depth))
        parts = split_path(rel)
        fd = self.open_beneath(rel, os.O_RDONLY | os.O_DIRECTORY)
        out: list[Entry] = []
        try:
            self._list(fd, parts, depth, out)
        finally:
            os.close(fd)
        return out

    def _list(self, fd: int, parts: list[str], depth: int, out: list[Entry]) -> None:
        for name in sorted(os.listdir(fd)):
            try:
                e = self._entry_at(fd, parts + [name])
            except FileNotFoundError:   # removed while we list
                continue
            if len(out) >= MAX_LIST_ENTRIES:
                raise _err(errno.E2BIG, f"more than {MAX_LIST_ENTRIES} entries: list a smaller depth or directory",
                           volume_path(parts))
            out.append(e)
            if e.type == "directory" and depth > 1:
                try:
                    cfd = self._open_at(fd, name, os.O_RDONLY | os.O_DIRECTORY, 0, volume_path(parts + [name]))
                except OSError as err:
                    if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EINVAL):
                        continue        # swapped or removed meanwhile
                    raise
                try:
                    self._list(cfd, parts + [name], depth - 1, out)
                finally:
                    os.close(cfd)

    # ------------------------------------------------------------- files

    def open_read(self, rel: str) -> tuple[int, int]:
        """``(fd, size)`` of the regular file ``rel`` for reading. ``EISDIR`` for a
        directory, ``ELOOP`` for a symlink, ``EINVAL`` for anything else."""
        fd = self.open_beneath(rel, os.O_RDONLY)
        try:
            s = os.fstat(fd)
            if st.S_ISDIR(s.st_mode):
                raise _err(errno.EISDIR, "is a directory", rel)
        except BaseException:
            os.close(fd)
            raise
        return fd, s.st_size

    def read_file(self, rel: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """The file's bytes in chunks of at most ``chunk`` (opened before the first one)."""
        fd, _ = self.open_read(rel)

        def chunks() -> Iterator[bytes]:
            try:
                while data := os.read(fd, chunk):
                    yield data
            finally:
                os.close(fd)
        return chunks()

    def open_write(self, rel: str, force: bool = False, mode: int | None = None, uid: int | None = None,
                   gid: int | None = None) -> int:
        """An fd to write the file ``rel`` into. Without ``force`` the file must not
        exist (``EEXIST``) and its directory must (``ENOENT``); with ``force``
        missing parent directories are made (owned by ``uid``/``gid``) and an
        existing file is truncated. A symlink there is ``EEXIST`` without force and
        ``ELOOP`` with it: never written through. Finish with ``finish_write``."""
        _check_mode(mode)
        _check_owner(uid, gid)
        parts = split_path(rel)
        if not parts:
            raise _err(errno.EISDIR, "the volume root is a directory", "/")
        dfd = self._walk(parts[:-1], rel, make=force, uid=uid, gid=gid)
        try:
            flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
            try:
                return self._open_at(dfd, parts[-1], flags, DEFAULT_FILE_MODE if mode is None else mode & 0o777,
                                     volume_path(parts))
            except FileExistsError:
                raise _err(errno.EEXIST, "already exists (write with force to replace it)",
                           volume_path(parts)) from None
        finally:
            os.close(dfd)

    def write_chunk(self, fd: int, data: bytes) -> None:
        """Write all of ``data`` at ``fd``'s position (an fd from ``open_write``)."""
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def finish_write(self, fd: int, rel: str, mode: int | None = None, uid: int | None = None,
                     gid: int | None = None) -> Entry:
        """Sync, set owner and mode through ``fd``, close it; the written entry."""
        try:
            os.fsync(fd)
            # as E2B: the mode asked for, else the default, whether the file is new or not
            self._set_meta(fd, uid, gid, DEFAULT_FILE_MODE if mode is None else mode)
            s = os.fstat(fd)
        finally:
            os.close(fd)
        return _entry(split_path(rel), s)

    def write_file(self, rel: str, data: bytes | Iterable[bytes], force: bool = False, mode: int | None = None,
                   uid: int | None = None, gid: int | None = None) -> Entry:
        """``open_write``, every chunk of ``data``, ``finish_write``."""
        fd = self.open_write(rel, force, mode, uid, gid)
        try:
            for chunk in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data):
                self.write_chunk(fd, bytes(chunk))
        except BaseException:
            os.close(fd)
            raise
        return self.finish_write(fd, rel, mode, uid, gid)

    # ------------------------------------------------------------- directories

    def make_dir(self, rel: str, force: bool = False, mode: int | None = None, uid: int | None = None,
                 gid: int | None = None) -> Entry:
        """mkdir ``rel``. Without ``force`` its parent must exist (``ENOENT``) and it must
        not (``EEXIST``); with ``force`` parents are made and an existing directory is
        answered as it is (anything else there is ``EEXIST``)."""
        _check_mode(mode)
        _check_owner(uid, gid)
        parts = split_path(rel)
        if not parts:
            if force:
                return self.get_info("/")
            raise _err(errno.EEXIST, "the volume root exists", "/")
        dfd = self._walk(parts[:-1], rel, make=force, uid=uid, gid=gid)
        try:
            try:
                self._mkdir_at(dfd, parts[-1], DEFAULT_DIR_MODE if mode is None else mode, uid, gid, exist_ok=force)
            except FileExistsError:
                raise _err(errno.EEXIST, "already exists", volume_path(parts)) from None
            except NotADirectoryError:
                raise _err(errno.ENOTDIR, "exists and is not a directory", volume_path(parts)) from None
            return self._entry_at(dfd, parts)
        finally:
            os.close(dfd)

    def remove(self, rel: str) -> None:
        """Remove the file, symlink (not its target) or directory (recursively) at
        ``rel``. ``ENOENT`` when missing, ``EINVAL`` for the root."""
        parts = split_path(rel)
        if not parts:
            raise _err(errno.EINVAL, "the volume root cannot be removed", "/")
        dfd = self._walk(parts[:-1], rel)
        try:
            name = parts[-1]
            try:
                s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise _err(errno.ENOENT, "no such file or directory", volume_path(parts)) from None
            if st.S_ISDIR(s.st_mode):
                # fd-based on Linux (shutil.rmtree.avoids_symlink_attacks): never leaves the tree
                shutil.rmtree(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)

    def update_metadata(self, rel: str, uid: int | None = None, gid: int | None = None,
                        mode: int | None = None) -> Entry:
        """Set owner and/or mode of ``rel``. A symlink's owner can be set (never its
        target's); its mode cannot (``ELOOP``)."""
        _check_mode(mode)
        _check_owner(uid, gid)
        parts = split_path(rel)
        fd = self.open_beneath(rel, os.O_PATH)
        try:
            s = os.fstat(fd)
            if st.S_ISLNK(s.st_mode):
                if mode is not None:
                    raise _err(errno.ELOOP, "a symlink has no mode of its own to set", rel)
                if uid is not None or gid is not None:
                    dfd, name = self.open_parent_beneath(rel)
                    try:
                        os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid, dir_fd=dfd,
                                 follow_symlinks=False)
                        s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        return _entry(parts, s, os.readlink(name, dir_fd=dfd))
                    finally:
                        os.close(dfd)
                return self.get_info(rel)
            if not (st.S_ISREG(s.st_mode) or st.S_ISDIR(s.st_mode)):
                raise _err(errno.EINVAL, "is not a regular file or directory", rel)
            self._set_meta(fd, uid, gid, mode)
            return _entry(parts, os.fstat(fd))
        finally:
            os.close(fd)

    patch = update_metadata
