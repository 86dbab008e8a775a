"""The syscall allow-list of confined QEMUs (aenv_vm/confine/syscall_filter.py): the list
parses and says why for every group, the compiled BPF answers every syscall number and
ruled argument as the list says (run through a classic-BPF interpreter of the kernel's
semantics), and a real process exec'd under the exact filter the node installs — the
jail's child path — has the refused calls refused with the errno the list names, while
threads, Unix and IP sockets still work; the kernel logs the refusals."""
from __future__ import annotations

import errno
import os
import platform
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_vm.confine import syscall_filter as sf
from aenv_vm.confine.errors import ConfinementError
from aenv_vm.confine.jail import child_plan, enter
from aenv_vm.confine.policy import Confinement
from aenv_vm.confine.refusals import parse_records, refused_calls, syscall_name

ARCH = 0xC000003E
X32 = 0x40000000
needs_x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="the interpreter's numbers are x86_64's")


def run_bpf(prog: list[sf.Instruction], nr: int, arch: int = ARCH, args: tuple[int, ...] = (0,) * 6) -> int:
    """A classic-BPF interpreter for the instructions the compiler emits, over the
    kernel's struct seccomp_data (little-endian)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[a & (2 ** 64 - 1) for a in args])
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == sf.BPF_LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == sf.BPF_ALU_AND_K:
            acc &= k
        elif code == sf.BPF_JEQ_K:
            pc += jt if acc == k else jf
        elif code == sf.BPF_JGE_K:
            pc += jt if acc >= k else jf
        elif code == sf.BPF_RET_K:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


def stacked(policy: sf.SyscallList, numbers: dict[str, int], nr: int, args: tuple[int, ...] = (0,) * 6,
            arch: int = ARCH) -> int:
    """What the kernel answers with both programs installed: the stricter action
    (lower action value), as seccomp_run_filters takes it."""
    answers = [run_bpf(sf.compile_filter(policy, numbers, ARCH, X32), nr, arch, args),
               run_bpf(sf.compile_quiet(policy, numbers, ARCH), nr, arch, args)]
    return min(answers, key=lambda r: (r & 0xFFFF0000) ^ 0x80000000)


POLICY = sf.load_list()
NUMBERS = sf.syscall_numbers(POLICY.names() | set(POLICY.quiet) | {"seccomp", "ptrace", "bpf", "kill"})
BY_NUMBER = {v: k for k, v in NUMBERS.items()}
PLAIN = {n for g in POLICY.groups for n in g.allow}
RULED = {r.syscall for g in POLICY.groups for r in g.rules}


def errno_of(ret: int) -> int:
    assert ret & 0xFFFF0000 == sf.RET_ERRNO, hex(ret)
    return ret & 0xFFFF


def test_the_list_parses_and_every_group_says_why() -> None:
    assert POLICY.refuse == errno.ENOSYS
    assert {g.name for g in POLICY.groups} >= {"start", "memory", "threads", "files", "sockets", "devices"}
    assert all(len(g.why) > 80 for g in POLICY.groups)
    # the calls that make an escape worse are not on it
    for name in ("ptrace", "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "keyctl",
                 "userfaultfd", "io_uring_setup", "io_uring_enter", "mount", "unshare", "setns", "clone3",
                 "fork", "vfork", "kill", "setuid", "init_module", "kexec_load", "open_by_handle_at", "pidfd_getfd"):
        assert name not in POLICY.names(), name
    assert POLICY.refuse_args == {"clone": errno.EPERM, "socket": errno.EAFNOSUPPORT,
                                  "socketpair": errno.EAFNOSUPPORT, "ioctl": errno.ENOTTY, "prctl": errno.EINVAL}


@needs_x86
def test_every_syscall_number_gets_the_answer_the_list_gives() -> None:
    for nr in range(0, 470):
        name = BY_NUMBER.get(nr)
        ret = stacked(POLICY, NUMBERS, nr)
        if name in PLAIN:
            assert ret == sf.RET_ALLOW, name
        elif name in RULED:
            continue                    # by arguments, below
        else:
            assert errno_of(ret) == errno.ENOSYS, (nr, name)
    # another ABI (int 0x80), x32 numbers: the process is killed
    assert stacked(POLICY, NUMBERS, NUMBERS["read"], arch=0x40000003) == sf.RET_KILL_PROCESS
    assert stacked(POLICY, NUMBERS, NUMBERS["read"] | X32) == sf.RET_KILL_PROCESS
    # the quiet refusals are the unlogged program's: the logging one allows them
    prog = sf.compile_filter(POLICY, NUMBERS, ARCH, X32)
    for name in POLICY.quiet:
        assert run_bpf(prog, NUMBERS[name]) == sf.RET_ALLOW
        assert errno_of(stacked(POLICY, NUMBERS, NUMBERS[name])) == errno.ENOSYS


THREAD = 0x100 | 0x200 | 0x400 | 0x800 | 0x10000 | 0x40000
FREE = 0x80000 | 0x100000 | 0x200000


@needs_x86
@settings(max_examples=300, deadline=None)
@given(family=st.integers(0, 2 ** 32 - 1), high=st.integers(0, 2 ** 32 - 1))
def test_socket_families(family: int, high: int) -> None:
    for name in ("socket", "socketpair"):
        ret = stacked(POLICY, NUMBERS, NUMBERS[name], (high << 32 | family,) + (0,) * 5)
        allowed = {1, 2, 10} if name == "socket" else {1}
        # the kernel reads the family as an int: the high word does not matter
        assert (ret == sf.RET_ALLOW) == (family in allowed)
        if family not in allowed:
            assert errno_of(ret) == errno.EAFNOSUPPORT


@needs_x86
@settings(max_examples=300, deadline=None)
@given(flags=st.integers(0, 2 ** 32 - 1), free=st.integers(0, 2 ** 32 - 1))
def test_clone_is_a_thread_and_nothing_else(flags: int, free: int) -> None:
    for f in (flags, THREAD | (free & (FREE | 0xFF))):
        ret = stacked(POLICY, NUMBERS, NUMBERS["clone"], (f, 0, 0, 0, 0, 0))
        thread = f & ~(FREE | 0xFF) == THREAD
        assert (ret == sf.RET_ALLOW) == thread, hex(f)
        if not thread:
            assert errno_of(ret) == errno.EPERM


@needs_x86
@settings(max_examples=300, deadline=None)
@given(request=st.integers(0, 2 ** 32 - 1), option=st.integers(0, 2 ** 32 - 1))
def test_ioctl_requests_and_prctl_options(request: int, option: int) -> None:
    # the tap device's requests and, on sockets, FIONREAD/FIONBIO (libslirp sizes each UDP
    # datagram with FIONREAD: user-mode guests get no DNS answer without it)
    named = {sf.CONSTANTS[n] for n in sf.CONSTANTS if n.startswith("TUN") or n.startswith("FIO")}
    assert {0x541B, 0x5421} <= named
    for req in (request, 0xAE00 | (request & 0xFF) | (request & 0xFFFF0000), sf.CONSTANTS["TUNSETIFF"],
                sf.CONSTANTS["FIONREAD"]):
        ret = stacked(POLICY, NUMBERS, NUMBERS["ioctl"], (3, req, 0, 0, 0, 0))
        ok = req & 0xFF00 == 0xAE00 or req in named
        assert (ret == sf.RET_ALLOW) == ok, hex(req)
        if not ok:
            assert errno_of(ret) == errno.ENOTTY
    allowed = {15, 16, 22, 29, 33, 38, 39}
    ret = stacked(POLICY, NUMBERS, NUMBERS["prctl"], (option, 0, 0, 0, 0, 0))
    assert (ret == sf.RET_ALLOW) == (option in allowed)


@needs_x86
def test_log_mode_refuses_nothing_but_logs() -> None:
    prog = sf.compile_filter(POLICY, NUMBERS, ARCH, X32, log_only=True)
    assert run_bpf(prog, NUMBERS["ptrace"]) == sf.RET_LOG
    assert run_bpf(prog, NUMBERS["socket"], args=(16, 0, 0, 0, 0, 0)) == sf.RET_LOG
    assert run_bpf(prog, NUMBERS["read"]) == sf.RET_ALLOW


@pytest.mark.parametrize("text, message", [
    ('refuse = "ENOSYS"\n[[group]]\nname = "a"\nwhy = "x"\nallow = ["read", "read"]\n', "listed twice"),
    ('refuse = "NOPE"\n', "errno"),
    ('refuse = "ENOSYS"\n[[group]]\nname = "a"\n', "a name and a why"),
    ('refuse = "ENOSYS"\n[[group]]\nname = "a"\nwhy = "x"\n[[group.rule]]\nsyscall = "socket"\narg = 0\n'
     'values = ["AF_BOGUS"]\nrefuse = "EPERM"\n', "unknown constant"),
    ('refuse = "ENOSYS"\n[[group]]\nname = "a"\nwhy = "x"\n[[group.rule]]\nsyscall = "socket"\narg = 7\n'
     'values = [1]\nrefuse = "EPERM"\n', "arg must be"),
    ('refuse = "ENOSYS"\n[[group]]\nname = "a"\nwhy = "x"\nallow = ["socket"]\n[[group.rule]]\nsyscall = "socket"\n'
     'arg = 0\nvalues = [1]\nrefuse = "EPERM"\n', "both"),
    ('refuse = "ENOSYS"\nrefuse_quietly = ["read"]\n[[group]]\nname = "a"\nwhy = "x"\nallow = ["read"]\n',
     "quietly and allowed"),
    ('refuse = "ENOSYS"\n[[group]]\nname = "a"\nwhy = "x"\n[[group.rule]]\nsyscall = "ioctl"\narg = 1\n'
     'mask = "0xFF00"\nvalues = ["0x1AE00"]\nrefuse = "ENOTTY"\n', "inside the mask"),
    ("refuse = [", "qemu_syscalls.toml"),
])
def test_a_bad_list_is_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfinementError, match=message):
        sf.parse_list(text)


@settings(max_examples=200, deadline=None)
@given(names=st.lists(st.sampled_from(sorted(set(NUMBERS) - {"ioctl"})), max_size=40, unique=True),
       values=st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=20))
def test_any_list_compiles_within_the_kernels_bounds(names: list[str], values: list[int]) -> None:
    rules = "".join(f'[[group.rule]]\nsyscall = "ioctl"\narg = 1\nvalues = [{", ".join(map(str, values))}]\n'
                    f'refuse = "ENOTTY"\n' for _ in range(2))
    text = (f'refuse = "ENOSYS"\n[[group]]\nname = "a"\nwhy = "x"\nallow = {names!r}\n'.replace("'", '"')
            + rules)
    policy = sf.parse_list(text)
    prog = sf.compile_filter(policy, NUMBERS, ARCH, X32)
    assert len(prog) <= 4096
    for name in names:
        assert run_bpf(prog, NUMBERS[name]) == sf.RET_ALLOW
    for v in values:
        assert run_bpf(prog, NUMBERS["ioctl"], args=(0, v, 0, 0, 0, 0)) == sf.RET_ALLOW


def test_audit_records_are_read_for_one_pid() -> None:
    lines = [b'6,1,2,-;audit: type=1326 audit(1.2:3): auid=4294967295 uid=1900000001 gid=1900000001 '
             b'ses=4294967295 pid=4242 comm="qemu-system-x86" exe="/usr/bin/qemu-system-x86_64" sig=0 '
             b'arch=c000003e syscall=101 compat=0 ip=0x7f code=0x50000',
             b'6,2,3,-;audit: type=1326 audit(1.2:4): pid=77 comm="x" sig=31 arch=c000003e syscall=59 '
             b'compat=0 ip=0x1 code=0x80000000',
             b'6,3,4,-;random line pid=4242 syscall=1']
    assert parse_records(lines) == [sf_refusal(4242, 101, "refused"), sf_refusal(77, 59, "killed")]
    assert syscall_name(101) == "ptrace" if platform.machine() == "x86_64" else True


def sf_refusal(pid: int, nr: int, action: str):  # type: ignore[no-untyped-def]
    from aenv_vm.confine.refusals import Refusal
    return Refusal(pid, nr, action)


def test_the_policy_builds_the_filter_per_mode() -> None:
    with pytest.raises(ConfinementError, match="allow-list, log or qemu"):
        Confinement(seccomp="deny-list")
    assert sf.CompiledFilter.build(sf.Mode.LOG).mode is sf.Mode.LOG
    with pytest.raises(ConfinementError, match="no filter"):
        sf.CompiledFilter.build(sf.Mode.QEMU)


# ---------------------------------------------------------------- the real kernel

@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the probe")
    out = tmp_path_factory.mktemp("probe") / "seccomp_probe"
    subprocess.run([cc, "-O1", "-Wall", "-o", str(out), str(Path(__file__).with_name("seccomp_probe.c")),
                    "-lpthread"], check=True, capture_output=True)
    return out


def run_probe(probe: Path, flt: sf.CompiledFilter | None) -> tuple[int, dict[str, int]]:
    plan = child_plan(None, parent_pid=os.getpid(), no_new_privs=True, syscall_filter=flt)
    proc = subprocess.Popen([str(probe)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                            preexec_fn=lambda: enter(plan))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return proc.pid, {k: int(v) for k, _, v in (line.partition("=") for line in out.decode().split())}


@needs_x86
def test_a_process_under_the_exact_filter_is_refused_what_the_list_lacks(probe: Path) -> None:
    flt = sf.CompiledFilter.build()
    pid, seen = run_probe(probe, flt)
    assert seen == {
        # allowed: what QEMU does
        "socket_unix": 0, "socket_inet": 0, "thread": 0, "prctl_set_name": 0,
        # not listed: ENOSYS
        "ptrace": errno.ENOSYS, "unshare": errno.ENOSYS, "bpf": errno.ENOSYS, "process_vm_readv": errno.ENOSYS,
        "io_uring_setup": errno.ENOSYS, "clone3": errno.ENOSYS, "kill": errno.ENOSYS, "setsid": errno.ENOSYS,
        # refused by a rule: the kernel's own answer to an unsupported request
        "socket_netlink": errno.EAFNOSUPPORT, "socket_packet": errno.EAFNOSUPPORT, "socket_alg": errno.EAFNOSUPPORT,
        "clone_process": errno.EPERM, "clone_userns": errno.EPERM, "ioctl_tcgets": errno.ENOTTY,
        "prctl_dumpable": errno.EINVAL}
    # the refusals are in the kernel log (rate-limited by printk: at least one of them),
    # the quiet ones are not
    if os.access("/dev/kmsg", os.R_OK):
        note = refused_calls(pid)
        assert any(f"{n} refused" in note for n in ("ptrace", "unshare", "bpf", "process_vm_readv", "kill")), note
        assert "clone3" not in note and "io_uring_setup" not in note


@needs_x86
def test_in_log_mode_the_same_process_is_refused_nothing_by_the_list(probe: Path) -> None:
    _, seen = run_probe(probe, sf.CompiledFilter.build(sf.Mode.LOG))
    # only the quiet refusals remain; everything else ran (or failed on its own: bpf(0, NULL))
    assert seen["clone3"] == errno.ENOSYS and seen["io_uring_setup"] == errno.ENOSYS
    assert seen["socket_netlink"] == 0 and seen["kill"] == 0 and seen["ioctl_tcgets"] == errno.ENOTTY


@needs_x86
@pytest.mark.qemu
def test_a_qemu_refused_a_call_it_needs_fails_saying_which(guest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A QEMU whose list lacks a call it needs (here eventfd2, as a QEMU update might need
    a new one) fails to start, and the error names the refused call from the kernel log."""
    import asyncio

    from aenv_vm.confine.jail import Jail
    from aenv_vm.qemu.errors import QemuExited
    from aenv_vm.qemu.launcher import QemuProcess, VmSpec

    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("the kernel log is not readable here")
    import re
    text, n = re.subn(r'"eventfd2",\s*', "", sf.LIST.read_text())
    assert n == 1
    lacking = sf.CompiledFilter.build(policy=sf.parse_list(text))
    spec = VmSpec(name="lacking", kernel=guest.kernel, initrd=guest.initrd, kernel_cmdline="console=ttyS0",
                  run_dir=tmp_path, memory_mib=128, jail=Jail(syscalls=lacking), extra_args=("-S",))

    async def run() -> str:
        with pytest.raises(QemuExited) as err:
            vm = await QemuProcess.start(spec)
            await vm.stop()
        return str(err.value)

    # the kernel prints audit records under printk's rate limit (printk_ratelimit_burst
    # records per printk_ratelimit seconds, machine-wide): other tests' refusals (the probe
    # above, another worker's) can use it up, and then this QEMU's record is suppressed.
    # Each try starts after a full window.
    window = int(Path("/proc/sys/kernel/printk_ratelimit").read_text()) + 0.5
    for _ in range(3):
        time.sleep(window)
        message = asyncio.run(run())
        if "eventfd2 refused" in message:
            break
    assert "eventfd2 refused" in message, message
    assert "qemu_syscalls.toml" in message
