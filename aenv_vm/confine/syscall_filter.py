"""QEMU's system calls as an allow-list: the list (``qemu_syscalls.toml``), compiled
to a seccomp BPF program, installed in the child before exec.

Like Firecracker's seccompiler, the policy is data: groups of system calls, each
with why QEMU needs them, and a few calls allowed only with certain arguments
(socket families, thread-only ``clone`` flags, ioctl requests, ``prctl`` options).
Everything else is refused without running:

* a call not on the list answers ENOSYS, "this kernel has no such call": glibc and
  QEMU take the fallback they keep for older kernels (``clone3`` → ``clone``,
  ``io_uring`` → ``ppoll``), so a QEMU or glibc update that starts probing a newer
  call still runs, while what the call would have done stays undone;
* a listed call with an argument outside its rule answers what the kernel answers
  for a request it does not support (``socket``: EAFNOSUPPORT, ``ioctl``: ENOTTY,
  ``prctl``: EINVAL, ``clone``: EPERM), so callers see a refusal they handle;
* a call of another ABI (x86's ``int 0x80``, x32) kills the process: a 64-bit QEMU
  never makes one, and they are how filters have been bypassed.

Refusals are logged by the kernel (``SECCOMP_FILTER_FLAG_LOG``: audit records of type
1326 in the kernel log, rate-limited by printk), which is how a QEMU that fails for
want of a call says which (``refusals.py``). Mode ``log`` refuses nothing and logs
every call the list lacks: how an operator finds what a new QEMU needs.

The filter composes with the others a QEMU gets: discard.py's (a clone's hole punch
answered 0) and QEMU's own ``-sandbox``; the kernel runs every filter and the most
restrictive answer wins. The arguments a rule looks at are 32-bit in the kernel
(``int`` or ``unsigned int``: socket's family, ioctl's request, prctl's option, and
``clone``, which reads only the low 32 bits of its flags), so a rule compares the low
32 bits of the register, which is all the kernel reads.

Syscall numbers come from libseccomp's table (``seccomp_syscall_resolve_name``): the
library a QEMU with ``-sandbox`` is linked with. A name the host architecture lacks
(``open`` on arm64) is skipped.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import platform
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .errors import ConfinementError

LIST = Path(__file__).with_name("qemu_syscalls.toml")

# struct seccomp_data: int nr @0, u32 arch @4, u64 ip @8, u64 args[6] @16 (the low word
# of args[i] at 16 + 8 i on a little-endian host)
_NR, _ARCH_AT, _ARGS = 0, 4, 16
# (AUDIT_ARCH_*, the first number of an ABI sharing this arch value that must be refused)
_HOSTS = {"x86_64": (0xC000003E, 0x40000000),    # x32 numbers carry __X32_SYSCALL_BIT
          "aarch64": (0xC00000B7, None)}

BPF_LD_W_ABS = 0x20
BPF_ALU_AND_K = 0x54
BPF_JEQ_K = 0x15
BPF_JGE_K = 0x35
BPF_RET_K = 0x06

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_LOG = 0x7FFC0000
RET_ALLOW = 0x7FFF0000

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_LOG = 2

# Names the list may use in argument rules (values from the kernel's uapi headers, the
# same on x86_64 and arm64).
CONSTANTS = {
    "AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10,
    "CLONE_VM": 0x100, "CLONE_FS": 0x200, "CLONE_FILES": 0x400, "CLONE_SIGHAND": 0x800,
    "CLONE_THREAD": 0x10000, "CLONE_SYSVSEM": 0x40000, "CLONE_SETTLS": 0x80000,
    "CLONE_PARENT_SETTID": 0x100000, "CLONE_CHILD_CLEARTID": 0x200000,
    "PR_SET_NAME": 15, "PR_GET_NAME": 16,
    "PR_SET_SECCOMP": 22, "PR_SET_TIMERSLACK": 29, "PR_MCE_KILL": 33, "PR_SET_NO_NEW_PRIVS": 38,
    "PR_GET_NO_NEW_PRIVS": 39,
    # <linux/if_tun.h>: _IOW/_IOR('T', n, ...)
    "TUNSETIFF": 0x400454CA, "TUNGETIFF": 0x800454D2, "TUNGETFEATURES": 0x800454CF,
    "TUNSETOFFLOAD": 0x400454D0, "TUNSETSNDBUF": 0x400454D4, "TUNGETVNETHDRSZ": 0x800454D7,
    "TUNSETVNETHDRSZ": 0x400454D8, "TUNSETQUEUE": 0x400454D9, "TUNSETVNETLE": 0x400454DC,
    "TUNSETVNETBE": 0x400454DE,
    # <asm-generic/ioctls.h>: bytes waiting on a socket, and non-blocking mode
    "FIONREAD": 0x541B, "FIONBIO": 0x5421,
    # every request of type KVMIO (0xAE): the KVM API on /dev/kvm and the fds it makes
    "KVMIO_TYPE": 0xAE00, "IOCTL_TYPE_MASK": 0xFF00,
}


class Mode(str, enum.Enum):
    """``[vm] confine_seccomp``."""
    ALLOW_LIST = "allow-list"       # the list enforced (default)
    LOG = "log"                     # nothing refused; calls outside the list logged
    QEMU = "qemu"                   # no list: QEMU's own -sandbox deny-list only


MODES = (Mode.ALLOW_LIST, Mode.LOG, Mode.QEMU)


@dataclass(frozen=True)
class ArgRule:
    """A call allowed when ``args[arg] & mask`` is one of ``values`` (low 32 bits)."""
    syscall: str
    arg: int
    values: tuple[int, ...]
    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class Group:
    name: str
    why: str
    allow: tuple[str, ...]              # allowed whatever their arguments
    rules: tuple[ArgRule, ...] = ()


@dataclass(frozen=True)
class SyscallList:
    groups: tuple[Group, ...]
    refuse: int                         # errno of a call not on the list
    refuse_args: dict[str, int]         # errno of a ruled call whose arguments fail every rule
    # refused with ``refuse`` but not logged: calls glibc or QEMU probe at every start and
    # do without (a log record for each would bury the unexpected ones)
    quiet: tuple[str, ...] = ()

    def names(self) -> set[str]:
        return {n for g in self.groups for n in g.allow} | {r.syscall for g in self.groups for r in g.rules}


def _value(v: object, where: str) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("~(") and text.endswith(")"):       # every bit but these
            return ~_value(text[2:-1], where) & 0xFFFFFFFF
        out = 0
        for part in text.split("|"):
            part = part.strip()
            if part in CONSTANTS:
                out |= CONSTANTS[part]
            else:
                try:
                    out |= int(part, 0)
                except ValueError:
                    raise ConfinementError(f"{where}: unknown constant {part!r}") from None
        return out
    raise ConfinementError(f"{where}: a value must be an integer or constant names, got {v!r}")


def _errno(name: object, where: str) -> int:
    if not isinstance(name, str) or not name.isupper() or not isinstance(getattr(errno, name, None), int):
        raise ConfinementError(f"{where}: {name!r} is not an errno name")
    return int(getattr(errno, name))


def parse_list(text: str) -> SyscallList:
    """The list from its TOML text; ConfinementError naming what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfinementError(f"{LIST.name}: {e}") from None
    refuse = _errno(doc.get("refuse"), "refuse")
    refuse_args: dict[str, int] = {}
    groups = []
    seen: dict[str, str] = {}
    for i, g in enumerate(doc.get("group", [])):
        where = f"group {i}"
        name, why = g.get("name"), g.get("why")
        if not isinstance(name, str) or not isinstance(why, str) or not why.strip():
            raise ConfinementError(f"{where}: needs a name and a why")
        allow = g.get("allow", [])
        if not isinstance(allow, list) or not all(isinstance(s, str) and s.isidentifier() for s in allow):
            raise ConfinementError(f"{where} ({name}): allow must be a list of syscall names")
        rules = []
        for j, r in enumerate(g.get("rule", [])):
            rw = f"{where} ({name}) rule {j}"
            sc, arg = r.get("syscall"), r.get("arg")
            if not isinstance(sc, str) or not sc.isidentifier():
                raise ConfinementError(f"{rw}: needs a syscall name")
            if not isinstance(arg, int) or not 0 <= arg <= 5:
                raise ConfinementError(f"{rw}: arg must be 0..5")
            values = r.get("values")
            if not isinstance(values, list) or not values:
                raise ConfinementError(f"{rw}: values must be a non-empty list")
            mask = _value(r.get("mask", 0xFFFFFFFF), rw)
            vals = tuple(_value(v, rw) for v in values)
            if not 0 < mask <= 0xFFFFFFFF or any(not 0 <= v <= 0xFFFFFFFF or v & ~mask for v in vals):
                raise ConfinementError(f"{rw}: mask and values are 32-bit, values inside the mask")
            err = _errno(r.get("refuse"), rw)
            if refuse_args.setdefault(sc, err) != err:
                raise ConfinementError(f"{rw}: {sc} is refused with two different errnos")
            rules.append(ArgRule(sc, arg, vals, mask))
        for sc in allow:
            if sc in seen:
                raise ConfinementError(f"{sc} is listed twice (groups {seen[sc]} and {name})")
            seen[sc] = name
        groups.append(Group(name, why.strip(), tuple(allow), tuple(rules)))
    ruled = {r.syscall for g in groups for r in g.rules}
    unconditional = {s for g in groups for s in g.allow}
    if ruled & unconditional:
        raise ConfinementError(f"allowed both whatever the arguments and by rule: {sorted(ruled & unconditional)}")
    quiet = doc.get("refuse_quietly", [])
    if not isinstance(quiet, list) or not all(isinstance(q, str) and q.isidentifier() for q in quiet):
        raise ConfinementError("refuse_quietly must be a list of syscall names")
    if set(quiet) & (ruled | unconditional):
        raise ConfinementError(f"refused quietly and allowed: {sorted(set(quiet) & (ruled | unconditional))}")
    return SyscallList(tuple(groups), refuse, refuse_args, tuple(quiet))


