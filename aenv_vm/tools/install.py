"""Installing the guest tools into a flattened image root (docs/tools.md).

``install_tools(root, tools, image_path)`` makes any Linux root filesystem
bootable as a sandbox: the tools tree under ``/.aenv`` (root-owned, replacing
whatever the image had there), the directories the init mounts on, ``/bin/bash``
and ``/bin/sh`` when the image has no usable ones (links to the tools' static
bash and busybox), the sandbox user (accounts.py) with its home, and the
network files of the guest (hosts, resolv.conf, hostname).

The tree is the image's, so it is hostile: every path is resolved inside the
root the way the layer flattening resolves it (``RootWriter.open_dir``:
directory fds opened with ``O_NOFOLLOW``, symlinks followed as a chroot would),
a file is read through symlinks only inside the root, and a file written
replaces the final component (a symlink there is removed, never written
through). Nothing outside ``root`` is created, changed or read.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import VmError
from ..oci.errors import BadImage
from ..oci.layers import ApplyStats, RootWriter
from .accounts import AccountFiles, ensure_user
from .tree import TOOLS_DIR, ToolsTree

GUEST_HOSTNAME = "aenv"
HOSTS = (f"127.0.0.1\tlocalhost\n127.0.1.1\t{GUEST_HOSTNAME}\n"
         "::1\tlocalhost ip6-localhost ip6-loopback\n").encode()
RESOLV_CONF = b"nameserver 10.0.2.3\n"        # QEMU user-mode networking's DNS forwarder
MAX_ACCOUNT_FILE = 16 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_HOPS = 40
# Mount points of the init: (name, mode) made when missing; the first three must be
# real directories (the initramfs moves /dev onto the new root's /dev).
MOUNT_POINTS = (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("run", 0o755), ("tmp", 0o1777))
REAL_DIRS = ("proc", "sys", "dev")


class ToolsInstallError(VmError):
    """The tools could not be installed into the tree (the message says why)."""


@dataclass
class InstallReport:
    tools_key: str
    user_added: bool = False
    uid: int = 0
    gid: int = 0
    linked: list[str] = field(default_factory=list)     # /bin/bash, /bin/sh when linked to the tools'
    notes: list[str] = field(default_factory=list)


class _Root:
    """Path operations inside one root (see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.writer = RootWriter(root, ApplyStats())
        self.can_chown = os.geteuid() == 0

    def close(self) -> None:
        self.writer.close()

    def dir(self, parts: list[str]) -> int:
        return self.writer.open_dir(parts, create=True)

    def _leaf(self, parts: list[str]) -> tuple[int, str] | None:
        """(parent fd, name) of the final non-symlink object ``parts`` names, following
        symlinks inside the root; None when it does not exist (or loops)."""
        pending = list(parts)
        for _ in range(MAX_HOPS):
            *parent, name = pending
            try:
                pfd = self.writer.open_dir(parent, create=False)
            except (OSError, BadImage):          # a missing or non-directory parent
                return None
            try:
                st = os.lstat(name, dir_fd=pfd)
            except FileNotFoundError:
                os.close(pfd)
                return None
            if not stat.S_ISLNK(st.st_mode):
                return pfd, name
            target = os.readlink(name, dir_fd=pfd)
            os.close(pfd)
            pending = [p for p in (target.split("/") if target.startswith("/") else parent + target.split("/"))
                       if p not in ("", ".")]
            resolved: list[str] = []
            for p in pending:                  # ".." stops at the root, as in a chroot
                if p == "..":
                    if resolved:
                        resolved.pop()
                else:
                    resolved.append(p)
            pending = resolved
            if not pending:
                return None                    # the root itself
        return None

    def read(self, parts: list[str]) -> tuple[bytes, os.stat_result] | None:
        """Content and stat of a regular file, or None (missing, not a file, too large)."""
        found = self._leaf(parts)
        if found is None:
            return None
        pfd, name = found
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=pfd)
        except OSError:
            return None
        finally:
            os.close(pfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ACCOUNT_FILE:
                return None
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(MAX_ACCOUNT_FILE), st
        finally:
            os.close(fd)

    def is_program(self, parts: list[str]) -> bool:
        """A regular executable file (through symlinks inside the root) is there."""
        found = self._leaf(parts)
        if found is None:
            return False
        pfd, name = found
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            return stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)
        finally:
            os.close(pfd)

    def write(self, parts: list[str], data: bytes, mode: int, uid: int = 0, gid: int = 0) -> None:
        """Replace ``parts`` with a new regular file (tmp + rename in its directory)."""
        *parent, name = parts
        pfd = self.dir(parent)
        tmp = f".{name}.aenv-tmp"
        try:
            self.writer.remove(pfd, tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=pfd)
            try:
                with os.fdopen(os.dup(fd), "wb") as f:
                    f.write(data)
                if self.can_chown:
                    os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            try:
                if stat.S_ISDIR(os.lstat(name, dir_fd=pfd).st_mode):
                    self.writer.remove(pfd, name)
            except FileNotFoundError:
                pass
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        finally:
            os.close(pfd)

    def symlink(self, parts: list[str], target: str) -> None:
        *parent, name = parts
        pfd = self.dir(parent)
        try:
            self.writer.remove(pfd, name)
            os.symlink(target, name, dir_fd=pfd)
        finally:
            os.close(pfd)

    def ensure_dir(self, name: str, mode: int, real: bool) -> None:
        """A directory ``/name`` (made when missing; with ``real`` a non-directory there,
        a symlink included, is replaced)."""
        rfd = self.writer.root_fd
        try:
            st = os.lstat(name, dir_fd=rfd)
        except FileNotFoundError:
            st = None
        if st is not None and (stat.S_ISDIR(st.st_mode) or (not real and stat.S_ISLNK(st.st_mode))):
            return
        if st is not None:
            self.writer.remove(rfd, name)
        os.mkdir(name, 0o700, dir_fd=rfd)
        fd = os.open(name, _DIR, dir_fd=rfd)
        try:
            if self.can_chown:
                os.fchown(fd, 0, 0)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def make_home(self, home: str, uid: int, gid: int) -> bool:
        parts = [p for p in home.split("/") if p]
        *parent, name = parts
        pfd = self.dir(parent)
        try:
            try:
                os.lstat(name, dir_fd=pfd)
                return False                  # the image has something there: keep it
            except FileNotFoundError:
                pass
            os.mkdir(name, 0o700, dir_fd=pfd)
            fd = os.open(name, _DIR, dir_fd=pfd)
            try:
                if self.can_chown:
                    os.fchown(fd, uid, gid)
                os.fchmod(fd, 0o750)
            finally:
                os.close(fd)
            return True
        finally:
            os.close(pfd)

    def copy_tree(self, src: Path, name: str) -> None:
        """``src`` (the node's tools tree) as ``/name``, replacing whatever is there."""
        rfd = self.writer.root_fd
        self.writer.remove(rfd, name)
        os.mkdir(name, 0o700, dir_fd=rfd)
        fd = os.open(name, _DIR, dir_fd=rfd)
        try:
            self._copy_into(src, fd)
            self._own(fd, stat.S_IMODE(os.stat(src).st_mode))
        finally:
            os.close(fd)

    def _own(self, fd: int, mode: int) -> None:
        if self.can_chown:
            os.fchown(fd, 0, 0)
        os.fchmod(fd, mode)

    def _copy_into(self, src: Path, dfd: int) -> None:
        for entry in sorted(os.scandir(src), key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(entry.path), entry.name, dir_fd=dfd)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(entry.name, 0o700, dir_fd=dfd)
                sub = os.open(entry.name, _DIR, dir_fd=dfd)
                try:
                    self._copy_into(Path(entry.path), sub)
                    self._own(sub, stat.S_IMODE(st.st_mode))
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                out = os.open(entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=dfd)
                try:
                    with open(entry.path, "rb") as f:
                        while buf := f.read(1 << 20):
                            _write_all(out, buf)
                    self._own(out, stat.S_IMODE(st.st_mode))
                    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(out)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def install_tools(root: Path, tools: ToolsTree, image_path: str | None = None) -> InstallReport:
    """Install ``tools`` into the flattened image ``root`` (see the module doc).
    ``image_path``: the image config's PATH, which the init gives envd and so every
    command (None: the standard one)."""
    if not tools.exists():
        raise ToolsInstallError(f"the guest tools tree {tools.path} is missing (rebuild the guest: "
                                "python3 fixtures/build_guest.py)")
    report = InstallReport(tools.key)
    r = _Root(Path(root))
    try:
        r.copy_tree(tools.path, TOOLS_DIR)
        r.write([TOOLS_DIR, "image.json"],
                json.dumps({"tools_key": tools.key, "path": image_path or None}, sort_keys=True).encode() + b"\n",
                0o644)
        for name, mode in MOUNT_POINTS:
            r.ensure_dir(name, mode, real=name in REAL_DIRS)
        r.ensure_dir("root", 0o700, real=False)
        for program, tool in (("bash", "bash"), ("sh", "busybox")):
            if not r.is_program(["bin", program]):
                r.symlink(["bin", program], f"/{TOOLS_DIR}/bin/{tool}")
                report.linked.append(f"/bin/{program}")
        _accounts(r, report)
        r.write(["etc", "hosts"], HOSTS, 0o644)
        r.write(["etc", "resolv.conf"], RESOLV_CONF, 0o644)
        r.write(["etc", "hostname"], f"{GUEST_HOSTNAME}\n".encode(), 0o644)
    except OSError as e:
        raise ToolsInstallError(f"installing the guest tools into the image: {e.strerror or e}") from None
    finally:
        r.close()
    return report


def _accounts(r: _Root, report: InstallReport) -> None:
    passwd = r.read(["etc", "passwd"])
    group = r.read(["etc", "group"])
    shadow = r.read(["etc", "shadow"])
    files = AccountFiles(passwd[0] if passwd else b"", group[0] if group else b"", shadow[0] if shadow else None)
    new, account, added = ensure_user(files, shell="/bin/bash")
    report.uid, report.gid = account.uid, account.gid
    if not added:
        return
    report.user_added = True
    r.write(["etc", "passwd"], new.passwd, 0o644)
    r.write(["etc", "group"], new.group, 0o644)
    if new.shadow is not None and shadow is not None:
        st = shadow[1]                         # keep the image's owner and mode (root:shadow 0640)
        r.write(["etc", "shadow"], new.shadow, stat.S_IMODE(st.st_mode) & 0o777, st.st_uid, st.st_gid)
    if account.uid != 1000:
        report.notes.append(f"uid 1000 is taken in the image: user {account.name} has uid {account.uid}")
    if not r.make_home(account.home, account.uid, account.gid):
        report.notes.append(f"{account.home} exists in the image and was left as it is")
