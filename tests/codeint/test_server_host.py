"""The code interpreter server on this host's Debian python3 (the same packages as the
guest's), driven over raw HTTP: what is hard to see through a VM — that a client
closing the connection interrupts the cell, that 100 MiB of output streams through a
server whose memory stays bounded, that a malformed request leaves it serving."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from tests.support import free_port, require


REPO = Path(__file__).resolve().parents[2]
PY = "/usr/bin/python3"


def _has_ipython() -> bool:
    return Path(PY).exists() and subprocess.run([PY, "-c", "import IPython, matplotlib_inline"],
                                                capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, subprocess.Popen]]:
    require(_has_ipython(), "the host's python3 has no IPython (scripts/install.sh installs python3-ipykernel)")
    cwd = tmp_path_factory.mktemp("codeint-cwd")
    port = free_port()
    log = open(tmp_path_factory.mktemp("codeint-log") / "server.log", "wb")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen([PY, "-m", "codeint", "--host", "127.0.0.1", "--port", str(port), "--no-envd",
                             "--cwd", str(cwd), "--log-dir", str(cwd / ".logs")],
                            cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if _get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError("codeint did not become healthy")
        yield port, proc
    finally:
        kids = psutil.Process(proc.pid).children(recursive=True)
        proc.terminate()
        proc.wait(timeout=30)
        for k in kids:
            if k.is_running():
                k.kill()
        gone, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive, f"kernels outlived the server: {alive}"


def _get(port: int, path: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read()


def _execute(port: int, body: dict, timeout: float = 120) -> list[dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/execute", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    return [json.loads(line) for line in r.read().splitlines()]


def _until(s: socket.socket, token: bytes) -> None:
    got = b""
    while token not in got:
        piece = s.recv(4096)
        assert piece, got
        got += piece


def test_disconnect_interrupts_the_cell(server: tuple[int, subprocess.Popen], tmp_path: Path) -> None:
    port, _ = server
    flag = tmp_path / "ran-to-the-end"
    _execute(port, {"code": "kept = 'yes'"})
    s = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"code": f"import time\ntime.sleep(4)\nopen({str(flag)!r}, 'w').close()"}).encode()
    s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (len(body), body))
    _until(s, b"number_of_executions")
    s.close()                                       # what the SDK's timeout does
    t0 = time.monotonic()
    lines = _execute(port, {"code": "kept"})        # waits for the interrupted cell, then runs
    assert time.monotonic() - t0 < 3
    assert [x.get("text") for x in lines if x["type"] == "result"] == ["yes"]
    time.sleep(4.5)
    assert not flag.exists()

    # bash: the cell's programs die, the shell and its state live on
    _execute(port, {"code": "KEEP=1", "language": "bash"})
    s = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"code": f"sleep 4; touch {flag}", "language": "bash"}).encode()
    s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    _until(s, b"number_of_executions")
    s.close()
    lines = _execute(port, {"code": "echo $KEEP", "language": "bash"})
    assert [x["text"] for x in lines if x["type"] == "stdout"] == ["1\n"]
    time.sleep(4.5)
    assert not flag.exists()


def test_100_mib_of_output_with_bounded_memory(server: tuple[int, subprocess.Popen]) -> None:
    port, proc = server
    me = psutil.Process(proc.pid)
    base = me.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.05)
    t = threading.Thread(target=watch)
    t.start()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/execute", json.dumps(
            {"code": "import sys\nchunk = 'x' * (1 << 20)\nfor i in range(100):\n    sys.stdout.write(chunk)\n"}))
        r = c.getresponse()
        got = 0
        lines = 0
        buf = b""
        while True:
            piece = r.read(1 << 16)
            if not piece:
                break
            buf += piece
            *full, buf = buf.split(b"\n")
            for raw in full:
                ev = json.loads(raw)
                lines += 1
                if ev["type"] == "stdout":
                    got += len(ev["text"])
                    assert len(ev["text"]) <= 1 << 20
            time.sleep(0.001)   # a client that reads a little slower than the kernel writes
    finally:
        stop.set()
        t.join()
    assert got == 100 << 20
    assert peak[0] - base < 80 << 20, f"server RSS grew by {(peak[0] - base) >> 20} MiB"


def test_malformed_requests_leave_it_serving(server: tuple[int, subprocess.Popen]) -> None:
    port, _ = server
    for raw in [b"GARBAGE\r\n\r\n", b"POST /execute HTTP/1.1\r\nContent-Length: nope\r\n\r\n",
                b"POST /execute HTTP/1.1\r\nContent-Length: 3\r\n\r\n{x}",
                b"POST /execute HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(raw)
        answer = s.recv(4096)
        s.close()
        assert answer.startswith(b"HTTP/1.1 400"), (raw, answer)
        assert b'"error"' in answer
    s = socket.create_connection(("127.0.0.1", port))   # a client that vanishes inside a body
    s.sendall(b"POST /execute HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"co")
    s.close()
    lines = _execute(port, {"code": "6 * 7"})
    assert [x.get("text") for x in lines if x["type"] == "result"] == ["42"]
    assert lines[-1] == {"type": "end_of_execution"}


def test_a_cell_that_ignores_the_interrupt_costs_its_kernel(server: tuple[int, subprocess.Popen]) -> None:
    port, _ = server
    _execute(port, {"code": "lost = 1"})
    s = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"code": "import time\nwhile True:\n    try:\n        time.sleep(60)\n"
                               "    except KeyboardInterrupt:\n        pass"}).encode()
    s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    _until(s, b"number_of_executions")
    s.close()
    t0 = time.monotonic()
    lines = _execute(port, {"code": "'alive'"})
    waited = time.monotonic() - t0
    assert [x.get("text") for x in lines if x["type"] == "result"] == ["alive"]
    assert 8 < waited < 60, waited          # the 10 s grace, then a new kernel
    errs = [x for x in _execute(port, {"code": "lost"}) if x["type"] == "error"]
    assert errs and errs[0]["name"] == "NameError"
