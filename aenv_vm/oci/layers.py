"""Apply image layers (tar, gzip- or zstd-compressed, or plain) in order onto a
root directory: what an overlay filesystem would show, flattened.

Every layer is treated as hostile. Entry names are split into components;
``..`` in a name is refused, a leading ``/`` is dropped. Parent directories are
resolved inside the root as a chroot would (a symlink met on the way is
followed *inside* the root: an absolute target starts again at the root, ``..``
stops at it), by walking directory file descriptors opened with ``O_NOFOLLOW``,
so no entry — through ``..``, an absolute path, a symlink in its path, a
hardlink or a symlink later replaced by a directory — can create, change or
link anything outside the root. The final component is never followed: a
file replaces whatever is there (a symlink is removed, not written through).

OCI/AUFS whiteouts: ``.wh.NAME`` removes NAME of the layers below;
``.wh..wh..opq`` makes its directory opaque: everything below it that this
layer did not itself put there is removed (as containerd does). Device nodes
are skipped with a note (an image is a root filesystem for a VM, whose devtmpfs
provides /dev; creating device nodes on the host would be a hazard).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO, Callable, Iterable

from aenv_store.diskfloor import DiskFloor, FloorReached

from .errors import BadImage, OciError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
MAX_SYMLINK_HOPS = 40
COPY_BUFFER = 1 << 20
# xattrs kept from layers: user data and file capabilities (ping, ...). Others
# (trusted.*, security.selinux, ...) belong to the machine that made the layer.
KEPT_XATTR_PREFIXES = ("user.", "security.capability")

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class ApplyStats:
    """What applying layers did; ``notes`` are things skipped or not kept, once each."""

    entries: int = 0
    files: int = 0
    bytes: int = 0
    whiteouts: int = 0
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes and len(self.notes) < 50:
            self.notes.append(text)


class _HashingReader(io.RawIOBase):
    """Passes a stream through, hashing what was read (the layer's DiffID)."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buf: WriteableBuffer) -> int:
        view = memoryview(buf).cast("B")
        data = self.inner.read(len(view))
        n = len(data)
        view[:n] = data
        self.sha.update(data)
        return n

    def drain(self) -> None:
        """Read to the end (tar streams may end before their compressed container does)."""
        while self.inner.read(COPY_BUFFER):
            pass

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def open_layer_stream(f: BinaryIO) -> IO[bytes]:
    """The uncompressed tar stream of a layer file: gzip and zstd by their magic
    numbers (media types lie more often than magic numbers), else the file as is."""
    head = f.read(4)
    f.seek(0)
    if head.startswith(GZIP_MAGIC):
        import gzip
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]  # a binary reader
    if head.startswith(ZSTD_MAGIC):
        import zstandard
        return zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
    return f


