"""Lazy memory images: a template's memory file served from the store through FUSE.

A node that has never seen a template (a snapshot made on another node, a
template built elsewhere) would otherwise assemble its whole memory image from
store chunks before the first QEMU can map it. Here instead the image is one
read-only file of a FUSE filesystem the node mounts (``MemoryFs``): QEMU maps
it ``share=off`` like a local file, and each page fault the kernel cannot
answer from the page cache becomes a FUSE READ that this server answers from
the store (node cache → peers → repository, every chunk checked against its
BLAKE3 id). The page cache of that one inode is shared by every QEMU of the
node that maps the image, as with a local file; an open never drops it
(``FOPEN_KEEP_CACHE``) and only this server could (``EXPLICIT_INVAL_DATA``).

Who may read: the mount is host-side only. Its mount point lies in a root-only
(0700) directory, so no other host user can reach the path; a confined QEMU gets
its one file bind-mounted into its jail (aenv_vm/confine/jail.py) and opens it
read-only. Each request is also checked here: only root (the node) and the uids
the node's confinement leases to its QEMUs are answered, anyone else gets
EACCES. Every change (write, truncate, create, ...) is EROFS for everyone: a
``share=off`` mapping never writes the file, its pages become private copies.
The guest has no way to the server at all: it sees its RAM, QEMU does the
faults, and what a fault returns is the verified image content or an error.

A chunk that fails its check (or cannot be read) is answered with EIO: the
QEMU's fault becomes SIGBUS and the QEMU dies, never running on wrong memory.
The image keeps the error (``LazyImage.error``) so the restore says why.

Lifecycle: ``mount`` first detaches whatever a crashed node left at the same
mount point (the FUSE connection of a dead server answers nothing), ``close``
detaches the mount (MNT_DETACH: a QEMU still mapping it keeps its inode until
it exits) and the kernel then ends the connection, which ends the threads.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from aenv_store.errors import StoreError
from aenv_store.formats.ids import Digest
from aenv_store.formats.manifest import Extent, Manifest
from aenv_store.store import Store

from ..errors import VmError
from . import fuse_wire as F

log = logging.getLogger(__name__)

FSTYPE = "fuse.aenv-memory"
ROOT = 1
UNIT = 64 << 10              # granularity of what an image records as touched (workingset.py)
NOTIFY_STORE = 4             # fuse_notify_code: data into an inode's page cache
_NOTIFY_STORE_OUT = struct.Struct("<QQII")   # nodeid offset size padding, then the data
FILL_BATCH = 64              # units fetched per batch by fill (4 MiB: pack ranges coalesced, in parallel)
THREADS = 4                  # READs in flight: faults of several vCPUs and QEMUs at once
MAX_PAGES = 256              # 1 MiB per request
READ_BUF = (MAX_PAGES + 1) * 4096
VALID = 86400                # seconds the kernel may keep names and attributes (they never change)
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MNT_DETACH = 0x2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class LazyMemoryError(VmError):
    """The lazy memory filesystem cannot be mounted, or an image cannot be served."""


@dataclass
class LazyImage:
    """One memory image exposed as a file: what was asked of it and what it fetched."""
    ino: int
    manifest: Manifest
    name: str
    created: float
    reads: int = 0                  # READ requests answered
    read_bytes: int = 0             # bytes answered (what the kernel put in the page cache)
    fetched_chunks: int = 0         # distinct chunks taken from the store for it
    fetched_bytes: int = 0          # their plaintext bytes
    error: str | None = None        # the first failed read (corrupt or unreadable chunk)
    filled_bytes: int = 0           # bytes put into the page cache ahead of the faults (fill)
    _seen: set[bytes] = field(default_factory=set, repr=False)
    _touched: bytearray = field(default_factory=bytearray, repr=False)   # per UNIT: asked for yet
    _order: list[int] = field(default_factory=list, repr=False)          # units in first-touch order
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def size(self) -> int:
        return self.manifest.size

    def note(self, extents: Iterable[Extent], answered: int, span: tuple[int, int] | None = None) -> None:
        """A READ of ``span`` (offset, end) answered ``answered`` bytes from these extents
        (data ones counted once); without ``span``: chunks fetched ahead of any READ."""
        with self._lock:
            if span is not None:
                self.reads += 1
                self.read_bytes += answered
                if not self._touched:
                    self._touched = bytearray(-(-self.size // UNIT))
                for u in range(span[0] // UNIT, (span[1] - 1) // UNIT + 1):
                    if not self._touched[u]:
                        self._touched[u] = 1
                        self._order.append(u)
            for e in extents:
                if e.chunk is None:
                    continue
                key = bytes(e.chunk)
                if key not in self._seen:
                    self._seen.add(key)
                    self.fetched_chunks += 1
                    self.fetched_bytes += e.length

    def touched_units(self) -> list[int]:
        """The UNITs of the image READs asked for so far, in first-touch order."""
        with self._lock:
            return list(self._order)


FUSECTL = Path("/sys/fs/fuse/connections")


@dataclass(frozen=True)
class MountEntry:
    point: Path
    device: str         # "major:minor" (a FUSE connection's id is the minor)
    fstype: str


def mounts_under(root: Path, mountinfo: str | None = None) -> list[MountEntry]:
    """Mounts at or below ``root`` (deepest first), from /proc/self/mountinfo."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return []
    want = os.path.normpath(str(root))
    out: dict[str, MountEntry] = {}
    for line in mountinfo.splitlines():
        parts = line.split()
        if len(parts) < 7 or "-" not in parts[6:]:
            continue
        point = parts[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
            .replace("\\134", "\\")
        fstype = parts[parts.index("-", 6) + 1] if parts.index("-", 6) + 1 < len(parts) else ""
        if point == want or point.startswith(want + "/"):
            out[point] = MountEntry(Path(point), parts[2], fstype)
    return sorted(out.values(), key=lambda m: len(m.point.parts), reverse=True)


def abort_connection(device: str) -> bool:
    """End a FUSE connection through fusectl (if mounted): every request waiting on a
    dead or stuck server fails instead of hanging the process that made it."""
    try:
        minor = int(device.split(":")[1])
        (FUSECTL / str(minor) / "abort").write_text("1")
        return True
    except (OSError, ValueError, IndexError):
        return False


def detach(point: Path) -> bool:
    """umount2(MNT_DETACH); False if it was not a mount point."""
    if _libc.umount2(os.fsencode(point), MNT_DETACH) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOENT):
        return False
    raise LazyMemoryError(f"cannot unmount {point}: {os.strerror(e)}")


