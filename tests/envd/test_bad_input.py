"""Bad requests get precise Connect/HTTP errors with JSON bodies, and envd
keeps serving (a hypothesis fuzz of the request decoding on the live server)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import urllib.request

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Envd

UNARY = "application/json"
STREAM = "application/connect+json"


def call(envd: Envd, path: str, body: bytes, ctype: str | None = UNARY, method: str = "POST",
         headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", envd.port, timeout=20)
    try:
        h = dict(headers or {})
        if ctype is not None:
            h["Content-Type"] = ctype
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read()
    finally:
        conn.close()


def frames(body: bytes) -> list[tuple[int, dict]]:
    out, off = [], 0
    while off < len(body):
        flags, n = struct.unpack_from(">BI", body, off)
        out.append((flags, json.loads(body[off + 5 : off + 5 + n])))
        off += 5 + n
    assert off == len(body)
    return out


def env(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def unary_error(envd: Envd, path: str, body: bytes, status: int, code: str, ctype: str = UNARY) -> str:
    s, ct, raw = call(envd, path, body, ctype)
    assert (s, ct) == (status, "application/json"), raw
    err = json.loads(raw)
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    return err["message"]


def stream_error(envd: Envd, path: str, body: bytes, code: str) -> str:
    s, ct, raw = call(envd, path, body, STREAM)
    assert (s, ct) == (200, STREAM)
    fs = frames(raw)
    assert fs[-1][0] == 0x02 and fs[-1][1]["error"]["code"] == code, fs
    return fs[-1][1]["error"]["message"]


def healthy(envd: Envd) -> bool:
    return call(envd, "/health", b"", None, "GET")[0] == 204


def test_malformed_envelopes(envd: Envd) -> None:
    start = "/process.Process/Start"
    stream_error(envd, start, b"\x00\x00\x00", "invalid_argument")  # truncated header
    stream_error(envd, start, env(b"{}")[:-1], "invalid_argument")  # truncated payload
    stream_error(envd, start, env(b"{}", flags=0x01), "invalid_argument")  # compressed
    stream_error(envd, start, env(b"{}", flags=0x02), "invalid_argument")  # end-stream from client
    stream_error(envd, start, env(b"{}") + env(b"{}"), "invalid_argument")  # two messages
    stream_error(envd, start, env(b"{oops"), "invalid_argument")  # invalid JSON
    stream_error(envd, start, env(b"[1,2]"), "invalid_argument")  # not an object
    stream_error(envd, start, env(b"{}"), "invalid_argument")  # no process config
    stream_error(envd, start, struct.pack(">BI", 0, 1 << 30), "resource_exhausted")
    assert healthy(envd)


def test_wrong_content_type_unknown_method_bad_json(envd: Envd) -> None:
    unary_error(envd, "/process.Process/List", b"{}", 415, "invalid_argument", ctype="text/plain")
    unary_error(envd, "/process.Process/Start", env(b"{}"), 415, "invalid_argument", ctype=UNARY)
    unary_error(envd, "/process.Process/List", env(b"{}"), 415, "invalid_argument", ctype=STREAM)
    unary_error(envd, "/process.Process/Teleport", b"{}", 404, "unimplemented")
    unary_error(envd, "/filesystem.Filesystem/Stat", b"{not json", 400, "invalid_argument")
    unary_error(envd, "/filesystem.Filesystem/Stat", b'{"path": 5}', 400, "invalid_argument")
    unary_error(envd, "/filesystem.Filesystem/Stat", b'"a string"', 400, "invalid_argument")
    unary_error(envd, "/filesystem.Filesystem/Stat", b"{}", 400, "invalid_argument")
    unary_error(envd, "/filesystem.Filesystem/Stat", b"{}", 400, "invalid_argument")
    s, _, raw = call(envd, "/filesystem.Filesystem/Stat", b"", UNARY, "GET")
    assert s == 405 and json.loads(raw)["code"] == "unimplemented"
    s, ct, raw = call(envd, "/no/such/route", b"", None, "GET")
    assert (s, ct) == (404, "application/json") and json.loads(raw)["code"] == 404
    s, _, raw = call(envd, "/filesystem.Filesystem/Stat", b'{"path":"/"}', UNARY, headers={"Connect-Timeout-Ms": "soon"})
    assert s == 400 and json.loads(raw)["code"] == "invalid_argument"
    s, _, raw = call(envd, "/process.Process/List", b"{}", UNARY, headers={"Connect-Protocol-Version": "2"})
    assert s == 400 and json.loads(raw)["code"] == "invalid_argument"
    assert healthy(envd)


def test_missing_paths_permission_and_signals(envd: Envd, workdir) -> None:  # type: ignore[no-untyped-def]
    missing = json.dumps({"path": str(workdir / "missing")}).encode()
    for method in ("Stat", "ListDir"):
        unary_error(envd, f"/filesystem.Filesystem/{method}", missing, 404, "not_found")
    # Remove of what is not there succeeds (E2B's envd: Go's os.RemoveAll)
    req = urllib.request.Request(envd.url + "/filesystem.Filesystem/Remove", data=missing, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert (r.status, json.loads(r.read())) == (200, {})
    stream_error(envd, "/filesystem.Filesystem/WatchDir", env(missing), "not_found")
    unary_error(envd, "/filesystem.Filesystem/Remove", b'{"path": "/proc/1/status"}', 403, "permission_denied")
    (workdir / "file").write_text("x")
    unary_error(envd, "/filesystem.Filesystem/ListDir", json.dumps({"path": str(workdir / "file")}).encode(),
                400, "invalid_argument")
    unary_error(envd, "/filesystem.Filesystem/GetWatcherEvents", b'{"watcherId": "nope"}', 404, "not_found")

    unary_error(envd, "/process.Process/SendSignal", b'{"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}',
                404, "not_found")
    unary_error(envd, "/process.Process/SendInput", b'{"process": {"tag": "nope"}, "input": {"stdin": "aGk="}}',
                404, "not_found")
    stream_error(envd, "/process.Process/Connect", env(b'{"process": {"pid": 999999}}'), "not_found")

    # a live process to aim bad signals and input at
    start = env(json.dumps({"process": {"cmd": "/bin/sleep", "args": ["30"]}, "tag": "victim", "stdin": False}).encode())
    conn = http.client.HTTPConnection("127.0.0.1", envd.port, timeout=20)
    conn.request("POST", "/process.Process/Start", body=start, headers={"Content-Type": STREAM})
    resp = conn.getresponse()
    head = resp.read(5)
    first = json.loads(resp.read(struct.unpack(">BI", head)[1]))
    pid = first["event"]["start"]["pid"]
    try:
        for sig in ('"SIGNAL_UNSPECIFIED"', '"SIGHUP"', "2", "[]", "true"):
            body = f'{{"process": {{"pid": {pid}}}, "signal": {sig}}}'.encode()
            unary_error(envd, "/process.Process/SendSignal", body, 400, "invalid_argument")
        unary_error(envd, "/process.Process/SendInput",
                    f'{{"process": {{"pid": {pid}}}, "input": {{"stdin": "aGk="}}}}'.encode(), 400, "failed_precondition")
        unary_error(envd, "/process.Process/SendInput",
                    f'{{"process": {{"pid": {pid}}}, "input": {{"stdin": "!!notbase64"}}}}'.encode(), 400, "invalid_argument")
        unary_error(envd, "/process.Process/Update",
                    f'{{"process": {{"pid": {pid}}}, "pty": {{"size": {{"cols": 10, "rows": 5}}}}}}'.encode(), 400,
                    "failed_precondition")
        s, _, _ = call(envd, "/process.Process/SendSignal",
                       b'{"process": {"tag": "victim"}, "signal": "SIGNAL_SIGTERM"}')
        assert s == 200
        rest = frames(resp.read())
        end = [f for _, f in rest if "event" in f and "end" in f["event"]][0]["event"]["end"]
        assert end == {"exitCode": -1, "exited": False, "status": "signal: terminated"}
        assert rest[-1] == (0x02, {})
    finally:
        conn.close()
    assert healthy(envd)


def test_bad_files_requests(envd: Envd, workdir) -> None:  # type: ignore[no-untyped-def]
    def files(method: str, query: str, body: bytes = b"", ctype: str | None = None, **hdr: str) -> tuple[int, dict]:
        s, ct, raw = call(envd, "/files" + query, body, ctype, method, headers=hdr)
        assert ct == "application/json", (s, raw)
        return s, json.loads(raw)

    assert files("GET", "")[0] == 400
    s, err = files("GET", f"?path={workdir}/missing")
    assert s == 404 and err["code"] == 404 and "does not exist" in err["message"]
    assert files("GET", f"?path={workdir}")[0] == 400
    assert files("GET", f"?path={workdir}/x&username=nobody-here")[0] == 401
    assert files("GET", "?path=/etc/hostname", **{"Accept-Encoding": "br, identity;q=0"})[0] == 406
    assert files("POST", f"?path={workdir}/a", b"x", "text/plain")[0] == 400
    assert files("POST", "", b"x", "application/octet-stream")[0] == 400  # octet-stream needs ?path
    assert files("POST", f"?path={workdir}/a", b"not gzip", "application/octet-stream", **{"Content-Encoding": "gzip"})[0] == 400
    assert files("POST", f"?path={workdir}/a", b"--b\r\nbroken", "multipart/form-data; boundary=b")[0] == 400
    assert files("POST", f"?path={workdir}/a", b"", "multipart/form-data")[0] == 400  # no boundary
    assert files("POST", "?path=/sys/kernel/notes", b"x", "application/octet-stream")[0] == 403
    assert files("POST", f"?path={workdir}/a", b"x", "application/octet-stream", **{"X-Metadata-k": "v" * 5000})[0] == 400
    assert not (workdir / "a").exists()
    (workdir / "f").write_text("x")
    assert files("POST", f"?path={workdir}/f/under", b"x", "application/octet-stream")[0] == 400
    os.mkfifo(workdir / "fifo")  # would block envd forever if opened
    assert files("GET", f"?path={workdir}/fifo")[0] == 400
    assert files("POST", f"?path={workdir}/fifo", b"x", "application/octet-stream")[0] == 400
    assert healthy(envd)


def test_garbage_http_is_rejected_and_server_survives(envd: Envd) -> None:
    for raw in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET /health HTTP/1.1\r\nbad header\r\n\r\n",
                b"POST /files HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", b"\xff\xfe\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", envd.port), timeout=10) as s:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 4") or reply.startswith(b"HTTP/1.1 5"), reply
    assert healthy(envd)


FUZZ_PATHS = [
    "/process.Process/List", "/process.Process/Connect", "/process.Process/SendSignal", "/process.Process/Update",
    "/process.Process/SendInput", "/process.Process/StreamInput", "/filesystem.Filesystem/Stat",
    "/filesystem.Filesystem/ListDir", "/filesystem.Filesystem/WatchDir", "/filesystem.Filesystem/GetWatcherEvents",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["process", "pid", "tag", "path", "depth", "signal", "input", "stdin", "watcherId", "x"]), c, max_size=3),
    max_leaves=8,
)
bodies = st.one_of(
    st.binary(max_size=64),
    json_values.map(lambda v: json.dumps(v).encode()),
    json_values.map(lambda v: env(json.dumps(v).encode())),
    st.tuples(st.integers(0, 255), st.binary(max_size=32)).map(lambda t: env(t[1], t[0])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(FUZZ_PATHS), body=bodies, ctype=st.sampled_from([UNARY, STREAM, "text/plain", None]))
def test_fuzz_request_decoding(envd: Envd, path: str, body: bytes, ctype: str | None) -> None:
    s, ct, raw = call(envd, path, body, ctype, headers={"Connect-Timeout-Ms": "2000"})
    if s == 200 and ct == STREAM:
        fs = frames(raw)
        assert fs[-1][0] == 0x02
        if "error" in fs[-1][1]:
            assert fs[-1][1]["error"]["code"] in ("invalid_argument", "not_found", "failed_precondition",
                                                  "deadline_exceeded", "resource_exhausted")
    elif s == 200:
        assert ct == UNARY and isinstance(json.loads(raw), dict)
    else:
        assert ct == "application/json" and s in (400, 404, 409, 412, 415, 429, 504)
        assert json.loads(raw)["code"] != "internal"
    assert healthy(envd)