def _split(name: str, what: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise BadImage(f"{what}: {name!r} has a '..' component (refused: it would leave the image root)")
    if any("\0" in p for p in parts):
        raise BadImage(f"{what}: {name!r} contains a NUL byte")
    return parts


class RootWriter:
    """Writes into one root directory, never outside it (see the module doc)."""

    def __init__(self, root: Path, stats: ApplyStats, floor: DiskFloor | None = None) -> None:
        """``floor``: what the root's filesystem keeps free; an entry that would go below
        it fails the flatten (``FloorReached``, ENOSPC) before it is written."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.root_fd = os.open(self.root, _DIR_FLAGS)
        self.stats = stats
        self.floor = floor if floor is not None else DiskFloor()
        self.can_chown = os.geteuid() == 0

    def close(self) -> None:
        os.close(self.root_fd)

    # -- resolution inside the root ------------------------------------------------

    def open_dir(self, parts: list[str], create: bool) -> int:
        """An fd of the directory ``parts`` names, resolved inside the root (symlinks on
        the way followed as a chroot would). Missing directories are made (0755) with
        ``create``, else FileNotFoundError. The caller closes the fd."""
        fds = [os.dup(self.root_fd)]
        pending = list(parts)
        hops = 0
        try:
            while pending:
                comp = pending.pop(0)
                if comp in ("", "."):
                    continue
                if comp == "..":
                    if len(fds) > 1:
                        os.close(fds.pop())
                    continue
                created = False
                try:
                    st = os.lstat(comp, dir_fd=fds[-1])
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(comp, 0o700, dir_fd=fds[-1])
                    st = os.lstat(comp, dir_fd=fds[-1])
                    created = True
                if stat.S_ISLNK(st.st_mode):
                    hops += 1
                    if hops > MAX_SYMLINK_HOPS:
                        raise BadImage(f"too many symbolic links resolving /{'/'.join(parts)}")
                    target = os.readlink(comp, dir_fd=fds[-1])
                    if target.startswith("/"):
                        while len(fds) > 1:
                            os.close(fds.pop())
                    pending[:0] = target.split("/")
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    raise BadImage(f"/{'/'.join(parts)}: a path component is not a directory")
                fds.append(os.open(comp, _DIR_FLAGS, dir_fd=fds[-1]))
                if created:                  # a parent the layer does not list: 0755, whatever the umask
                    os.fchmod(fds[-1], 0o755)
            result = fds.pop()
            return result
        finally:
            for fd in fds:
                os.close(fd)

    def remove(self, dir_fd: int, name: str) -> bool:
        """Remove ``name`` in ``dir_fd`` (a directory with everything in it; links are
        removed, never followed). False if there was nothing."""
        try:
            st = os.lstat(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                for child in os.listdir(sub):
                    self.remove(sub, child)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
        return True

    # -- metadata ----------------------------------------------------------------

    def _owner(self, fd: int | None, dir_fd: int, name: str, uid: int, gid: int) -> None:
        if not self.can_chown:
            if uid != os.geteuid() or gid != os.getegid():
                self.stats.note("file owners not kept: not running as root")
            return
        if fd is not None:
            os.fchown(fd, uid, gid)
        else:
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)

    def _xattrs(self, fd: int, member: tarfile.TarInfo) -> None:
        for key, value in member.pax_headers.items():
            if not key.startswith("SCHILY.xattr."):
                continue
            attr = key[len("SCHILY.xattr."):]
            if not attr.startswith(KEPT_XATTR_PREFIXES):
                self.stats.note(f"xattr {attr} not kept")
                continue
            raw = value.encode("utf-8", "surrogateescape")
            try:
                os.setxattr(fd, attr, raw)
            except OSError as e:
                self.stats.note(f"xattr {attr} not kept: {e.strerror}")

    # -- entries -----------------------------------------------------------------

    def write_entry(self, member: tarfile.TarInfo, data: IO[bytes] | None, written: set[tuple[str, ...]],
                    dirs: list[tuple[tuple[str, ...], tarfile.TarInfo]]) -> None:
        parts = _split(member.name, "layer entry")
        if not parts:                      # the root itself ("./"): keep its metadata for the end
            if member.isdir():
                dirs.append(((), member))
            return
        *parent, leaf = parts
        if leaf.startswith(WHITEOUT_PREFIX):
            self._whiteout(parent, leaf, written)
            return
        if member.ischr() or member.isblk():
            self.stats.note(f"device node /{'/'.join(parts)} skipped (and any other device nodes)")
            return
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk() or member.isfifo()):
            self.stats.note(f"entry /{'/'.join(parts)} of tar type {member.type!r} skipped")
            return
        self.floor.check(self.root, member.size if member.isfile() else 0, 1)
        pfd = self.open_dir(parent, create=True)
        try:
            self._write_leaf(pfd, tuple(parts), leaf, member, data, dirs)
        finally:
            os.close(pfd)
        # the entry and its parents count as this layer's (an opaque marker keeps them)
        for i in range(1, len(parts) + 1):
            written.add(tuple(parts[:i]))
        self.stats.entries += 1

    def _write_leaf(self, pfd: int, parts: tuple[str, ...], leaf: str, member: tarfile.TarInfo,
                    data: IO[bytes] | None, dirs: list[tuple[tuple[str, ...], tarfile.TarInfo]]) -> None:
        try:
            existing: os.stat_result | None = os.lstat(leaf, dir_fd=pfd)
        except FileNotFoundError:
            existing = None
        if member.isdir():
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                self.remove(pfd, leaf)
                existing = None
            if existing is None:
                os.mkdir(leaf, 0o700, dir_fd=pfd)
            fd = os.open(leaf, _DIR_FLAGS, dir_fd=pfd)
            try:
                self._owner(fd, pfd, leaf, member.uid, member.gid)
                os.fchmod(fd, member.mode & 0o7777)
                self._xattrs(fd, member)
            finally:
                os.close(fd)
            dirs.append((parts, member))     # mtime last: later entries inside change it
            return
        if existing is not None:
            self.remove(pfd, leaf)
        if member.islnk():
            self._hardlink(pfd, leaf, member)
            return
        if member.issym():
            os.symlink(member.linkname, leaf, dir_fd=pfd)
            self._owner(None, pfd, leaf, member.uid, member.gid)
            os.utime(leaf, ns=(int(member.mtime * 1e9),) * 2, dir_fd=pfd, follow_symlinks=False)
            return
        if member.isfifo():
            os.mkfifo(leaf, 0o600, dir_fd=pfd)
            fd = os.open(leaf, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        else:
            fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=pfd)
        try:
            if member.isfile() and data is not None:
                with os.fdopen(os.dup(fd), "wb", buffering=0) as out:
                    remaining = member.size
                    while remaining > 0:
                        buf = data.read(min(COPY_BUFFER, remaining))
                        if not buf:
                            raise BadImage(f"layer entry /{'/'.join(parts)}: truncated")
                        out.write(buf)
                        remaining -= len(buf)
                self.stats.files += 1
                self.stats.bytes += member.size
            self._owner(fd, pfd, leaf, member.uid, member.gid)
            os.fchmod(fd, member.mode & 0o7777)      # after chown, which clears set-id bits
            self._xattrs(fd, member)
            os.utime(fd, ns=(int(member.mtime * 1e9),) * 2)
        finally:
            os.close(fd)

    def _hardlink(self, pfd: int, leaf: str, member: tarfile.TarInfo) -> None:
        target = _split(member.linkname, "hardlink target")
        if not target:
            raise BadImage(f"hardlink {member.name!r} to the image root")
        *tparent, tleaf = target
        try:
            tfd = self.open_dir(tparent, create=False)
        except FileNotFoundError:
            raise BadImage(f"hardlink {member.name!r} -> {member.linkname!r}: target does not exist") from None
        try:
            try:
                st = os.lstat(tleaf, dir_fd=tfd)
            except FileNotFoundError:
                raise BadImage(f"hardlink {member.name!r} -> {member.linkname!r}: target does not exist") from None
            if stat.S_ISDIR(st.st_mode):
                raise BadImage(f"hardlink {member.name!r} -> {member.linkname!r}: target is a directory")
            os.link(tleaf, leaf, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(tfd)

    def _whiteout(self, parent: list[str], leaf: str, written: set[tuple[str, ...]]) -> None:
        try:
            pfd = self.open_dir(parent, create=False)
        except (FileNotFoundError, BadImage):
            return                           # no such directory below: nothing to hide
        try:
            if leaf == OPAQUE_MARKER:
                self._make_opaque(pfd, tuple(parent), written)
            else:
                name = leaf[len(WHITEOUT_PREFIX):]
                if name.startswith(WHITEOUT_PREFIX):       # AUFS bookkeeping (.wh..wh.plnk, ...)
                    self.stats.note(f"AUFS metadata {leaf} skipped")
                    return
                if name in ("", ".", ".."):
                    raise BadImage(f"bad whiteout {'/'.join(parent + [leaf])!r}")
                target = tuple(parent) + (name,)
                if target not in written:
                    if self.remove(pfd, name):
                        self.stats.whiteouts += 1
                    return
                # a whiteout hides the layers below only (OCI image spec): what this layer
                # put there stays; of a directory, only this layer's part of it stays
                self._strip_lower(pfd, name, target, written)
        finally:
            os.close(pfd)

    def _strip_lower(self, dfd: int, name: str, path: tuple[str, ...], written: set[tuple[str, ...]]) -> None:
        """If ``name`` (at ``path``) is a directory, make it opaque; anything else stays."""
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                self._make_opaque(sub, path, written)
            finally:
                os.close(sub)

    def _make_opaque(self, dfd: int, path: tuple[str, ...], written: set[tuple[str, ...]]) -> None:
        """Remove everything under ``path`` that this layer did not write."""
        for child in os.listdir(dfd):
            cpath = path + (child,)
            if cpath not in written:
                self.remove(dfd, child)
                self.stats.whiteouts += 1
            else:
                self._strip_lower(dfd, child, cpath, written)

    def finish_dirs(self, dirs: list[tuple[tuple[str, ...], tarfile.TarInfo]]) -> None:
        """Set directory mtimes once nothing more is written inside them (deepest first)."""
        for parts, member in sorted(dirs, key=lambda d: len(d[0]), reverse=True):
            try:
                fd = self.open_dir(list(parts), create=False)
            except (FileNotFoundError, BadImage):
                continue                     # removed or replaced later in the layer
            try:
                if not parts:
                    self._owner(fd, fd, ".", member.uid, member.gid)
                    os.fchmod(fd, member.mode & 0o7777)
                os.utime(fd, ns=(int(member.mtime * 1e9),) * 2)
            finally:
                os.close(fd)


def apply_layer(writer: RootWriter, f: BinaryIO, label: str, diff_id: str | None = None,
                on_bytes: Callable[[int], None] | None = None) -> str:
    """Apply one layer file (compressed or not) onto the writer's root; returns the
    sha256 of its uncompressed tar (its DiffID), checked against ``diff_id`` if given."""
    stream = _HashingReader(open_layer_stream(f))
    written: set[tuple[str, ...]] = set()
    dirs: list[tuple[tuple[str, ...], tarfile.TarInfo]] = []
    last = f.tell()
    try:
        with tarfile.open(fileobj=io.BufferedReader(stream, COPY_BUFFER), mode="r|") as tar:
            for member in tar:
                data = tar.extractfile(member) if member.isfile() else None
                try:
                    writer.write_entry(member, data, written, dirs)
                except FloorReached as e:
                    raise OciError(f"{label}: flattening the image stopped at {member.name!r}: {e}") from None
                except OSError as e:
                    raise BadImage(f"{label}: cannot apply {member.name!r}: {e.strerror or e}") from None
                if on_bytes is not None:
                    pos = f.tell()
                    on_bytes(pos - last)
                    last = pos
            stream.drain()
    except (tarfile.TarError, EOFError, ValueError) as e:
        raise BadImage(f"{label}: not a valid tar layer: {e}") from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OciError(f"{label}: no space left flattening the image under {writer.root}") from None
        raise BadImage(f"{label}: cannot read the layer: {e}") from None
    except Exception as e:
        # the decompressors raise their own classes (zstd.ZstdError, gzip.BadGzipFile)
        if type(e).__name__ in ("ZstdError", "BadGzipFile"):
            raise BadImage(f"{label}: corrupt compressed layer: {e}") from None
        raise
    writer.finish_dirs(dirs)
    if on_bytes is not None:
        on_bytes(f.tell() - last)
    got = "sha256:" + stream.hexdigest()
    if diff_id is not None and got != diff_id:
        raise BadImage(f"{label}: uncompressed content is {got}, the image config says {diff_id}")
    return got


def apply_layers(root: Path, layers: Iterable[tuple[Path, str, str | None]],
                 on_bytes: Callable[[int], None] | None = None, floor: DiskFloor | None = None) -> ApplyStats:
    """Apply ``(file, label, diff_id)`` layers bottom first onto ``root``, above ``floor``."""
    stats = ApplyStats()
    with contextlib.ExitStack() as files:
        # every layer file is opened first: a layer cache pruned by another pull meanwhile
        # can unlink a file, never take it from under this one
        opened = []
        for path, label, diff_id in layers:
            try:
                opened.append((files.enter_context(open(path, "rb")), label, diff_id))
            except FileNotFoundError:
                raise BadImage(f"{label}: layer file {path} is gone") from None
        writer = RootWriter(root, stats, floor)
        try:
            for f, label, diff_id in opened:
                apply_layer(writer, f, label, diff_id, on_bytes)
        finally:
            writer.close()
    return stats
