"""posix_fs: a repository in a local (or shared, POSIX-semantics) directory.

Every write is tmp -> fsync -> rename/link -> fsync dir (aenv_store.durable), so
a crash leaves either the old object, the new one, or nothing (plus perhaps a
dot-named temp file, which listing ignores and ``cleanup_tmp`` removes)."""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time
from pathlib import Path
from typing import BinaryIO, Iterator

from ... import durable
from ...errors import AlreadyExists, BackendError, Conflict, StoreNotFound
from .base import Backend, ObjectInfo, create_for_swap

_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*\Z")


def validate_key(key: str) -> str:
    """A key is '/'-separated segments of [A-Za-z0-9._-], none starting with '.'."""
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise ValueError(f"invalid object key {key!r}")
    for seg in key.split("/"):
        if not _SEGMENT.match(seg):
            raise ValueError(f"invalid object key {key!r} (segment {seg!r})")
    return key


def validate_prefix(prefix: str) -> str:
    if prefix == "":
        return prefix
    body = prefix[:-1] if prefix.endswith("/") else prefix
    validate_key(body if body else "x")
    return prefix


class PosixFsBackend(Backend):
    name = "posix_fs"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"PosixFsBackend({str(self.root)!r})"

    # -- helpers ---------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def _ensure_root(self) -> None:
        if not self.root.is_dir():
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise BackendError(f"cannot create repository directory {self.root}: {e.strerror}") from None

    def _prepare(self, key: str) -> Path:
        path = self._path(key)
        self._ensure_root()
        try:
            durable.ensure_dir(path.parent, self.root)
        except OSError as e:
            raise BackendError(f"{self.root}: cannot create directory for {key}: {e.strerror}") from None
        return path

    # -- Backend ---------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        path = self._prepare(key)
        try:
            durable.write_file_durable(path, data)
        except OSError as e:
            raise BackendError(f"{self.root}: put {key}: {e.strerror}") from None

    def put_file(self, key: str, path: Path) -> None:
        final = self._prepare(key)
        try:
            tmp = durable.copy_tmp(final.parent, Path(path))
            try:
                durable.replace_durably(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except FileNotFoundError:
            raise StoreNotFound(f"local file {path} not found") from None
        except OSError as e:
            raise BackendError(f"{self.root}: put {key}: {e.strerror}") from None

    def move_file(self, key: str, path: Path) -> None:
        """Like ``put_file`` but the local file is consumed: renamed into place when
        it is on the repository's filesystem (no copy), else copied and removed.
        Used by the workspace for finished packs it will never touch again."""
        final = self._prepare(key)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(path, final)
        except FileNotFoundError:
            raise StoreNotFound(f"local file {path} not found") from None
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise BackendError(f"{self.root}: put {key}: {e.strerror}") from None
            self.put_file(key, path)
            Path(path).unlink(missing_ok=True)
            return
        try:
            durable.fsync_dir(final.parent)
        except OSError as e:
            raise BackendError(f"{self.root}: put {key}: {e.strerror}") from None

    def create(self, key: str, data: bytes) -> None:
        final = self._prepare(key)
        try:
            tmp = durable.write_tmp(final.parent, data)
        except OSError as e:
            raise BackendError(f"{self.root}: create {key}: {e.strerror}") from None
        try:
            # link() fails with EEXIST if the name exists: exactly one creator wins,
            # and the winner's file is complete (fsynced) before it gets its name.
            os.link(tmp, final)
        except FileExistsError:
            raise AlreadyExists(f"{key} already exists") from None
        except OSError as e:
            raise BackendError(f"{self.root}: create {key}: {e.strerror}") from None
        finally:
            tmp.unlink(missing_ok=True)
        try:
            durable.fsync_dir(final.parent)
        except OSError as e:
            raise BackendError(f"{self.root}: create {key}: {e.strerror}") from None

    def swap(self, key: str, data: bytes, expect: bytes | None) -> None:
        """Compare and replace under an exclusive ``flock`` of a hidden lock file next to
        the key (hidden names are never listed): every swapper of the key takes it, so
        the read, the compare and the rename are one step for them. (A plain ``put`` of
        the same key does not take it: records written by swap are written only by swap.)"""
        final = self._prepare(key)
        if expect is None:
            create_for_swap(self, key, data)
            return
        try:
            fd = os.open(final.parent / f".{final.name}.swap-lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise BackendError(f"{self.root}: swap {key}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = final.read_bytes()
            except FileNotFoundError:
                raise Conflict(f"{key} is gone (expected it to hold {len(expect)} bytes)") from None
            if current != expect:
                raise Conflict(f"{key} changed since it was read")
            durable.write_file_durable(final, data)
        except OSError as e:
            raise BackendError(f"{self.root}: swap {key}: {e.strerror}") from None
        finally:
            os.close(fd)        # and with it the lock

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            raise StoreNotFound(f"{key} not found in {self.root}") from None
        except IsADirectoryError:
            raise StoreNotFound(f"{key} is not an object in {self.root}") from None
        except OSError as e:
            raise BackendError(f"{self.root}: get {key}: {e.strerror}") from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise BackendError(f"get_range {key}: negative offset/length ({offset}, {length})")
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise StoreNotFound(f"{key} not found in {self.root}") from None
        except OSError as e:
            raise BackendError(f"{self.root}: get {key}: {e.strerror}") from None
        try:
            data = os.pread(fd, length, offset)
            if len(data) < length:  # pread may return short reads only at EOF for regular files
                more = [data]
                got = len(data)
                while got < length:
                    chunk = os.pread(fd, length - got, offset + got)
                    if not chunk:
                        break
                    more.append(chunk)
                    got += len(chunk)
                data = b"".join(more)
                if len(data) < length:
                    raise BackendError(f"{key}: range [{offset}, {offset + length}) is outside the object "
                                       f"({offset + len(data)} bytes)")
            return data
        except OSError as e:
            raise BackendError(f"{self.root}: read {key}: {e.strerror}") from None
        finally:
            os.close(fd)

    def open_stream(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise StoreNotFound(f"{key} not found in {self.root}") from None
        except OSError as e:
            raise BackendError(f"{self.root}: open {key}: {e.strerror}") from None

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise StoreNotFound(f"{key} not found in {self.root}") from None
        except OSError as e:
            raise BackendError(f"{self.root}: stat {key}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise StoreNotFound(f"{key} is not an object in {self.root}")
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        # Walk only the deepest directory the prefix names fully.
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        if not start.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                key = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted while listing
                    continue
                yield ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            if e.errno == errno.EISDIR:
                raise BackendError(f"{key} is a directory in {self.root}") from None
            raise BackendError(f"{self.root}: delete {key}: {e.strerror}") from None
        try:
            durable.fsync_dir(path.parent)
        except OSError:
            pass

    def cleanup_tmp(self, older_than: float = 3600.0) -> int:
        """Remove temp files left by crashed writers (older than ``older_than`` s)."""
        removed = 0
        cutoff = time.time() - older_than
        if not self.root.is_dir():
            return 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith(durable.TMP_PREFIX):
                    p = Path(dirpath) / name
                    try:
                        if p.stat().st_mtime < cutoff:
                            p.unlink()
                            removed += 1
                    except FileNotFoundError:
                        pass
        return removed
