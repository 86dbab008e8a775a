"""The HTTP client the remote CLI commands (`aenv sandbox|snapshot|files`) share.

It speaks to an `aenv server` (or any E2B-compatible control plane) exactly as
the SDK does: ``X-API-Key`` for the control plane, ``E2b-Sandbox-Id`` /
``E2b-Sandbox-Port`` / ``X-Access-Token`` for sandbox traffic through the
server's proxy. Stdlib only (http.client), so the CLI starts fast.

Where the server is: ``--url``, else ``$AENV_URL``, else ``$E2B_API_URL``, else
http://127.0.0.1:8000. The key: ``--api-key``, else ``$E2B_API_KEY``, else
``$AENV_API_KEY``, else the local node's ``<data-dir>/api-key``. The admin credential
(`aenv team`, `aenv key --team`): ``--admin-token-file``, else ``$AENV_ADMIN_TOKEN``;
never a flag holding the credential itself (other users see a command line).
"""
from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import struct
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Iterator

from envd import ENVD_PORT

from .common import CliError, common_options, print_json, print_table

DEFAULT_URL = "http://127.0.0.1:8000"


def client_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False, parents=[common_options()])
    parent.add_argument("--url", default=None, help=f"server URL (env AENV_URL or E2B_API_URL; default {DEFAULT_URL})")
    parent.add_argument("--api-key", default=None,
                        help="API key (env E2B_API_KEY or AENV_API_KEY; default: the local node's key file)")
    parent.add_argument("--output", "-o", choices=("table", "json"), default="table", help="output format")
    return parent


def emit(args: argparse.Namespace, value: Any, rows: list[dict] | None = None, columns: list[str] | None = None,
         text: str | None = None) -> None:
    """JSON of ``value`` with --output json, else a table of ``rows`` or the ``text`` line."""
    if args.output == "json":
        print_json(value)
    elif rows is not None and columns is not None:
        print_table(rows, columns)
    elif text is not None:
        print(text)


