"""A copy-on-write guest RAM mapping of a file the QEMU may only read.

Every clone maps its template's memory file ``share=off`` (MAP_PRIVATE): the
kernel needs read access only, and the file must stay unwritable for a
confined QEMU (all clones of the template share it). QEMU 7.2 (Debian 12) has
no way to say so and opens the file O_RDWR, so a read-only bind mount makes it
fail (EROFS). A small ``LD_PRELOAD`` library (romem.c, built here once per
host with the system C compiler) turns that one open into O_RDONLY; the
mapping is still writable copy-on-write, and QEMU, which does not know, still
discards RAM the guest frees (free page reporting: MADV_DONTNEED, its hole
punch a no-op, discard.py). QEMU 8.2 can say it with
``memory-backend-file,readonly=on,rom=off``, but then refuses every discard
of that RAM: the shim is preferred on every QEMU, ``rom=off`` is what a QEMU
>= 8.2 gets without a compiler. Without either, a confined QEMU cannot map a
template read-only and the uid layer is off (``probe_host``).
"""
from __future__ import annotations

import enum
import hashlib
import os
import threading
import shutil
import subprocess
from pathlib import Path

from ..childenv import child_env
from .errors import ConfinementError

SOURCE = Path(__file__).with_name("romem.c")
ENV = "AENV_READONLY_RAM"       # the one path the shim opens read-only (romem.c)
ROM_OFF_QEMU = (8, 2, 0)        # first QEMU with memory-backend-file rom=off


class ReadonlyRam(enum.Enum):
    ROM_OFF = "rom=off"         # QEMU >= 8.2 without the shim: readonly=on,rom=off (no discards)
    PRELOAD = "preload"         # the LD_PRELOAD shim (any QEMU)
    NONE = "none"               # neither: the QEMU must be able to write the file


def library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return f"libaenv-romem-{digest}.so"


def build_shim(directory: Path) -> Path:
    """The shim compiled into ``directory`` (once per source version; atomic rename, so
    concurrent nodes may race harmlessly). ConfinementError without a C compiler."""
    out = directory / library_name()
    if out.is_file():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ConfinementError("no C compiler (cc) to build the read-only RAM shim "
                               "(apt-get install gcc libc6-dev)")
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp), str(SOURCE), "-ldl"],
                          capture_output=True, text=True, env=child_env())
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ConfinementError(f"building the read-only RAM shim failed: {done.stderr.strip()[:500]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out
