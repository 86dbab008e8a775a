"""A power-cut simulator for the crash tests: what survives a host crash is what
was fsynced, nothing else.

Approach (docs/snapshots.md, "Crash safety of a pause"): record the fsyncs of
the process under test and rebuild the durable state from them. No FUSE layer
and no device-mapper: the fsync calls are observed, the writes are not. At each
``os.fsync``/``os.fdatasync`` of the process (patched by ``install``) the file's
*current* content is copied aside (whoever wrote it: this process, QEMU, a C
library), and an fsync of a directory records its entries (name -> inode). At
the "crash" (SIGKILL of the process, its QEMUs die with it) ``rebuild`` makes a
new tree from a checkpoint taken before the process started plus that log:

* a directory holds the entries of its last fsync, else those of the checkpoint,
  else (made since and never fsynced) nothing;
* a file holds the content of its inode's last fsync, else its checkpoint
  content, else (created since and never fsynced) nothing: an empty file.

So a write, a create, a rename or an unlink that no fsync made durable is
undone, as on a host whose page cache was lost (stricter than ext4, which
commits metadata on its own every few seconds).

Not covered, precisely:
* fsyncs made by other processes or by C code inside this one are not seen.
  LMDB files (``*.mdb``) are taken as they are at the crash: the sandbox
  records' LMDB fsyncs each (``sync=True``) transaction itself before the
  commit returns; the node cache's LMDB does not, but the cache empties itself
  after a reboot (the test gives each restart a new boot id), so its state at
  the crash is never used. QEMU fsyncs nothing a pause depends on: its
  device state goes through a ``.raw`` file the node reads back and writes itself,
  its disk writes go to the node's NBD server, its memory is read by the node.
* a file that existed at the checkpoint and was changed in place since without
  an fsync cannot be given its checkpoint content back (the checkpoint keeps
  hard links, not copies): it keeps its content at the crash, and ``rebuild``
  names each such file (``Rebuilt.kept``) so a test can see that none matters.
* an fsync's copy is taken after the fsync returned: a process killed between
  the two counts as killed just before the fsync returned.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

TRUSTED_SUFFIX = ".mdb"    # LMDB: durable at each synchronous commit (see above)
ENV_LOG = "AENV_POWERCUT_LOG"
ENV_ROOTS = "AENV_POWERCUT_ROOTS"


# ------------------------------------------------------------------ in the process under test
class Recorder:
    """Wraps ``os.fsync``/``os.fdatasync``; each call under ``roots`` leaves a log entry."""

    def __init__(self, roots: list[Path], log: Path) -> None:
        self.roots = [str(r.resolve()) for r in roots]
        self.log = log
        self.data = log / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self._lock = threading.Lock()
        self._fsync = os.fsync
        self._fdatasync = os.fdatasync

    def install(self) -> None:
        def fsync(fd: int) -> None:
            self._fsync(fd)
            self.record(fd)

        def fdatasync(fd: int) -> None:
            self._fdatasync(fd)
            self.record(fd)
        os.fsync = fsync            # type: ignore[assignment]
        os.fdatasync = fdatasync    # type: ignore[assignment]

    def _under(self, path: str) -> bool:
        return any(path == r or path.startswith(r + "/") for r in self.roots)

    def record(self, fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if not self._under(path):
            return
        st = os.fstat(fd)
        with self._lock:
            self._n += 1
            n = self._n
        entry: dict[str, object] = {"n": n, "ino": st.st_ino, "path": path}
        if stat.S_ISDIR(st.st_mode):
            entry["kind"] = "d"
            entry["entries"] = listing(Path(path))
        elif stat.S_ISREG(st.st_mode):
            entry["kind"] = "f"
            rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)   # the fsynced fd may be write-only
            try:
                copy_sparse(rfd, self.data / str(n))
            finally:
                os.close(rfd)
            # Pinned (a link to the inode itself): its number, the key of this content, is never
            # reused by another file while the log lives. A file already unlinked has no name a
            # durable directory could hold: its content is not recorded.
            if not pin(fd, self.data / f"pin-{st.st_ino}"):
                return
        else:
            return
        # the entry counts only once complete: a kill while copying loses it (= before the fsync returned)
        tmp = self.log / f".{n}.tmp"
        tmp.write_text(json.dumps(entry))
        os.rename(tmp, self.log / f"{n:08d}.json")


_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000


def pin(fd: int, dst: Path) -> bool:
    """Link the open file ``fd`` at ``dst`` (linkat AT_EMPTY_PATH: needs root, as these
    tests run; a link through /proc/self/fd fails across the proc mount). False when
    the file has no link left."""
    if _libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(dst), _AT_EMPTY_PATH) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:      # fsynced before: pinned already
        return True
    if err == errno.ENOENT:      # unlinked
        return False
    raise OSError(err, f"pin {dst}: {os.strerror(err)}")


def install_from_env() -> None:
    """Called by a driver process first thing: record if the test asked for it."""
    log = os.environ.get(ENV_LOG)
    if log:
        Recorder([Path(r) for r in os.environ[ENV_ROOTS].split(":")], Path(log)).install()


def copy_sparse(src_fd: int, dst: Path) -> None:
    """Copy the file ``src_fd`` to ``dst`` keeping its holes (a disk's upper layer
    is a sparse file of the disk's size)."""
    size = os.fstat(src_fd).st_size
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        off = 0
        while off < size:
            try:
                start = os.lseek(src_fd, off, os.SEEK_DATA)
            except OSError:      # ENXIO: only a hole is left
                break
            end = os.lseek(src_fd, start, os.SEEK_HOLE)
            pos = start
            while pos < end:
                n = os.copy_file_range(src_fd, out, end - pos, pos, pos)
                if n == 0:
                    break
                pos += n
            off = end
        os.ftruncate(out, size)
    finally:
        os.close(out)


def listing(d: Path) -> dict[str, list]:
    """name -> [kind, inode, mode, uid, gid, symlink target]; sockets and fifos are left out
    (they do not outlive their process)."""
    out: dict[str, list] = {}
    with os.scandir(d) as it:
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                kind = "d"
            elif stat.S_ISREG(st.st_mode):
                kind = "f"
            elif stat.S_ISLNK(st.st_mode):
                kind = "l"
            else:
                continue
            target = os.readlink(e.path) if kind == "l" else ""
            out[e.name] = [kind, st.st_ino, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, target]
    return out


# ------------------------------------------------------------------ in the test
@dataclass
class Checkpoint:
    """The state of ``roots`` taken as durable (nothing writes them meanwhile): every
    directory's entries and every file, hard-linked under ``log/base``."""
    roots: list[Path]
    log: Path
    dirs: dict[str, dict[str, list]] = field(default_factory=dict)     # by path: dir inodes are reused
    files: dict[int, tuple[int, int]] = field(default_factory=dict)    # inode -> (size, mtime_ns)

    @classmethod
    def take(cls, roots: list[Path], log: Path) -> "Checkpoint":
        if log.exists():
            shutil.rmtree(log)
        (log / "base").mkdir(parents=True)
        roots = [r.resolve() for r in roots]
        cp = cls(roots, log)
        for r in roots:
            cp._walk(r, r.stat().st_dev)
        return cp

    def _walk(self, d: Path, dev: int) -> None:
        st = d.stat()
        if st.st_dev != dev:     # a mount point (a dead node's FUSE mount): not ours
            return
        entries = listing(d)
        self.dirs[str(d)] = entries
        for name, (kind, ino, *_rest) in entries.items():
            p = d / name
            if kind == "d":
                self._walk(p, dev)
            elif kind == "f" and ino not in self.files:
                fst = p.stat()
                self.files[ino] = (fst.st_size, fst.st_mtime_ns)
                os.link(p, self.log / "base" / str(ino))

    def env(self) -> dict[str, str]:
        """Environment for the process to record (see ``install_from_env``)."""
        return {ENV_LOG: str(self.log / "fsyncs"), ENV_ROOTS: ":".join(str(r) for r in self.roots)}


@dataclass
class Rebuilt:
    files: int
    fsyncs: int
    lost: int                                       # names made durable whose data never was: empty
    discarded: int = 0                              # files of the crash's tree missing or different after it
    kept: list[str] = field(default_factory=list)   # changed in place since the checkpoint, no fsync (see the docstring)


def detach_mounts(root: Path) -> None:
    """Lazily unmount whatever a killed process left mounted under ``root``."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


def sizes(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with contextlib.suppress(OSError):
                st = os.lstat(p)
                if stat.S_ISREG(st.st_mode):
                    out[os.path.relpath(p, root)] = st.st_size
    return out


def differing(crashed: Path, durable: Path) -> int:
    """Files of ``crashed`` the rebuild left out or gave another size."""
    after = sizes(durable)
    return sum(1 for p, n in sizes(crashed).items() if after.get(p) != n)


def rebuild(cp: Checkpoint) -> Rebuilt:
    """Replace each root by its durable state (the process that wrote it must be dead)."""
    flog = cp.log / "fsyncs"
    dirs = dict(cp.dirs)
    content: dict[int, Path] = {}
    entries = sorted(flog.glob("*.json")) if flog.is_dir() else []
    for f in entries:
        e = json.loads(f.read_text())
        if e["kind"] == "d":
            dirs[e["path"]] = e["entries"]
        else:
            content[e["ino"]] = flog / "data" / str(e["n"])
    out = Rebuilt(0, len(entries), 0)
    linked: dict[int, Path] = {}    # hard links stay hard links

    def place(dst: Path, ino: int, rel: str) -> None:
        if ino in linked:
            os.link(linked[ino], dst)
        elif ino in content:
            os.link(content[ino], dst)
        elif ino in cp.files:
            base = cp.log / "base" / str(ino)
            bst = base.stat()
            if (bst.st_size, bst.st_mtime_ns) != cp.files[ino] and not dst.name.endswith(TRUSTED_SUFFIX):
                out.kept.append(rel)
            os.link(base, dst)
        else:                       # created since the checkpoint, never fsynced: its data is gone
            dst.touch()
            out.lost += 1
        linked[ino] = dst
        out.files += 1

    def build(dst: Path, path: str, rel: str) -> None:
        for name, (kind, child, mode, uid, gid, target) in dirs.get(path, {}).items():
            p = dst / name
            if kind == "d":
                p.mkdir()
                build(p, f"{path}/{name}", f"{rel}/{name}")
            elif kind == "l":
                os.symlink(target, p)
                continue
            else:
                place(p, child, f"{rel}/{name}")
            os.chown(p, uid, gid, follow_symlinks=False)
            os.chmod(p, mode)

    for root in cp.roots:
        detach_mounts(root)
        new = root.with_name(root.name + ".durable")
        if new.exists():
            shutil.rmtree(new)
        new.mkdir()
        shutil.copystat(root, new)
        build(new, str(root), root.name)
        out.discarded += differing(root, new)
        old = root.with_name(root.name + ".crashed")
        os.rename(root, old)
        os.rename(new, root)
        shutil.rmtree(old, ignore_errors=True)
    return out
