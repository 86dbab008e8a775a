"""Requests that aiohttp's HTTP parser refuses by itself (malformed request line,
NUL or invalid header bytes, oversize request line or header, too many headers,
bad chunked framing, TLS on the plain port), sent over raw sockets to the API server
(in-process over a fake sandbox service: none of this reaches a sandbox): every answer
is E2B's JSON error shape with the status that says what was wrong, an X-Request-Id,
and the connection is closed."""
from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import given, settings, strategies as st
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong, TransferEncodingError

from aenv_http.runner import MAX_FIELD, MAX_LINE, reject_status

from .conftest import HttpClient
from .inprocess import InProcessServer


@pytest.fixture
def server(api: InProcessServer) -> InProcessServer:
    return api


def exchange(server: HttpClient, *parts: bytes, pause: float = 0.3) -> tuple[int, dict[str, str], bytes]:
    """Send ``parts`` (``pause`` s apart) on one connection; read until the server closes it."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause)
            s.sendall(part)
        data = b""
        while chunk := s.recv(65536):  # a timeout here (the server kept it open) fails the test
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _assert_json_error(status: int, headers: dict[str, str], body: bytes, want: int) -> dict:
    assert status == want, (status, body)
    assert headers["content-type"].startswith("application/json")
    got = json.loads(body)
    assert got["code"] == want and isinstance(got["message"], str) and got["message"], got
    assert len(headers["x-request-id"]) == 16
    return got


CASES = {
    "garbage request line": (b"GARBAGE\r\n\r\n", 400),
    "TLS on the plain port": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 20, 400),
    "NUL in a header value": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
    "space in a header name": (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n", 400),
    "bad HTTP version": (b"GET /health HTTP/9.Z\r\nHost: x\r\n\r\n", 400),
    "request line too long": (b"GET /" + b"a" * (MAX_LINE + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    "header line too long": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (MAX_FIELD + 10) + b"\r\n\r\n", 431),
    "too many headers": (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
                         + b"\r\n", 431),
    "bad chunk size": (b"POST /sandboxes HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n", 400),
    "content-length and chunked": (b"POST /sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parser_rejections_are_json(server: InProcessServer, name: str) -> None:
    raw, want = CASES[name]
    _assert_json_error(*exchange(server, raw), want)


def test_bad_chunking_after_the_headers_is_json_400(server: InProcessServer) -> None:
    """The framing breaks once the handler already reads the body (control plane)."""
    head = (b"POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: " + server.api_key.encode()
            + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")
    status, headers, body = exchange(server, head, b"zz\r\n")
    got = _assert_json_error(status, headers, body, 400)
    assert "chunk" in got["message"] and headers.get("connection", "").lower() == "close"


def test_rejections_are_logged_and_the_server_lives_on(server: InProcessServer) -> None:
    exchange(server, b"GARBAGE\r\n\r\n")
    status, _, _ = server.request("GET", "/health", key=None)
    assert status in (200, 204)
    assert "rejected -> 400 malformed HTTP request" in server.log() and "Traceback" not in server.log()


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=200))
def test_reject_status_is_always_a_4xx_with_a_message(junk: bytes) -> None:
    for exc in (BadHttpMessage(junk.decode("latin-1")), TransferEncodingError(junk.decode("latin-1")),
                LineTooLong(junk, MAX_LINE), LineTooLong(junk, MAX_FIELD)):
        status, message = reject_status(exc, 400)
        assert status in (400, 414, 431) and message and "\n" not in message and len(message) < 260
    assert reject_status(LineTooLong(junk, MAX_LINE), 400)[0] == 414
    assert reject_status(LineTooLong(junk, MAX_FIELD), 400)[0] == 431
    assert reject_status(RuntimeError("x"), 500) == (500, "internal error")


def test_ambiguous_credentials_are_401(server: InProcessServer) -> None:
    """Two API keys, or an API key with another Authorization, are refused; envd access
    tokens and traffic tokens never open the control plane."""
    key = server.api_key.encode()
    cases = {
        "two X-API-Key (the right one first)": b"X-API-Key: " + key + b"\r\nX-API-Key: e2b_" + b"0" * 40 + b"\r\n",
        "two X-API-Key (both right)": b"X-API-Key: " + key + b"\r\nX-API-Key: " + key + b"\r\n",
        "API key and another bearer": b"X-API-Key: " + key + b"\r\nAuthorization: Bearer someone-else\r\n",
        "API key and basic auth": b"X-API-Key: " + key + b"\r\nAuthorization: Basic cm9vdDo=\r\n",
        "an envd token instead": b"X-Access-Token: " + key + b"\r\n",
        "a traffic token instead": b"e2b-traffic-access-token: " + key + b"\r\n",
        "a bearer alone": b"Authorization: Bearer " + key + b"\r\n",
    }
    for name, headers in cases.items():
        status, hdrs, body = exchange(server, b"GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                      + headers + b"\r\n")
        assert _assert_json_error(status, hdrs, body, 401)["code"] == 401, name
    ok = exchange(server, b"GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-API-Key: " + key
                  + b"\r\nAuthorization: Bearer " + key + b"\r\n\r\n")
    assert ok[0] == 200                     # the same key twice, in both places: one credential