def load_list(path: Path = LIST) -> SyscallList:
    return parse_list(path.read_text())


# ---------------------------------------------------------------- compiling

Instruction = tuple[int, int, int, int]     # (code, jt, jf, k) of a classic BPF program


def compile_filter(policy: SyscallList, numbers: dict[str, int], audit_arch: int, x32_bit: int | None,
                   log_only: bool = False) -> list[Instruction]:
    """The BPF program of ``policy`` for one architecture (``numbers``: name → number
    on it; names it lacks are skipped). ``log_only``: every refusal becomes
    SECCOMP_RET_LOG (allowed, and logged). Pure: tested with an interpreter."""
    refuse = RET_LOG if log_only else RET_ERRNO | policy.refuse
    prog: list[Instruction] = [(BPF_LD_W_ABS, 0, 0, _ARCH_AT),
                               (BPF_JEQ_K, 1, 0, audit_arch),
                               (BPF_RET_K, 0, 0, RET_KILL_PROCESS),
                               (BPF_LD_W_ABS, 0, 0, _NR)]
    if x32_bit is not None:
        prog += [(BPF_JGE_K, 0, 1, x32_bit), (BPF_RET_K, 0, 0, RET_KILL_PROCESS)]
    rules: dict[str, list[ArgRule]] = {}
    for g in policy.groups:
        for r in g.rules:
            rules.setdefault(r.syscall, []).append(r)
    # the quiet refusals are the other program's (compile_quiet): allowed here, so that
    # this one, which logs, never answers them
    plain = sorted({numbers[s] for g in policy.groups for s in g.allow if s in numbers}
                   | {numbers[s] for s in policy.quiet if s in numbers})
    for nr in plain:
        prog += [(BPF_JEQ_K, 0, 1, nr), (BPF_RET_K, 0, 0, RET_ALLOW)]
    for name in sorted(rules, key=lambda s: numbers.get(s, -1)):
        if name not in numbers:
            continue
        body: list[Instruction] = []
        for r in rules[name]:
            body.append((BPF_LD_W_ABS, 0, 0, _ARGS + 8 * r.arg))
            if r.mask != 0xFFFFFFFF:
                body.append((BPF_ALU_AND_K, 0, 0, r.mask))
            for v in r.values:
                body += [(BPF_JEQ_K, 0, 1, v), (BPF_RET_K, 0, 0, RET_ALLOW)]
        body.append((BPF_RET_K, 0, 0, RET_LOG if log_only else RET_ERRNO | policy.refuse_args[name]))
        if len(body) > 255:
            raise ConfinementError(f"the rules of {name} are too long for one BPF jump")
        # every path through the body returns: past it the accumulator still holds the number
        prog += [(BPF_JEQ_K, 0, len(body), numbers[name])] + body
    prog.append((BPF_RET_K, 0, 0, refuse))
    if len(prog) > 4096:
        raise ConfinementError(f"the syscall filter has {len(prog)} instructions (the kernel takes 4096)")
    return prog


