"""Connect streaming details checked on the wire: keepalives, deadlines,
re-attach by tag, stdin default, watcher lifecycles and cleanup."""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import struct
import time

import pytest

from .conftest import Envd
from .test_bad_input import call, env, frames

STREAM = "application/connect+json"


class FrameStream:
    """A server-streaming call read frame by frame as it arrives."""

    def __init__(self, envd: Envd, path: str, msg: dict, headers: dict[str, str] | None = None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", envd.port, timeout=30)
        self.conn.request("POST", path, body=env(json.dumps(msg).encode()),
                          headers={"Content-Type": STREAM, **(headers or {})})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200 and self.resp.getheader("Content-Type") == STREAM

    def next(self) -> tuple[int, dict]:
        head = self.resp.read(5)
        flags, n = struct.unpack(">BI", head)
        return flags, json.loads(self.resp.read(n))

    def close(self) -> None:
        self.conn.close()


def start_msg(cmd: str, **extra: object) -> dict:
    return {"process": {"cmd": "/bin/bash", "args": ["-c", cmd]}, **extra}


def test_keepalive_events_at_requested_interval(envd: Envd) -> None:
    s = FrameStream(envd, "/process.Process/Start", start_msg("sleep 2.4; echo done"), {"Keepalive-Ping-Interval": "1"})
    try:
        events = []
        while True:
            flags, msg = s.next()
            if flags & 2:
                assert msg == {}
                break
            events.append(msg["event"])
        kinds = [next(iter(e)) for e in events]
        assert kinds[0] == "start" and kinds[-1] == "end"
        assert kinds.count("keepalive") == 2, kinds
        assert base64.b64decode(events[-2]["data"]["stdout"]) == b"done\n"
        assert events[-1]["end"] == {"exited": True, "status": "exit status 0"}  # exitCode 0 omitted
    finally:
        s.close()


def test_connect_by_tag_and_connect_deadline_does_not_kill(envd: Envd) -> None:
    s = FrameStream(envd, "/process.Process/Start",
                    start_msg("for i in 1 2 3 4 5 6 7 8; do echo tick$i; sleep 0.25; done", tag="ticker"))
    try:
        pid = s.next()[1]["event"]["start"]["pid"]
        listed = json.loads(call(envd, "/process.Process/List", b"{}")[2])["processes"]
        mine = [p for p in listed if p["pid"] == pid][0]
        assert mine["tag"] == "ticker" and mine["config"]["args"][0] == "-c"
        # a second observer attached by tag, with a short deadline
        c = FrameStream(envd, "/process.Process/Connect", {"process": {"tag": "ticker"}}, {"Connect-Timeout-Ms": "600"})
        first = c.next()[1]
        assert first == {"event": {"start": {"pid": pid}}}
        while True:
            flags, msg = c.next()
            if flags & 2:
                assert msg["error"]["code"] == "deadline_exceeded"
                break
            assert "data" in msg["event"]
        c.close()
        # the process itself is unaffected: the original stream runs to the end
        out = b""
        while True:
            flags, msg = s.next()
            if flags & 2:
                break
            ev = msg["event"]
            if "data" in ev:
                out += base64.b64decode(ev["data"]["stdout"])
            if "end" in ev:
                assert ev["end"]["exited"] is True
        assert out.endswith(b"tick8\n")
    finally:
        s.close()


def test_stdin_defaults_to_open_when_absent(envd: Envd) -> None:
    s = FrameStream(envd, "/process.Process/Start", {"process": {"cmd": "/bin/cat"}})
    try:
        pid = s.next()[1]["event"]["start"]["pid"]
        body = json.dumps({"process": {"pid": pid}, "input": {"stdin": base64.b64encode(b"echo-me").decode()}}).encode()
        assert call(envd, "/process.Process/SendInput", body)[0] == 200
        assert call(envd, "/process.Process/CloseStdin", json.dumps({"process": {"pid": pid}}).encode())[0] == 200
        out = b""
        while True:
            flags, msg = s.next()
            if flags & 2:
                break
            if "data" in msg["event"]:
                out += base64.b64decode(msg["event"]["data"]["stdout"])
        assert out == b"echo-me"
    finally:
        s.close()


def test_disconnected_background_output_is_drained(envd: Envd) -> None:
    # 20 MiB of output with nobody listening must not block the process on a full pipe
    s = FrameStream(envd, "/process.Process/Start", start_msg("head -c 20971520 /dev/zero"))
    pid = s.next()[1]["event"]["start"]["pid"]
    s.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        listed = json.loads(call(envd, "/process.Process/List", b"{}")[2]).get("processes", [])
        if all(p["pid"] != pid for p in listed):
            break
        time.sleep(0.1)
    else:
        pytest.fail("background process stayed blocked")


def _inotify_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                n += 1
        except OSError:
            pass
    return n


def test_watchers_are_released(envd: Envd, workdir) -> None:  # type: ignore[no-untyped-def]
    before = _inotify_fds(envd.pid)
    w = FrameStream(envd, "/filesystem.Filesystem/WatchDir", {"path": str(workdir), "includeEntry": True})
    assert w.next() == (0, {"start": {}})
    (workdir / "n.txt").write_text("abc")
    flags, msg = w.next()
    ev = msg["filesystem"]
    assert ev["name"] == "n.txt" and ev["type"] == "EVENT_TYPE_CREATE"
    assert ev["entry"]["path"] == str(workdir / "n.txt")
    assert _inotify_fds(envd.pid) == before + 1
    w.close()  # client goes away: envd must drop the watch
    deadline = time.monotonic() + 5
    while _inotify_fds(envd.pid) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _inotify_fds(envd.pid) == before

    s, _, raw = call(envd, "/filesystem.Filesystem/CreateWatcher", json.dumps({"path": str(workdir)}).encode())
    wid = json.loads(raw)["watcherId"]
    (workdir / "p.txt").write_text("x")
    time.sleep(0.2)
    got = json.loads(call(envd, "/filesystem.Filesystem/GetWatcherEvents", json.dumps({"watcherId": wid}).encode())[2])
    assert {"name": "p.txt", "type": "EVENT_TYPE_CREATE"} in got["events"]
    assert call(envd, "/filesystem.Filesystem/RemoveWatcher", json.dumps({"watcherId": wid}).encode())[0] == 200
    assert _inotify_fds(envd.pid) == before
    assert call(envd, "/filesystem.Filesystem/RemoveWatcher", json.dumps({"watcherId": wid}).encode())[0] == 404


def test_unary_snake_case_and_int64_strings(envd: Envd, workdir) -> None:  # type: ignore[no-untyped-def]
    (workdir / "s.bin").write_bytes(b"12345")
    s, ct, raw = call(envd, "/filesystem.Filesystem/Stat", json.dumps({"path": str(workdir / "s.bin")}).encode())
    entry = json.loads(raw)["entry"]
    assert s == 200 and ct == "application/json"
    assert entry["size"] == "5" and entry["type"] == "FILE_TYPE_FILE" and entry["modifiedTime"].endswith("Z")
    s, _, raw = call(envd, "/filesystem.Filesystem/ListDir", json.dumps({"path": str(workdir), "depth": "1"}).encode())
    assert s == 200 and [e["name"] for e in json.loads(raw)["entries"]] == ["s.bin"]
    body = frames(call(envd, "/process.Process/Start", env(b'{"process": {"cmd": "/bin/true"}, "stdin": false}'), STREAM)[2])
    assert body[0][1]["event"]["start"]["pid"] > 0 and body[-1] == (2, {})


def test_slow_reader_gets_all_output_after_exit(envd: Envd) -> None:
    # The command finishes long before the client reads: nothing may be cut.
    size = 8 * 1024 * 1024
    s = FrameStream(envd, "/process.Process/Start", start_msg(f"head -c {size} /dev/zero; echo -n END"))
    try:
        s.next()
        time.sleep(2.5)  # the process has exited; envd holds the tail for us
        total, tail = 0, b""
        while True:
            flags, msg = s.next()
            if flags & 2:
                assert msg == {}
                break
            ev = msg["event"]
            if "data" in ev:
                chunk = base64.b64decode(ev["data"]["stdout"])
                total += len(chunk)
                tail = (tail + chunk)[-3:]
            elif "end" in ev:
                assert ev["end"]["exited"] is True
        assert total == size + 3 and tail == b"END"
    finally:
        s.close()


def test_background_child_output_is_followed_briefly(envd: Envd) -> None:
    # `cmd &` keeps the pipe open after bash exits: its early output arrives,
    # then the stream ends without waiting for the child to finish.
    t0 = time.monotonic()
    s = FrameStream(envd, "/process.Process/Start", start_msg("(sleep 0.2; echo child; sleep 4) & echo parent"))
    try:
        out = b""
        while True:
            flags, msg = s.next()
            if flags & 2:
                break
            if "data" in msg["event"]:
                out += base64.b64decode(msg["event"]["data"]["stdout"])
        assert out == b"parent\nchild\n"
        assert time.monotonic() - t0 < 5
    finally:
        s.close()


def _recv_all(sock: socket.socket) -> list[bytes]:
    """Every recv() of one response, until its chunked terminator."""
    pieces: list[bytes] = []
    while not b"".join(pieces).endswith(b"\r\n0\r\n\r\n"):
        data = sock.recv(65536)
        assert data, b"".join(pieces)
        pieces.append(data)
    return pieces


def test_pieces_ready_together_leave_in_one_write(envd: Envd) -> None:
    """The head goes with the start event, and a command's end event, the end-of-stream
    frame and the chunked terminator with each other: one write each (a write is one
    send and one wake-up of the reader, e.g. the API's proxy). A single write of a few
    hundred bytes on loopback is never split across recv() calls; separate writes
    often are (a reader that waits between recv()s sees them joined, never split)."""
    body = env(json.dumps(start_msg("sleep 0.3")).encode())
    req = (f"POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nContent-Type: {STREAM}\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", envd.port), timeout=30) as s:
            s.sendall(req)
            pieces = _recv_all(s)
        # the first recv holds the whole head and the start event
        assert b"\r\n\r\n" in pieces[0] and b'"start"' in pieces[0], pieces
        # the recv with the terminator also holds the end event and the end-of-stream frame
        assert b'"end"' in pieces[-1] and b"\x02\x00\x00\x00\x02{}" in pieces[-1], pieces
        assert len(pieces) <= 2, pieces
    # a plain (unary) answer: head and body in one piece
    call_body = b"{}"
    with socket.create_connection(("127.0.0.1", envd.port), timeout=30) as s:
        s.sendall((f"POST /process.Process/List HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(call_body)}\r\n\r\n").encode() + call_body)
        first = s.recv(65536)
    head, _, rest = first.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    assert len(rest) == length, first
