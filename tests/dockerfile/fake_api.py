"""A small stand-in for E2B's template build API (stdlib HTTP server in a thread) that
records what a client sends: the CLI and the real e2b SDK are both pointed at it
and their traffic compared. It builds nothing; its status answers follow a script."""
from __future__ import annotations

import gzip
import io
import json
import re
import tarfile
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KEY = "test-key"
STAMP = "2026-12-01T10:00:00.000Z"


@dataclass
class FakeTemplateApi:
    fail_step: str | None = None            # the build ends in error at this step
    log_entries: int = 150                   # more than a page (100), to exercise the draining
    present: set[str] = field(default_factory=set)        # files hashes the server "has"
    uploads: dict[str, bytes] = field(default_factory=dict)   # hash → tar (gunzipped)
    requests: list[dict[str, Any]] = field(default_factory=list)
    builds: dict[str, dict[str, Any]] = field(default_factory=dict)   # buildID → start body
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)
    polls: int = 0

    def start(self) -> "FakeTemplateApi":
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                api.handle(self, "GET")

            def do_POST(self) -> None:
                api.handle(self, "POST")

            def do_PUT(self) -> None:
                api.handle(self, "PUT")

            def do_DELETE(self) -> None:
                api.handle(self, "DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- the API -----------------------------------------------------------

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        self.requests.append({"method": method, "path": url.path, "query": query,
                              "key": h.headers.get("X-API-Key")})
        if url.path.startswith("/upload/"):
            if query.get("sig") != "ok":
                return self.reply(h, 401, {"message": "bad signature"})
            self.uploads[url.path.rsplit("/", 1)[1]] = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
            return self.reply(h, 200, None)
        if h.headers.get("X-API-Key") != KEY:
            return self.reply(h, 401, {"message": "bad API key"})
        body = json.loads(raw) if raw else None
        p = url.path
        if method == "POST" and p == "/v3/templates":
            name = body["name"].split(":")[0]
            bid = f"b{len(self.builds) + 1}"
            self.builds[bid] = {}
            tags = sorted(set(body.get("tags") or []) | ({body["name"].split(":")[1]} if ":" in body["name"]
                                                        else {"default"}))
            self.templates[name] = {"templateID": name, "buildID": bid, "names": [name], "aliases": [name],
                                    "buildStatus": "building", "cpuCount": body.get("cpuCount", 2),
                                    "memoryMB": body.get("memoryMB", 512), "diskSizeMB": 1024, "buildCount": 1,
                                    "createdAt": STAMP, "request": body,
                                    "builds": [{"buildID": bid, "status": "building", "createdAt": STAMP}]}
            return self.reply(h, 202, {"templateID": name, "buildID": bid, "names": [name], "aliases": [name],
                                       "tags": tags, "public": False})
        m = re.fullmatch(r"/templates/([^/]+)/files/([^/]+)", p)
        if method == "GET" and m:
            if m.group(2) in self.present or m.group(2) in self.uploads:
                return self.reply(h, 201, {"present": True})
            return self.reply(h, 201, {"present": False, "url": f"{self.url}/upload/{m.group(2)}?sig=ok"})
        m = re.fullmatch(r"/v2/templates/([^/]+)/builds/([^/]+)", p)
        if method == "POST" and m:
            self.builds[m.group(2)] = body
            return self.reply(h, 202, None)
        m = re.fullmatch(r"/templates/([^/]+)/builds/([^/]+)/status", p)
        if method == "GET" and m:
            return self.reply(h, 200, self.status(m.group(1), m.group(2), int(query.get("logsOffset", 0))))
        if method == "GET" and p == "/templates":
            return self.reply(h, 200, [{k: v for k, v in t.items() if k not in ("builds", "request")}
                                       for t in self.templates.values()])
        m = re.fullmatch(r"/templates/aliases/([^/]+)", p)
        if method == "GET" and m:
            found = [t for t in self.templates.values() if m.group(1) in t["names"]]
            return self.reply(h, 200, {"templateID": found[0]["templateID"], "public": False}) if found else \
                self.reply(h, 404, {"message": "no such name"})
        m = re.fullmatch(r"/templates/([^/]+)", p)
        if m and m.group(1) in self.templates:
            if method == "DELETE":
                del self.templates[m.group(1)]
                return self.reply(h, 204, None)
            return self.reply(h, 200, self.templates[m.group(1)])
        return self.reply(h, 404, {"message": f"not found: {method} {p}"})

    def status(self, tid: str, bid: str, offset: int) -> dict[str, Any]:
        """Building for two polls, then ready or failed; ``log_entries`` entries in all."""
        self.polls += 1
        steps = self.builds.get(bid, {}).get("steps", [])
        entries = [{"timestamp": STAMP, "level": "info", "message": f"line {i}",
                    "step": "base" if i == 0 else str(1 + i % max(1, len(steps)))} for i in range(self.log_entries)]
        done = self.polls > 2
        visible = entries if done else entries[: self.log_entries // 2]
        page = visible[offset:offset + 100]
        out: dict[str, Any] = {"templateID": tid, "buildID": bid, "logs": [], "logEntries": page,
                               "status": "building"}
        if done:
            out["status"] = "error" if self.fail_step else "ready"
            if self.fail_step:
                out["reason"] = {"message": "RUN false: exited with code 1", "step": self.fail_step}
            if tid in self.templates:
                self.templates[tid]["buildStatus"] = out["status"]
        return out

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, code: int, body: Any) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        h.send_response(code)
        if body is not None:
            h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


def tar_members(data: bytes) -> dict[str, tuple[str, bytes | str | None]]:
    """name → (kind, content) of an uploaded tar, for comparisons."""
    out: dict[str, tuple[str, bytes | str | None]] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        for m in t.getmembers():
            name = m.name.rstrip("/") or "."
            if m.isreg():
                f = t.extractfile(m)
                out[name] = ("file", f.read() if f else b"")
            elif m.issym():
                out[name] = ("link", m.linkname)
            else:
                out[name] = ("dir" if m.isdir() else "other", None)
    return out