def clean_stale(root: Path) -> list[Path]:
    """Abort and detach every mount at or below ``root`` (what a crashed node left: its
    server is gone, so requests to it would hang or fail); the detached ones."""
    gone = []
    for m in mounts_under(root):
        if m.fstype.startswith("fuse"):
            abort_connection(m.device)
        if detach(m.point):
            gone.append(m.point)
    if gone:
        log.warning("detached %d stale lazy memory mount(s) under %s", len(gone), root)
    return gone


class MemoryFs:
    """The node's FUSE filesystem of lazily fetched memory images. ``allowed(uid)``
    says which requesting uids are answered (the node's own and its QEMUs')."""

    def __init__(self, store: Store, mountpoint: Path, allowed: Callable[[int], bool],
                 readahead_kb: int = 1024, threads: int = THREADS) -> None:
        self.store = store
        self.mountpoint = mountpoint
        self.allowed = allowed
        self.readahead_kb = readahead_kb
        self.nthreads = threads
        self._images: dict[int, LazyImage] = {}
        self._by_name: dict[bytes, LazyImage] = {}
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._threads: list[threading.Thread] = []
        self.mounted = False
        self._device: str | None = None
        self.denied = 0              # requests refused to a uid that is not allowed
        # called once per newly exposed image (worker thread), e.g. to record or prefetch it
        self.on_new_image: Callable[[LazyImage], None] | None = None
        self.on_close: list[Callable[[], None]] = []   # run first by close (stop recorders, fills)

    # ------------------------------------------------------------ mount / unmount

    def mount(self) -> None:
        parent = self.mountpoint.parent
        parent.mkdir(parents=True, exist_ok=True)
        os.chmod(parent, 0o700)      # no other host user reaches the mount point
        clean_stale(self.mountpoint)
        self.mountpoint.mkdir(exist_ok=True)
        try:
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise LazyMemoryError(f"cannot open /dev/fuse: {e}") from None
        self._fd = fd
        opts = (f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,"
                f"max_read={MAX_PAGES * 4096}")
        if _libc.mount(b"aenv-memory", os.fsencode(self.mountpoint), FSTYPE.encode(),
                       MS_NOSUID | MS_NODEV | MS_NOEXEC, opts.encode()) != 0:
            err = ctypes.get_errno()
            os.close(fd)
            self._fd = None
            raise LazyMemoryError(f"cannot mount the lazy memory filesystem at {self.mountpoint}: "
                                  f"{os.strerror(err)}")
        self.mounted = True
        # readers only once the device is attached (read(2) before the mount is EPERM)
        for i in range(self.nthreads):
            t = threading.Thread(target=self._serve, name=f"aenv-lazymem-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        st = os.stat(self.mountpoint)        # answered once INIT is: the kernel took our readahead
        self._device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        self._set_readahead(st.st_dev)

    def _set_readahead(self, dev: int) -> None:
        """Page faults read ``readahead_kb`` around the faulting page (the kernel's
        read-around); a FUSE filesystem starts at 128 KiB."""
        p = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
        try:
            p.write_text(str(self.readahead_kb))
        except OSError as e:
            log.info("cannot set the lazy memory readahead (%s): %s", p, e)

    def close(self) -> None:
        for stop in self.on_close:
            try:
                stop()
            except Exception:
                log.exception("lazy memory close hook failed")
        self.on_close.clear()
        if self.mounted:
            self.mounted = False
            try:
                detach(self.mountpoint)
            except LazyMemoryError as e:
                log.warning("%s", e)
        for t in self._threads:
            t.join(timeout=2.0)
        if any(t.is_alive() for t in self._threads) and self._device is not None:
            abort_connection(self._device)     # nobody may wait on a server that is going away
            for t in self._threads:
                t.join(timeout=1.0)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:   # a QEMU still maps an image: the kernel keeps the connection until it exits
            log.info("lazy memory threads still serving after unmount: %s", ", ".join(alive))
        elif self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._threads.clear()
        with self._lock:
            self._images.clear()
            self._by_name.clear()
        try:
            self.mountpoint.rmdir()
        except OSError:
            pass

    # ------------------------------------------------------------ images

    def expose(self, manifest: Manifest) -> Path:
        """The file serving ``manifest`` (a full memory image) page by page; once per image."""
        name = bytes(manifest.id).hex().encode()
        new = False
        with self._lock:
            img = self._by_name.get(name)
            if img is None:
                img = LazyImage(len(self._images) + 2, manifest, name.decode(), time.time())
                self._images[img.ino] = img
                self._by_name[name] = img
                new = True
        path = self.mountpoint / img.name
        if new and self.on_new_image is not None:
            os.stat(path)        # the kernel now knows the inode (a fill needs it); releases the GIL
            self.on_new_image(img)
        return path

    def image(self, mid: Digest) -> LazyImage | None:
        with self._lock:
            return self._by_name.get(bytes(mid).hex().encode())

    def images(self) -> list[LazyImage]:
        with self._lock:
            return list(self._images.values())

    def fill(self, img: LazyImage, units: Iterable[int]) -> int:
        """Fetch these UNITs of ``img`` in batches and put them into its page cache
        (FUSE_NOTIFY_STORE), in the order given; returns the bytes put there. The chunks
        skip the node cache (its per-chunk file and index writes were two thirds of the
        cost of a fetch here): the page cache holds them, and a page evicted later is
        fetched again by its fault, which caches it. Stops quietly when the kernel no
        longer knows the inode or the store fails (the faults then fetch what they need)."""
        order = list(units)
        done = 0
        for k in range(0, len(order), FILL_BATCH):
            batch = order[k:k + FILL_BATCH]
            spans = [(u * UNIT, min((u + 1) * UNIT, img.size)) for u in batch if u * UNIT < img.size]
            per_span = [img.manifest.extents_in(a, b - a) for a, b in spans]
            cids = list(dict.fromkeys(e.chunk for ext in per_span for e in ext if e.chunk is not None))
            try:
                got = dict(zip(cids, self.store.read_chunks(cids, cache=False)))   # one batch, verified
            except StoreError as err:
                log.info("fill of memory image %s stopped: %s", img.manifest.id.short(), err)
                return done
            img.note([e for ext in per_span for e in ext], 0)
            for (a, b), ext in zip(spans, per_span):
                data = bytearray(b - a)
                for e in ext:
                    if e.chunk is None:
                        continue
                    lo, hi = max(a, e.offset), min(b, e.end)
                    chunk = got[e.chunk]
                    if len(chunk) != e.length:
                        log.info("fill of %s stopped: chunk of %d bytes for an extent of %d",
                                 img.manifest.id.short(), len(chunk), e.length)
                        return done
                    data[lo - a:hi - a] = memoryview(chunk)[lo - e.offset:hi - e.offset]
                fd = self._fd
                if fd is None:
                    return done
                try:
                    os.writev(fd, [F.OUT_HEADER.pack(F.OUT_HEADER.size + _NOTIFY_STORE_OUT.size + len(data),
                                                     NOTIFY_STORE, 0),
                                   _NOTIFY_STORE_OUT.pack(img.ino, a, len(data), 0), data])
                except OSError as err:      # ENOENT: the kernel dropped the inode
                    log.info("fill of memory image %s stopped: %s", img.manifest.id.short(), err)
                    return done
                done += len(data)
                img.filled_bytes += len(data)
        return done

    # ------------------------------------------------------------ serving

    def _serve(self) -> None:
        fd = self._fd
        assert fd is not None
        while True:
            try:
                buf = os.read(fd, READ_BUF)
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EAGAIN):   # an interrupted request: the next one
                    continue
                if e.errno != errno.ENODEV:                  # ENODEV: unmounted, the connection ended
                    log.warning("lazy memory server stops: %s", e)
                return
            if not buf:
                return
            try:
                req = F.parse_request(buf)
            except F.ProtocolError as e:
                log.warning("bad FUSE request: %s", e)
                continue
            try:
                out = self._handle(req)
            except Exception:   # a bug must not leave the kernel waiting (the faulting QEMU hangs)
                log.exception("lazy memory request %d failed", req.opcode)
                out = F.error(req.unique, errno.EIO) if req.opcode not in F.NO_REPLY else None
            if out is None:
                continue
            try:
                if isinstance(out, list):
                    os.writev(fd, out)
                else:
                    os.write(fd, out)
            except OSError as e:     # ENOENT: the request was interrupted meanwhile
                if e.errno != errno.ENOENT:
                    log.debug("FUSE reply: %s", e)

    def _handle(self, req: F.Request) -> bytes | list[bytes] | None:
        op = req.opcode
        if op in F.NO_REPLY:
            return None
        if op == F.Opcode.INIT:
            return F.reply(req.unique, self._init(req))
        if op == F.Opcode.DESTROY:
            return F.reply(req.unique)
        if op in F.WRITES:
            return F.error(req.unique, errno.EROFS)
        if not self.allowed(req.uid):
            self.denied += 1
            return F.error(req.unique, errno.EACCES)
        if op == F.Opcode.READ:
            return self._read(req)
        if op == F.Opcode.LOOKUP:
            if req.nodeid != ROOT:
                return F.error(req.unique, errno.ENOTDIR)
            with self._lock:
                img = self._by_name.get(F.cstring(req.body))
            if img is None:
                return F.error(req.unique, errno.ENOENT)
            return F.reply(req.unique, F.entry_out(img.ino, self._file_attr(img), VALID))
        if op == F.Opcode.GETATTR:
            a = self._attr(req.nodeid)
            return F.reply(req.unique, F.attr_out(a, VALID)) if a else F.error(req.unique, errno.ENOENT)
        if op == F.Opcode.OPEN:
            if req.nodeid not in self._images:
                return F.error(req.unique, errno.EISDIR if req.nodeid == ROOT else errno.ENOENT)
            return F.reply(req.unique, F.OPEN_OUT.pack(0, F.FOPEN_KEEP_CACHE, 0))
        if op == F.Opcode.OPENDIR:
            if req.nodeid != ROOT:
                return F.error(req.unique, errno.ENOTDIR)
            return F.reply(req.unique, F.OPEN_OUT.pack(0, 0, 0))
        if op == F.Opcode.READDIR:
            return self._readdir(req)
        if op == F.Opcode.STATFS:
            return F.reply(req.unique, F.STATFS_OUT.pack(0, 0, 0, 0, 0, 4096, 255, 4096))
        if op in (F.Opcode.RELEASE, F.Opcode.RELEASEDIR, F.Opcode.FLUSH, F.Opcode.FSYNC, F.Opcode.FSYNCDIR):
            return F.reply(req.unique)
        return F.error(req.unique, errno.ENOSYS)   # xattrs, lseek, locks, ...: the kernel stops asking

    def _init(self, req: F.Request) -> bytes:
        major, minor, readahead, flags = F.INIT_IN.unpack_from(req.body, 0)
        if major != F.KERNEL_MAJOR:
            raise F.ProtocolError(f"FUSE major version {major}")
        return F.INIT_OUT.pack(F.KERNEL_MAJOR, min(minor, F.KERNEL_MINOR), min(readahead, self.readahead_kb << 10),
                               flags & F.WANTED_FLAGS, 16, 12, 128 << 10, 1, MAX_PAGES, 0, 0)

    def _attr(self, ino: int) -> bytes | None:
        if ino == ROOT:
            return F.attr(ROOT, F.S_IFDIR | 0o555, 0, 0, nlink=2)
        img = self._images.get(ino)
        return None if img is None else self._file_attr(img)

    @staticmethod
    def _file_attr(img: LazyImage) -> bytes:
        return F.attr(img.ino, F.S_IFREG | 0o444, img.size, int(img.created))

    def _readdir(self, req: F.Request) -> bytes:
        _, offset, size = F.READ_IN.unpack_from(req.body, 0)[:3]
        with self._lock:
            entries = [(ROOT, b".", F.DT_DIR), (ROOT, b"..", F.DT_DIR)] + \
                [(i.ino, i.name.encode(), F.DT_REG) for i in self._images.values()]
        out = b""
        for k in range(offset, len(entries)):
            ino, name, kind = entries[k]
            d = F.dirent(ino, k + 1, name, kind)
            if len(out) + len(d) > size:
                break
            out += d
        return F.reply(req.unique, out)

    def _read(self, req: F.Request) -> bytes | list[bytes]:
        img = self._images.get(req.nodeid)
        if img is None:
            return F.error(req.unique, errno.ENOENT)
        _, offset, size = F.READ_IN.unpack_from(req.body, 0)[:3]
        end = min(offset + size, img.size)
        if offset >= end:
            return F.reply(req.unique)
        try:
            data = self.store.open_blob(img.manifest).read(offset, end - offset)
        except StoreError as e:
            msg = f"memory image {img.manifest.id.short()} at offset {offset}: {e}"
            if img.error is None:
                img.error = msg
            log.error("lazy memory read failed (the QEMU mapping it gets SIGBUS): %s", msg)
            return F.error(req.unique, errno.EIO)
        img.note(img.manifest.extents_in(offset, end - offset), len(data), (offset, end))
        return [F.reply_header(req.unique, len(data)), data]


