"""EntryInfo records (filesystem.proto) built from stat results."""

from __future__ import annotations

import datetime
import errno
import os
import stat

from . import metadata, users
from .connect import Code, ConnectError
from .rpc import Message

FILE = "FILE_TYPE_FILE"
DIRECTORY = "FILE_TYPE_DIRECTORY"


def _rfc3339(ts: float) -> str:
    dt = datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _type(mode: int) -> str | None:
    if stat.S_ISDIR(mode):
        return DIRECTORY
    if stat.S_ISREG(mode):
        return FILE
    return None


def entry_info(path: str) -> Message:
    """EntryInfo of ``path`` itself (a symlink is described, not followed, but
    its ``type`` and ``mode`` are the target's and ``symlinkTarget`` the resolved
    target, as E2B's envd reports; no ``isSymlink``: the SDK would then call it
    SYMLINK, which E2B's envd never makes it do)."""
    st = os.lstat(path)
    info: Message = {
        "name": os.path.basename(path) or path,
        "path": path,
        "size": str(st.st_size),
        "mode": stat.S_IMODE(st.st_mode),
        "permissions": stat.filemode(st.st_mode),
        "owner": users.user_name(st.st_uid),
        "group": users.group_name(st.st_gid),
        "modifiedTime": _rfc3339(st.st_mtime),
    }
    kind = _type(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        # The target is resolved link by link (readlink, as Go's EvalSymlinks) and then
        # stat'ed by its resolved path: following the link itself would be refused in a
        # sticky world-writable directory (/tmp) for a link another user owns
        # (fs.protected_symlinks), even to root. A link that resolves to nothing is
        # its own target, of no type (E2B's envd: FILE_TYPE_UNSPECIFIED).
        try:
            target = os.path.realpath(path, strict=True)
            tst = os.stat(target)
            kind, info["mode"] = _type(tst.st_mode), stat.S_IMODE(tst.st_mode)
            info["symlinkTarget"] = target
        except OSError:
            kind, info["mode"] = None, 0
            info["symlinkTarget"] = path
    info["type"] = kind or "FILE_TYPE_UNSPECIFIED"
    meta = metadata.read(path)
    if meta:
        info["metadata"] = meta
    if not info["mode"]:
        del info["mode"]
    return info


def os_error(e: OSError, path: str) -> ConnectError:
    """Map an errno to the Connect code upstream envd uses for it."""
    if e.errno == errno.ENOENT:
        return ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ConnectError(Code.PERMISSION_DENIED, f"permission denied for '{path}': {e.strerror}")
    if e.errno == errno.ENOTDIR:
        return ConnectError(Code.INVALID_ARGUMENT, f"path '{path}': a component is not a directory")
    if e.errno == errno.EEXIST:
        return ConnectError(Code.ALREADY_EXISTS, f"path '{path}' already exists")
    if e.errno == errno.ENOSPC:
        return ConnectError(Code.RESOURCE_EXHAUSTED, "not enough disk space available")
    return ConnectError(Code.INTERNAL, f"error on '{path}': {e.strerror or e}")
