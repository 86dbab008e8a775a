"""Durable local file writes: the tmp -> fsync -> rename -> fsync-dir dance.

Used by the posix_fs backend (and anything else that must survive a crash of
the process or the host). A reader of the final name sees the old file, the
new file, or nothing; never a prefix."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

# Temp files start with a dot: repository keys never do, so listing skips them.
TMP_PREFIX = ".tmp-"


def tmp_name(directory: Path) -> Path:
    return directory / f"{TMP_PREFIX}{uuid.uuid4().hex}"


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(directory: Path, root: Path) -> None:
    """mkdir -p ``directory`` (inside ``root``), fsyncing each parent whose entry
    was created so a new directory survives a crash too."""
    if directory.is_dir():
        return
    missing: list[Path] = []
    d = directory
    while not d.is_dir():
        missing.append(d)
        if d == root or d.parent == d:
            break
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsync_dir(d.parent)


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_tmp(directory: Path, data: bytes | memoryview) -> Path:
    """Write ``data`` to a new fsynced temp file in ``directory``."""
    path = tmp_name(directory)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def copy_tmp(directory: Path, source: Path) -> Path:
    """Copy the file ``source`` to a new fsynced temp file in ``directory``
    (kernel-side copy where available)."""
    path = tmp_name(directory)
    src = os.open(source, os.O_RDONLY)
    try:
        dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            remaining = os.fstat(src).st_size
            offset = 0
            while remaining > 0:
                try:
                    n = os.copy_file_range(src, dst, remaining, offset)
                except OSError:
                    n = 0
                if n == 0:  # unsupported across filesystems or a short file: fall back
                    buf = os.pread(src, min(remaining, 8 << 20), offset)
                    if not buf:
                        break
                    write_all(dst, buf)
                    n = len(buf)
                offset += n
                remaining -= n
            os.fsync(dst)
        except BaseException:
            os.close(dst)
            path.unlink(missing_ok=True)
            raise
        os.close(dst)
    finally:
        os.close(src)
    return path


def replace_durably(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_file_durable(final: Path, data: bytes | memoryview) -> None:
    """Atomically replace ``final`` with ``data`` (parent directory must exist)."""
    tmp = write_tmp(final.parent, data)
    try:
        replace_durably(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