@dataclass
class ApiClient:
    url: str
    api_key: str
    timeout: float = 300.0
    last_headers: dict[str, str] = field(default_factory=dict)   # of the last call() answer
    # set by ``as_admin``: control-plane calls send X-Admin-Token (and X-Team-ID) instead of the key
    admin_headers: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def as_admin(cls, args: argparse.Namespace, team: str | None = None) -> "ApiClient":
        """A client that presents the node's admin credential (for ``team``, when given)."""
        path = getattr(args, "admin_token_file", None)
        if path:
            try:
                token = open(path).read().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise CliError(f"--admin-token-file: cannot read {path}: {e}", 1) from None
        else:
            token = os.environ.get("AENV_ADMIN_TOKEN", "").strip()
        if not token:
            raise CliError("no admin credential: pass --admin-token-file FILE or set AENV_ADMIN_TOKEN "
                           "(the node's [server] teams_admin_token_file / AENV_ADMIN_TOKEN)", 1)
        client = cls(cls._url(args), "")
        client.admin_headers = {"X-Admin-Token": token, **({"X-Team-ID": team} if team else {})}
        return client

    @staticmethod
    def _url(args: argparse.Namespace) -> str:
        url = args.url or os.environ.get("AENV_URL") or os.environ.get("E2B_API_URL") or DEFAULT_URL
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise CliError(f"--url must be an http(s) URL, got {url!r}")
        return str(url.rstrip("/"))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ApiClient":
        url = cls._url(args)
        key = args.api_key or os.environ.get("E2B_API_KEY") or os.environ.get("AENV_API_KEY")
        if not key:
            from .config import resolve_data_dir

            try:
                key = (resolve_data_dir(getattr(args, "data_dir", None)) / "api-key").read_text().strip()
            except OSError:
                raise CliError("no API key: pass --api-key or set E2B_API_KEY (the server prints it at start)",
                               1) from None
        return cls(url, key)

    def _conn(self) -> http.client.HTTPConnection:
        p = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        return cls(p.hostname or "", p.port, timeout=self.timeout)

    def open(self, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._conn()
        try:
            conn.request(method, path, body=body, headers=headers or {})
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise CliError(f"cannot reach the aenv server at {self.url}: {e} (is `aenv server` running?)", 1) \
                from None

    def call(self, method: str, path: str, body: Any = None, expect: tuple[int, ...] = (200,)) -> Any:
        """One control-plane call; the JSON answer (None for 204). API errors become CliError."""
        headers = dict(self.admin_headers) or {"X-API-Key": self.api_key}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn, resp = self.open(method, path, data, headers)
        try:
            raw = resp.read()
            self.check(resp, raw, expect)
            self.last_headers = dict(resp.getheaders())
            return json.loads(raw) if raw and "json" in (resp.getheader("Content-Type") or "") else None
        finally:
            conn.close()

    @staticmethod
    def check(resp: http.client.HTTPResponse, raw: bytes, expect: tuple[int, ...]) -> None:
        if resp.status in expect:
            return
        try:
            message = json.loads(raw).get("message") or raw[:200].decode(errors="replace")
        except (ValueError, AttributeError):
            message = raw[:200].decode(errors="replace")
        raise CliError(f"server answered {resp.status}: {message}", 1)

    # --- sandbox traffic through the proxy -----------------------------------

    def sandbox_headers(self, sandbox_id: str, user: str | None = None) -> dict[str, str]:
        info = self.call("GET", f"/sandboxes/{urllib.parse.quote(sandbox_id, safe='')}")
        headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        if info.get("envdAccessToken"):
            headers["X-Access-Token"] = info["envdAccessToken"]
        if user:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        return headers

    def run(self, sandbox_id: str, command: str, user: str = "user", cwd: str | None = None,
            env: dict[str, str] | None = None) -> Iterator[tuple[str, Any]]:
        """Run ``bash -l -c command`` in the sandbox; yields ("stdout"|"stderr", bytes) as the
        output streams in, then ("exit", code)."""
        process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", command], "envs": env or {}}
        if cwd:
            process["cwd"] = cwd
        payload = json.dumps({"process": process}).encode()
        headers = {**self.sandbox_headers(sandbox_id, user), "Content-Type": "application/connect+json",
                   "Connect-Protocol-Version": "1"}
        conn, resp = self.open("POST", "/process.Process/Start", struct.pack(">BI", 0, len(payload)) + payload,
                               headers)
        try:
            if resp.status != 200:
                self.check(resp, resp.read(), (200,))
            exit_code: int | None = None
            while True:
                head = resp.read(5)
                if len(head) < 5:
                    break
                flags, length = struct.unpack(">BI", head)
                msg = json.loads(resp.read(length) or b"{}")
                if flags & 0x02:
                    if msg.get("error"):
                        raise CliError(f"command failed: {msg['error'].get('message', msg['error'])}", 1)
                    break
                event = msg.get("event", {})
                for stream in ("stdout", "stderr"):
                    if stream in event.get("data", {}):
                        yield stream, base64.b64decode(event["data"][stream])
                if "end" in event:
                    exit_code = int(event["end"].get("exitCode", 0))
            if exit_code is None:
                raise CliError("the command's stream ended without an exit status", 1)
            yield "exit", exit_code
        finally:
            conn.close()

    def read_file(self, sandbox_id: str, path: str, user: str = "user") -> bytes:
        q = urllib.parse.urlencode({"path": path, "username": user})
        conn, resp = self.open("GET", f"/files?{q}", None, self.sandbox_headers(sandbox_id))
        try:
            raw = resp.read()
            self.check(resp, raw, (200,))
            return raw
        finally:
            conn.close()

    def write_file(self, sandbox_id: str, path: str, data: bytes, user: str = "user") -> None:
        q = urllib.parse.urlencode({"path": path, "username": user})
        headers = {**self.sandbox_headers(sandbox_id), "Content-Type": "application/octet-stream"}
        conn, resp = self.open("POST", f"/files?{q}", data, headers)
        try:
            self.check(resp, resp.read(), (200, 204))
        finally:
            conn.close()
