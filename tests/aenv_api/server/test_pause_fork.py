"""A batch of sandboxes from a paused sandbox's last pause (``POST /snapshots/{id}/fork``
with the sandbox's id; aenv_vm/sandboxes/pausefork.py), against `aenv server` with the
real E2B SDK: every new sandbox has the paused sandbox's files (on disk and in its
tmpfs) and its processes, and an id, hostname and token of its own; the paused sandbox
stays paused, its pause record byte for byte the same, and resumes intact; killed, its
id is a 404 while the batch runs on, and `aenv repo gc` keeps what the batch needs (the
hidden record naming the pause), so its sandboxes still pause and resume; the record
goes with the last of them and the repository verifies clean."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import AENV, REPO, Server

pytestmark = pytest.mark.qemu

PROC = "sleep 4343"


def _out(sbx: Any, cmd: str) -> str:
    return sbx.commands.run(cmd, user="root").stdout.strip()


def _state_of(sbx: Any) -> tuple[str, str, str]:
    """(the disk file, the tmpfs file, the pid of the background process) of a sandbox."""
    return (sbx.files.read("/home/user/state.txt"), _out(sbx, "cat /dev/shm/only-in-memory"),
            _out(sbx, f"pgrep -f '^{PROC}$' || true"))


def _record(server: Server, name: str) -> bytes | None:
    path = server.data_dir / "repo" / "catalog" / name
    return path.read_bytes() if path.exists() else None


def _repo(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    done = subprocess.run([*AENV, "--data-dir", str(server.data_dir), "repo", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_a_batch_from_a_paused_sandbox(sdk_env: Server, tmp_path: Path) -> None:
    from e2b import Sandbox, SandboxState

    server = sdk_env
    sbx = Sandbox.create(timeout=600, metadata={"suite": "pause-fork"})
    sid = sbx.sandbox_id
    kids: list[str] = []
    try:
        sbx.files.write("/home/user/state.txt", "written before the pause")
        sbx.commands.run("echo kept-in-ram > /dev/shm/only-in-memory", user="root")
        sbx.commands.run(PROC, background=True)
        before = _state_of(sbx)
        assert before[0] == "written before the pause" and before[1] == "kept-in-ram" and before[2]
        assert sbx.pause() is True
        deadline = time.monotonic() + 120
        while (pause_record := _record(server, f"paused-{sid}")) is None:     # its commit runs behind
            assert time.monotonic() < deadline, "the pause was not committed"
            time.sleep(0.2)

        status, _, body = server.request("POST", f"/snapshots/{sid}/fork",
                                         {"count": 3, "timeout": 600, "metadata": {"batch": "1"}})
        assert status == 201 and len(body) == 3, body
        assert all("sandbox" in r for r in body), body
        kids = [r["sandbox"]["sandboxID"] for r in body]
        hidden = {r["sandbox"]["templateID"] for r in body}
        assert len(set(kids) | {sid}) == 4 and len(hidden) == 1
        tid = hidden.pop()
        assert len({r["sandbox"]["envdAccessToken"] for r in body}) == 3
        record = json.loads(_record(server, tid) or b"{}")
        roles = dict(record["manifests"])
        paused_roles = dict(json.loads(pause_record)["manifests"])
        # the hidden record names the pause's manifests: nothing was copied
        assert record["kind"] == "template" and roles == paused_roles, (roles, paused_roles)
        assert dict(record["meta"])["hidden"] == "pause" and dict(record["meta"])["snapshot_of"] == sid

        for kid in kids:
            child = Sandbox.connect(kid)
            assert _state_of(child) == before, kid      # same files, same process (same pid)
            assert _out(child, "hostname") == kid
            assert Sandbox.get_info(kid).metadata == {"batch": "1"}
            child.files.write("/home/user/mine.txt", kid)      # they diverge from here on

        # the paused sandbox: untouched, and it resumes as it was
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        assert _record(server, f"paused-{sid}") == pause_record
        back = Sandbox.connect(sid)
        assert _state_of(back) == before and _out(back, "hostname") == sid
        assert not back.files.exists("/home/user/mine.txt")
        back.kill()
        status, _, body = server.request("POST", f"/snapshots/{sid}/fork", {"count": 1})
        assert status == 404, body

        # the batch outlives its source: gc keeps what it needs, and it pauses and resumes
        assert _record(server, f"paused-{sid}") is None and _record(server, tid) is not None
        _repo(server, "gc", "--grace", "0")
        _repo(server, "verify")
        for kid in kids:
            child = Sandbox.connect(kid)
            assert child.pause() is True
            assert Sandbox.get_info(kid).state == SandboxState.PAUSED
        for kid in kids:
            child = Sandbox.connect(kid)
            assert _state_of(child) == before and child.files.read("/home/user/mine.txt") == kid
        # a batch from a child's pause (its template the hidden record) works the same way
        Sandbox.connect(kids[0]).pause()
        status, _, body = server.request("POST", f"/snapshots/{kids[0]}/fork", {"count": 1})
        assert status == 201 and "sandbox" in body[0], body
        grandchild = Sandbox.connect(body[0]["sandbox"]["sandboxID"])
        kids.append(grandchild.sandbox_id)
        assert _state_of(grandchild) == before and grandchild.files.read("/home/user/mine.txt") == kids[0]
    finally:
        for kid in kids + [sid]:
            server.request("DELETE", f"/sandboxes/{kid}")
    # with the last of its sandboxes gone, the node dropped the hidden record
    assert _record(server, tid) is None
    _repo(server, "gc", "--grace", "0")
    _repo(server, "verify")
