"""`aenv sandbox|snapshot|files` as clients of a running `aenv server` (--url, --api-key).
What needs no guest (one-line errors, a TTL expiry in the logs) runs against the API
in-process (test_sandbox_cli_inprocess.py)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.aenv_api.server.conftest import AENV, REPO, HttpClient, Server

pytestmark = pytest.mark.qemu


def aenv(server: HttpClient, *args: str, ok: bool = True, stdin: bytes | None = None) -> subprocess.CompletedProcess:
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
        # a batch from its pause: its files; it stays paused
        batch = json.loads(aenv(server, "snapshot", "fork", sid_text, "-n", "1", "-o", "json").stdout)
        kid = batch[0]["sandbox"]["sandboxID"]
        assert kid != sid_text
        assert aenv(server, "sandbox", "exec", kid, "--", "wc -c < /home/user/in.bin").stdout == b"25600\n"
        aenv(server, "sandbox", "kill", kid)
        assert json.loads(aenv(server, "sandbox", "info", sid_text, "-o", "json").stdout)["state"] == "paused"
        aenv(server, "sandbox", "resume", sid_text)
        run = aenv(server, "sandbox", "exec", sid_text, "--", "cat /home/user/in.bin | wc -c")
        assert run.stdout.decode().strip() == "25600"

        snap = aenv(server, "sandbox", "snapshot", sid_text).stdout.decode().strip()
        listed = json.loads(aenv(server, "snapshot", "ls", "-o", "json").stdout)
        assert snap in [s["snapshotID"] for s in listed]
        batch = json.loads(aenv(server, "snapshot", "fork", snap, "-n", "2", "-m", "rollout=7", "-o", "json").stdout)
        kids = [r["sandbox"]["sandboxID"] for r in batch]
        assert len(set(kids)) == 2
        for kid in kids:     # the snapshot's files, the request's metadata
            assert aenv(server, "sandbox", "exec", kid, "--", "wc -c < /home/user/in.bin").stdout == b"25600\n"
            assert json.loads(aenv(server, "sandbox", "info", kid, "-o", "json").stdout)["metadata"] == \
                {"rollout": "7"}
            aenv(server, "sandbox", "kill", kid)
        bad = aenv(server, "snapshot", "fork", snap, "-m", "novalue", ok=False)
        assert bad.returncode != 0 and b"--metadata must be KEY=VALUE, got 'novalue'" in bad.stderr
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




def test_sandbox_logs(server: Server) -> None:
    """Lifecycle events and the guest console through `aenv sandbox logs` and E2B's
    v1/v2 logs endpoints; filters, bad queries, unknown and killed sandboxes."""
    sid = aenv(server, "sandbox", "create", "--timeout", "600").stdout.decode().strip()
    try:
        aenv(server, "sandbox", "exec", sid, "--user", "root", "--", "echo console-marker-42 > /dev/console")
        aenv(server, "sandbox", "timeout", sid, "700")
        aenv(server, "sandbox", "pause", sid)
        aenv(server, "sandbox", "resume", sid)
        child = json.loads(aenv(server, "sandbox", "fork", sid, "-o", "json").stdout)[0]["sandbox"]["sandboxID"]

        entries = json.loads(aenv(server, "sandbox", "logs", sid, "-o", "json").stdout)
        events = [e["message"] for e in entries if e["fields"].get("source") != "console"]
        assert events == ["sandbox created", "timeout set", "sandbox paused", "sandbox resumed", "sandbox forked"]
        assert entries[-1]["fields"]["children"] == child
        console = [e for e in entries if e["fields"].get("source") == "console"]
        assert any(e["message"] == "console-marker-42" for e in console), console
        stamps = [e["timestamp"] for e in entries]
        assert stamps == sorted(stamps)
        text = aenv(server, "sandbox", "logs", sid, "--search", "paused").stdout.decode().splitlines()
        assert len(text) == 1 and text[0].split()[1:3] == ["INFO", "sandbox"] and text[0].endswith("]")
        assert json.loads(aenv(server, "sandbox", "logs", sid, "--level", "warn", "-o", "json").stdout) == []
        child_log = json.loads(aenv(server, "sandbox", "logs", child, "-o", "json").stdout)
        assert [(e["message"], e["fields"].get("parent")) for e in child_log] == [("sandbox forked", sid)]

        status, _, v1 = server.request("GET", f"/sandboxes/{sid}/logs?limit=2")
        assert status == 200 and len(v1["logs"]) == 2 and v1["logs"][0]["line"] == "sandbox created"
        assert v1["logEntries"][0]["message"] == "sandbox created" and v1["logEntries"][0]["level"] == "info"
        status, _, v2 = server.request("GET", f"/v2/sandboxes/{sid}/logs?direction=backward&limit=1")
        assert status == 200 and [e["message"] for e in v2["logs"]] == ["sandbox forked"]
        for bad in ("limit=-1", "limit=1001", "direction=sideways", "level=loud", "cursor=x", "search=" + "s" * 300):
            status, _, err = server.request("GET", f"/v2/sandboxes/{sid}/logs?{bad}")
            assert status == 400 and set(err) == {"code", "message"} and err["code"] == 400, bad
        aenv(server, "sandbox", "kill", child)
    finally:
        aenv(server, "sandbox", "kill", sid)
    for path in (f"/sandboxes/{sid}/logs", f"/v2/sandboxes/{sid}/logs", "/v2/sandboxes/sbx-nope/logs"):
        status, _, err = server.request("GET", path)
        assert status == 404 and err["code"] == 404
    gone = aenv(server, "sandbox", "logs", sid, ok=False)
    assert gone.returncode == 1 and "404" in gone.stderr.decode() and b"Traceback" not in gone.stderr