def compile_quiet(policy: SyscallList, numbers: dict[str, int], audit_arch: int) -> list[Instruction]:
    """The program installed without the log flag: ``policy.quiet`` refused, everything
    else allowed (the allow-list decides it). Of two filters' answers the kernel takes the
    stricter, and logs it only if the filter that gave it asked to."""
    quiet = sorted({numbers[s] for s in policy.quiet if s in numbers})
    prog: list[Instruction] = [(BPF_LD_W_ABS, 0, 0, _ARCH_AT), (BPF_JEQ_K, 1, 0, audit_arch),
                               (BPF_RET_K, 0, 0, RET_ALLOW), (BPF_LD_W_ABS, 0, 0, _NR)]
    for nr in quiet:
        prog += [(BPF_JEQ_K, 0, 1, nr), (BPF_RET_K, 0, 0, RET_ERRNO | policy.refuse)]
    return prog + [(BPF_RET_K, 0, 0, RET_ALLOW)]


# ---------------------------------------------------------------- this host

class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def syscall_numbers(names: Iterable[str]) -> dict[str, int]:
    """Numbers of ``names`` on this host's architecture, from libseccomp (names the
    architecture lacks are left out). ConfinementError without libseccomp."""
    lib = ctypes.util.find_library("seccomp")
    if lib is None:
        raise ConfinementError("libseccomp is not installed: its syscall table names the numbers of the "
                               "allow-list (apt-get install libseccomp2)")
    resolve = ctypes.CDLL(lib).seccomp_syscall_resolve_name
    resolve.argtypes = [ctypes.c_char_p]
    resolve.restype = ctypes.c_int
    out = {}
    for n in names:
        nr = resolve(n.encode())
        if nr >= 0:
            out[n] = nr
    return out


