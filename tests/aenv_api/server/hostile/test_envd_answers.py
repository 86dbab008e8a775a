"""A guest that replaces its envd (issue 28): as root it kills envd and serves envd's port
itself, answering ``/init`` and ``/health`` (anything but ``/metrics``) with a body that
never ends. The node then forks it into 16 and pauses and resumes it, while a neighbour
works: every child and the resume fail with a clear error at the bound of what the node
reads from an envd (aenv_vm/envd_client.py ``MAX_ANSWER``), the node's RSS and
``/health`` stay within the harness's bounds, and the node still creates sandboxes.

``/metrics`` is answered as envd does, so the node keeps the guest for responsive and
the pause keeps its memory (a pause of an unresponsive guest resumes by cold boot,
which would start a real envd again).

Before the offence the node twice forks a well-behaved sandbox into 16, pauses and
resumes it (``warm_up``): a node's first forks of 16 grow its RSS whatever the guest
does (thread pools, allocator arenas, code run for the first time; measured here: +94
MiB the first, +19 MiB the second, then +17 MiB for the hostile one), and what is
measured is what the offence costs on a node that has forked before. Of what remains
(~38 MiB alone), ~21 MiB is the capture buffer the fork's snapshot reads this busy
guest's private pages into (aenv_vm/sandboxes/capture.py), not the envd answers; the
pause's commit and the resume read the delta file window by window and drop each
window from the node's RSS (``Delta.release``)."""
from __future__ import annotations

import http.client
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv_vm.envd_client import MAX_ANSWER

from ..conftest import Server, serving
from .watch import watching

pytestmark = [pytest.mark.qemu]

MARK = "X-Hostile-Envd"
FORKS = 16

