"""Which system calls the kernel refused a QEMU: its seccomp audit records.

A QEMU that fails for want of a call the allow-list lacks (a QEMU or glibc update)
usually says only "Function not implemented" on its stderr, if anything. The filter is
installed with SECCOMP_FILTER_FLAG_LOG (syscall_filter.py), so every refusal — and in
mode ``log`` every call outside the list — is an audit record of type 1326 in the
kernel log (``dmesg``, ``journalctl -k``; printk rate-limits them):

    audit: type=1326 audit(…): … pid=4242 comm="qemu-system-x86" … syscall=425 … code=0x50026

QEMU's own ``-sandbox`` kills with SIGSYS, logged the same way. ``parse_records`` is
pure (tested); ``refused_calls`` reads ``/dev/kmsg`` (root) for one pid, and answers
nothing where the log cannot be read (a container without it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import time
from dataclasses import dataclass
from typing import Iterable

_RECORD = re.compile(rb"type=1326 .*?\bpid=(\d+) .*?\bsyscall=(\d+) .*?\bcode=(0x[0-9a-fA-F]+)")
_MAX_RECORDS = 200_000          # the ring holds far fewer; a bound, not a limit that bites
RET_ACTION_FULL = 0xFFFF0000
ACTIONS = {0x80000000: "killed", 0x00000000: "thread killed", 0x00030000: "trapped", 0x00050000: "refused",
           0x7FFC0000: "logged"}


@dataclass(frozen=True)
class Refusal:
    pid: int
    syscall: int
    action: str         # "refused" (an errno), "killed" (QEMU's -sandbox), "logged" (mode log), …


def parse_records(lines: Iterable[bytes]) -> list[Refusal]:
    """The seccomp audit records among kernel log lines."""
    out = []
    for line in lines:
        m = _RECORD.search(line)
        if m:
            code = int(m.group(3), 16) & RET_ACTION_FULL
            out.append(Refusal(int(m.group(1)), int(m.group(2)), ACTIONS.get(code, hex(code))))
    return out


def _kmsg_lines() -> list[bytes]:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    lines = []
    try:
        for _ in range(_MAX_RECORDS):
            try:
                lines.append(os.read(fd, 8192))
            except BlockingIOError:
                break
            except BrokenPipeError:     # a record was overwritten while reading: go on
                continue
            except OSError:
                break
    finally:
        os.close(fd)
    return lines


def syscall_name(nr: int) -> str:
    """``nr``'s name on this architecture (libseccomp), else the number."""
    lib = ctypes.util.find_library("seccomp")
    if lib is not None:
        seccomp = ctypes.CDLL(lib)
        seccomp.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
        seccomp.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
        ptr = seccomp.seccomp_syscall_resolve_num_arch(0, nr)     # 0: the native architecture
        if ptr:
            name = ctypes.string_at(ptr).decode()
            ctypes.CDLL(None).free(ctypes.c_void_p(ptr))
            return name
    return f"#{nr}"


def refused_calls(pid: int, wait: float = 1.0) -> str:
    """What the kernel log says seccomp did to process ``pid`` ("" when nothing, or the
    log cannot be read): one line for a QEMU's failure message. The records reach the log
    through the kernel's audit thread, after the process may already be gone: a log
    without one is read again for up to ``wait`` seconds (a worker thread's wait)."""
    deadline = time.monotonic() + wait
    while True:
        seen: dict[tuple[str, str], int] = {}
        for r in parse_records(_kmsg_lines()):
            if r.pid == pid:
                key = (r.action, syscall_name(r.syscall))
                seen[key] = seen.get(key, 0) + 1
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not seen:
        return ""
    calls = ", ".join(f"{name} {action}" + (f" ×{n}" if n > 1 else "") for (action, name), n in seen.items())
    return (f"seccomp: the kernel log records {calls} for this QEMU (the syscall allow-list, "
            "aenv_vm/confine/qemu_syscalls.toml, or QEMU's -sandbox; [vm] confine_seccomp = \"log\" lets such "
            "calls run and logs them, docs/security.md)")