@dataclass(frozen=True)
class CompiledFilter:
    """One host's filter, built in the node; ``install`` only passes its address to the
    kernel (the child between fork and exec must not allocate or import)."""
    mode: Mode
    allowed: frozenset[str]             # the listed names this architecture has
    instructions: tuple[Instruction, ...]
    quiet_instructions: tuple[Instruction, ...]
    seccomp_nr: int
    _progs: tuple[_Prog, _Prog] = field(compare=False, repr=False)     # (quiet, the list)

    @classmethod
    def build(cls, mode: Mode = Mode.ALLOW_LIST, policy: SyscallList | None = None) -> "CompiledFilter":
        if mode not in (Mode.ALLOW_LIST, Mode.LOG):
            raise ConfinementError(f"no filter to build in mode {mode!r}")
        host = _HOSTS.get(platform.machine())
        if host is None:
            raise ConfinementError(f"no syscall allow-list for {platform.machine()}")
        policy = policy or load_list()
        numbers = syscall_numbers(policy.names() | set(policy.quiet) | {"seccomp"})
        allowed = frozenset(n for n in policy.names() if n in numbers)
        if "seccomp" not in numbers:
            raise ConfinementError("libseccomp does not know the seccomp syscall")
        code = compile_filter(policy, numbers, host[0], host[1], log_only=mode == Mode.LOG)
        quiet = compile_quiet(policy, numbers, host[0])
        return cls(mode, allowed, tuple(code), tuple(quiet), numbers["seccomp"], (_program(quiet), _program(code)))

    def install(self) -> int:
        """Install both programs on the calling thread (needs no_new_privs or
        CAP_SYS_ADMIN), the list's logging what it refuses. 0, or the errno it failed with."""
        for prog, flags in zip(self._progs, (0, SECCOMP_FILTER_FLAG_LOG)):
            if _syscall(self.seccomp_nr, SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(prog)) != 0:
                return ctypes.get_errno() or 1
        return 0


def _program(code: list[Instruction]) -> _Prog:
    filters = (_Filter * len(code))(*(_Filter(*ins) for ins in code))
    prog = _Prog(len(code), ctypes.cast(filters, ctypes.POINTER(_Filter)))
    prog._keep = filters        # the array lives as long as the program
    return prog


# Resolved once in the parent (see jail.py: no dlopen in a forked child).
_syscall = ctypes.CDLL(None, use_errno=True).syscall
