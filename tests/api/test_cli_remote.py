"""`aenv sandbox|snapshot|files` as clients of a running `aenv server` (--url, --api-key)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import AENV, REPO, Server

pytestmark = pytest.mark.qemu


def aenv(server: Server, *args: str, ok: bool = True, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([*AENV, *args[:2], "--url", server.url, "--api-key", server.api_key, *args[2:]],
                          cwd=REPO, capture_output=True, input=stdin, timeout=300)
    if ok:
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done


def test_sandbox_lifecycle_through_the_cli(server: Server, tmp_path: Path) -> None:
    sid = aenv(server, "sandbox", "create", "-m", "suite=cli", "-e", "AENV_CLI=yes", "--timeout", "600")
    sid_text = sid.stdout.decode().strip()
    assert sid_text.startswith("sbx-")
    try:
        rows = json.loads(aenv(server, "sandbox", "ls", "-m", "suite=cli", "-o", "json").stdout)
        assert [r["sandboxID"] for r in rows] == [sid_text]
        table = aenv(server, "sandbox", "ls", "-m", "suite=cli").stdout.decode()
        assert table.splitlines()[0].startswith("SANDBOXID") and sid_text in table

        run = aenv(server, "sandbox", "exec", sid_text, "--", "echo $AENV_CLI; echo err >&2; exit 7", ok=False)
        assert run.returncode == 7 and run.stdout == b"yes\n" and run.stderr == b"err\n"
        got = json.loads(aenv(server, "sandbox", "exec", sid_text, "-o", "json", "--", "uname", "-s").stdout)
        assert got == {"exitCode": 0, "stdout": "Linux\n", "stderr": ""}

        local = tmp_path / "in.bin"
        local.write_bytes(bytes(range(256)) * 100)
        aenv(server, "files", "put", sid_text, str(local), "/home/user/in.bin")
        aenv(server, "files", "get", sid_text, "/home/user/in.bin", str(tmp_path / "out.bin"))
        assert (tmp_path / "out.bin").read_bytes() == local.read_bytes()
        assert aenv(server, "files", "get", sid_text, "/home/user/in.bin").stdout == local.read_bytes()
        missing = aenv(server, "files", "get", sid_text, "/nope", ok=False)
        assert missing.returncode == 1 and missing.stderr.decode().startswith("aenv: error: server answered 404")

        aenv(server, "sandbox", "timeout", sid_text, "900")
        info = json.loads(aenv(server, "sandbox", "info", sid_text, "-o", "json").stdout)
        assert info["state"] == "running" and info["metadata"] == {"suite": "cli"}

        aenv(server, "sandbox", "pause", sid_text)
        assert json.loads(aenv(server, "sandbox", "info", sid_text, "-o", "json").stdout)["state"] == "paused"
        aenv(server, "sandbox", "resume", sid_text)
        run = aenv(server, "sandbox", "exec", sid_text, "--", "cat /home/user/in.bin | wc -c")
        assert run.stdout.decode().strip() == "25600"

        snap = aenv(server, "sandbox", "snapshot", sid_text).stdout.decode().strip()
        listed = json.loads(aenv(server, "snapshot", "ls", "-o", "json").stdout)
        assert snap in [s["snapshotID"] for s in listed]
        aenv(server, "snapshot", "rm", snap)
        assert snap not in [s["snapshotID"] for s in json.loads(aenv(server, "snapshot", "ls", "-o", "json").stdout)]

        forks = json.loads(aenv(server, "sandbox", "fork", sid_text, "-n", "1", "-o", "json").stdout)
        child = forks[0]["sandbox"]["sandboxID"]
        assert aenv(server, "sandbox", "exec", child, "--", "echo $AENV_CLI").stdout == b"yes\n"
        aenv(server, "sandbox", "kill", child)
    finally:
        aenv(server, "sandbox", "kill", sid_text)
    assert json.loads(aenv(server, "sandbox", "ls", "-m", "suite=cli", "-o", "json").stdout) == []
    gone = aenv(server, "sandbox", "kill", sid_text, ok=False)
    assert gone.returncode == 1 and "404" in gone.stderr.decode() and b"Traceback" not in gone.stderr


def test_cli_errors_are_one_line(server: Server) -> None:
    bad_key = subprocess.run([*AENV, "sandbox", "ls", "--url", server.url, "--api-key", "e2b_wrong"],
                             cwd=REPO, capture_output=True, timeout=60)
    assert bad_key.returncode == 1 and bad_key.stderr.decode().startswith("aenv: error: server answered 401")
    down = subprocess.run([*AENV, "sandbox", "ls", "--url", "http://127.0.0.1:9", "--api-key", "k"],
                          cwd=REPO, capture_output=True, timeout=60)
    assert down.returncode == 1 and "cannot reach the aenv server" in down.stderr.decode()
    bad_meta = subprocess.run([*AENV, "sandbox", "create", "--url", server.url, "--api-key", server.api_key,
                               "-m", "novalue"], cwd=REPO, capture_output=True, timeout=60)
    assert bad_meta.returncode == 2 and b"KEY=VALUE" in bad_meta.stderr and b"Traceback" not in bad_meta.stderr