HOSTILE_ENVD = r'''
import json, os, signal, socket, threading, time
PORT = 49983
def envd_pids():
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"-m" in argv and b"envd" in argv:
                yield int(p)
def serve(c):
    try:
        c.settimeout(60)
        data = b""
        while b"\r\n\r\n" not in data:
            got = c.recv(65536)
            if not got:
                return
            data += got
        if data.split(b" ", 2)[1].startswith(b"/metrics"):
            body = json.dumps({"cpu_count": 1, "cpu_used_pct": 1.0, "mem_used": 1 << 24, "mem_total": 1 << 28,
                               "disk_used": 1 << 24, "disk_total": 1 << 30}).encode()
            c.sendall(b"HTTP/1.1 200 OK\r\nMARK: 1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                      b"Connection: close\r\n\r\n" % len(body) + body)
            return
        c.sendall(b"HTTP/1.1 200 OK\r\nMARK: 1\r\nContent-Type: application/json\r\n\r\n")
        block = b"x" * 65536
        while True:
            c.sendall(block)
    except OSError:
        pass
    finally:
        c.close()
time.sleep(1.0)     # the command that started this has answered by now
for pid in envd_pids():
    os.kill(pid, signal.SIGKILL)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
deadline = time.time() + 30
while True:
    try:
        s.bind(("0.0.0.0", PORT))
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.005)
s.listen(128)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''.replace("MARK", MARK)


@pytest.fixture(scope="module")
def server(node_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The module's node, room for 16 children and their restores all admitted (so each
    one meets the hostile envd rather than the restore queue's 429)."""
    env = {"AENV_SERVER__MAX_SANDBOXES": "40", "AENV_VM__RESTORE_MAX_WAIT": "600.0"}
    with serving(node_data_dir, tmp_path_factory.mktemp("api-logs"), env=env) as srv:
        yield srv


def hostile_envd_answers(node: Server, sbx: Any) -> bool:
    """Whether the sandbox's envd port now answers with the hostile server's head (read
    through the node's proxy; the endless body is left unread)."""
    url = urllib.parse.urlsplit(node.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    try:
        conn.request("GET", "/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                                "X-Access-Token": sbx._envd_access_token})
        return conn.getresponse().getheader(MARK) == "1"
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def warm_up(node: Server) -> None:
    """The node's first two forks of 16, pauses and resumes, of a sandbox that behaves."""
    from e2b import Sandbox

    benign = Sandbox.create(timeout=300)
    try:
        # as busy as the offender, whose init restarts envd every second (and fails: the
        # port is taken): a pause or fork snapshot reads the pages a guest dirtied
        benign.commands.run("setsid sh -c 'while :; do python3 -c pass; sleep 1; done' >/dev/null 2>&1 </dev/null &",
                            user="root", timeout=60)
        for _ in range(2):
            status, _, forks = node.request("POST", f"/sandboxes/{benign.sandbox_id}/fork", {"count": FORKS})
            assert status == 201, forks
            for child in forks:
                if "sandbox" in child:
                    node.request("DELETE", f"/sandboxes/{child['sandbox']['sandboxID']}")
            assert node.request("POST", f"/sandboxes/{benign.sandbox_id}/pause")[0] == 204
            assert node.request("POST", f"/v2/sandboxes/{benign.sandbox_id}/connect", {"timeout": 300})[0] == 201
    finally:
        benign.kill()


def test_a_guest_whose_envd_answers_without_end_is_forked_paused_and_resumed(node: Server,
                                                                            neighbour: Any) -> None:
    from e2b import Sandbox

    warm_up(node)
    offender = Sandbox.create(timeout=900)
    sid = offender.sandbox_id
    try:
        offender.files.write("/tmp/hostile_envd.py", HOSTILE_ENVD)
        offender.commands.run("setsid python3 /tmp/hostile_envd.py >/tmp/hostile.log 2>&1 </dev/null &",
                              user="root", timeout=60)
        deadline = time.monotonic() + 120
        while not hostile_envd_answers(node, offender):
            assert time.monotonic() < deadline, "the hostile envd never answered"
            time.sleep(1.0)

        with watching(node, neighbour) as harm:
            t0 = time.monotonic()
            status, _, forks = node.request("POST", f"/sandboxes/{sid}/fork", {"count": FORKS})
            fork_seconds = time.monotonic() - t0
            status_pause, _, paused = node.request("POST", f"/sandboxes/{sid}/pause")
            t0 = time.monotonic()
            status_resume, _, resumed = node.request("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 300})
            resume_seconds = time.monotonic() - t0
        harm.check(f"an envd answering without end, forked into {FORKS}, paused and resumed")
        print(f"[hostile] fork of {FORKS}: {fork_seconds:.1f} s; resume: {resume_seconds:.1f} s")

        # every child failed alone, saying why; none is left running
        assert status == 201 and len(forks) == FORKS, (status, forks)
        for child in forks:
            assert "sandbox" not in child, child
            assert child["error"]["code"] == 500, child
            assert f"answer larger than {MAX_ANSWER} bytes" in child["error"]["message"], child
            assert "/init" in child["error"]["message"], child
        # the pause keeps the guest's memory; the resume fails at /health's bound, at once
        assert status_pause == 204, paused
        assert status_resume == 500 and resumed["code"] == 500, resumed
        assert f"answer larger than {MAX_ANSWER} bytes" in resumed["message"], resumed
        assert "/health" in resumed["message"] and sid in resumed["message"], resumed
        assert resume_seconds < 60, resume_seconds
        status, _, info = node.request("GET", f"/sandboxes/{sid}")
        assert status == 200 and info["state"] == "paused", info
        listed = [s["sandboxID"] for s in node.request("GET", "/v2/sandboxes?state=running")[2]]
        assert listed and set(listed) <= {neighbour.sandbox_id}, listed

        # the node still works: a new sandbox runs a command
        fresh = Sandbox.create(timeout=120)
        try:
            assert fresh.commands.run("echo fine").stdout == "fine\n"
        finally:
            fresh.kill()
    finally:
        status, _, body = node.request("DELETE", f"/sandboxes/{sid}")
        assert status in (204, 404), body
