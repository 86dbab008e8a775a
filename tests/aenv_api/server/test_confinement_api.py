"""`aenv server` confines its QEMUs by default and says so at start (issue 13): the
start line names the parts in force, and every QEMU child of the server — the pooled
clone and a sandbox created through the real e2b SDK — runs as its own non-root uid
with no capabilities, no_new_privs, seccomp (QEMU's filter and the syscall allow-list)
and its own mount namespace."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from .conftest import Server, qemu_children

pytestmark = pytest.mark.qemu


def status(pid: int) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in
                                          Path(f"/proc/{pid}/status").read_text().splitlines())}


def test_the_server_says_and_applies_its_confinement(sdk_env: Server) -> None:
    from e2b import Sandbox

    assert "QEMU confinement: auto: user, capabilities, no_new_privs, seccomp, mount namespace, cgroup" \
        in sdk_env.log()
    sbx = Sandbox.create()
    try:
        assert sbx.commands.run("true").exit_code == 0
        qemus = qemu_children(sdk_env.proc.pid)
        assert qemus                     # the new sandbox (and the pool's refill, once it runs)
        uids = set()
        for pid in qemus:
            st = status(pid)
            uid = st["Uid"].split()[0]
            uids.add(uid)
            assert int(uid) >= 1000 and int(st["CapEff"], 16) == 0 and int(st["CapBnd"], 16) == 0
            assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
            # QEMU's -sandbox, the syscall allow-list's two programs (+ discard.py's for a clone)
            assert int(st["Seccomp_filters"]) >= 3
            assert Path(f"/proc/{pid}/uid_map").read_text().split() == [uid, uid, "1"]     # its user namespace
            assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
            assert not os.path.exists(f"/proc/{pid}/root/root")
            assert not os.path.exists(f"/proc/{pid}/root{sdk_env.data_dir}/repo")
        assert len(uids) == len(qemus)    # one uid per sandbox
    finally:
        sbx.kill()
