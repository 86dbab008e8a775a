"""A clone's RAM discards stay in the clone: hole punching made a no-op.

Every clone maps its template's memory file ``share=off`` (copy-on-write), and the
guest hands RAM back through the balloon device's free page reporting (docs/guest.md).
QEMU discards such RAM with ``ram_block_discard_range``, which for a file-backed
block first punches the range out of the *file*
(``fallocate(PUNCH_HOLE | KEEP_SIZE)``), then ``madvise(MADV_DONTNEED)`` on the mapping.
For a private mapping of a file every clone of the template shares, the first step is
wrong: it zeroes the template's memory under every other clone (QEMU 7.2 to today;
newer releases only warn once). Measured here: a clone that deleted a 100 MiB file
from its /dev/shm punched 100 MiB out of the template's memory file.

So a QEMU whose RAM is a copy-on-write mapping gets, before exec, a seccomp filter
that answers every ``fallocate`` with ``FALLOC_FL_PUNCH_HOLE`` in its mode with
success, without calling the kernel. QEMU then goes on to ``MADV_DONTNEED``,
which drops exactly the clone's private copies of the pages: the host gets the
memory back, the guest reads the template's page there again (free page reporting
promises the guest nothing about a reported page's content, and the balloon is
offered without ``page-poison``, so a guest that would need zeroes does not report),
and the file is never touched. The filter holds whatever else is configured:
confined or not, with or without the read-only RAM shim (romem.py), on any QEMU.

Nothing else of a clone punches holes: its disk is an NBD export (aenv_vm/machine),
its other files are its console log and sockets. A copy-on-write ``VmSpec`` with a
file disk (tests only) would see that disk's hole punches succeed without effect;
its blockdevs never ask for ``discard=unmap``.
"""
from __future__ import annotations

import ctypes
import platform

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
FALLOC_FL_PUNCH_HOLE = 0x02

# (AUDIT_ARCH_*, __NR_fallocate) of the host (QEMU runs natively on it)
_ARCH = {"x86_64": (0xC000003E, 285), "aarch64": (0xC00000B7, 47)}.get(platform.machine())

_BPF_LD_W_ABS = 0x20        # BPF_LD | BPF_W | BPF_ABS
_BPF_JEQ_K = 0x15           # BPF_JMP | BPF_JEQ | BPF_K
_BPF_JSET_K = 0x45          # BPF_JMP | BPF_JSET | BPF_K
_BPF_RET_K = 0x06           # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000     # SECCOMP_RET_ALLOW
_RET_ERRNO_0 = 0x00050000   # SECCOMP_RET_ERRNO with errno 0: the call "succeeds", not run
# struct seccomp_data: int nr @0, u32 arch @4, u64 ip @8, u64 args[6] @16 (mode = args[1],
# its low 32 bits at 24 on a little-endian host)
_NR, _ARCH_AT, _MODE_LOW = 0, 4, 24


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def program() -> list[tuple[int, int, int, int]] | None:
    """The filter as (code, jt, jf, k) instructions (None: a host architecture without
    one here)."""
    if _ARCH is None:
        return None
    audit_arch, nr_fallocate = _ARCH
    return [
        (_BPF_LD_W_ABS, 0, 0, _ARCH_AT),
        (_BPF_JEQ_K, 0, 5, audit_arch),            # another ABI: allow
        (_BPF_LD_W_ABS, 0, 0, _NR),
        (_BPF_JEQ_K, 0, 3, nr_fallocate),          # not fallocate: allow
        (_BPF_LD_W_ABS, 0, 0, _MODE_LOW),
        (_BPF_JSET_K, 0, 1, FALLOC_FL_PUNCH_HOLE),  # no hole punched: allow
        (_BPF_RET_K, 0, 0, _RET_ERRNO_0),
        (_BPF_RET_K, 0, 0, _RET_ALLOW),
    ]


def _compile() -> _Prog | None:
    code = program()
    if code is None:
        return None
    filters = (_Filter * len(code))(*(_Filter(*ins) for ins in code))
    prog = _Prog(len(code), ctypes.cast(filters, ctypes.POINTER(_Filter)))
    prog._keep = filters        # the array lives as long as the program
    return prog


# Built once in the parent: the forked child only passes its address to prctl.
_PROG = _compile()
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl


def supported() -> bool:
    return _PROG is not None


def install() -> int:
    """Install the filter on the calling thread (the child between fork and exec; it
    needs no_new_privs or CAP_SYS_ADMIN). 0, or the errno it failed with."""
    if _PROG is None:
        return 95   # EOPNOTSUPP
    if _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(_PROG), 0, 0) != 0:
        return ctypes.get_errno() or 1
    return 0
