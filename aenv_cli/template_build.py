"""`aenv template build -f Dockerfile [CONTEXT] --name NAME`: a Dockerfile built by
a server through E2B's template build API, doing what the e2b SDK's
``Template.build`` does:

1. ``POST /v3/templates`` {name, tags, cpuCount, memoryMB} → templateID, buildID;
2. per COPY, ``GET /templates/{id}/files/{hash}`` → {present, url}, and when the
   server does not have those files yet, a PUT of their gzipped tar to ``url``;
3. ``POST /v2/templates/{id}/builds/{buildID}`` with the steps (TemplateBuildStartV2);
4. the status polled with ``logsOffset``, its log entries printed as they come.

Everything about the Dockerfile and its context is checked before the first call.
Log lines go to stderr (with a status line on a terminal); stdout gets the template
id, or the JSON result with ``--output json``.
"""
from __future__ import annotations

import argparse
import http.client
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, TextIO

from aenv_api.dockerfile import DockerfileError
from aenv_api.dockerfile.context import BuildContext, ContextFiles
from aenv_api.dockerfile.convert import BuildPlan, convert
from aenv_api.dockerfile.syntax import parse

from .apiclient import ApiClient, emit
from .common import CliError, human_bytes
from .template_api import failure_message, log_line, poll_build, quote


@dataclass
class PreparedBuild:
    plan: BuildPlan
    context: BuildContext | None
    files: list[ContextFiles]        # one per COPY source, in step order

    def body(self, force: bool = False, registry: dict[str, str] | None = None) -> dict[str, Any]:
        return self.plan.request({f.copy.step: f.files_hash for f in self.files}, force=force, registry=registry)

    def describe(self, step: str) -> str:
        """A build step as the server names it ("base", "1"…, "finalize") in words."""
        if step == "base":
            return f"FROM {self.plan.from_image}"
        if step == "finalize":
            return "start and ready commands" if self.plan.start_cmd else "finalize"
        if step.isdigit() and 1 <= int(step) <= len(self.plan.steps):
            s = self.plan.steps[int(step) - 1]
            text = s.describe().replace("\n", " ")
            text = text if len(text) <= 60 else text[:57] + "..."
            return f"{text}, Dockerfile line {s.line}" if s.line else text
        return ""


def build_args(values: list[str] | None) -> dict[str, str]:
    """``--build-arg K=V``; a bare ``K`` takes the value from the environment (as Docker
    does) and is left out when the environment has none."""
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not key:
            raise CliError(f"--build-arg must be NAME=VALUE or NAME, got {item!r}")
        if sep:
            out[key] = value
        elif key in os.environ:
            out[key] = os.environ[key]
    return out


def prepare(dockerfile: str, context: str | None, args: dict[str, str], ready_cmd: str | None) -> PreparedBuild:
    """Read, convert and check the Dockerfile and its context; nothing is sent."""
    if dockerfile == "-":
        text, where = sys.stdin.read(), Path.cwd()
    else:
        path = Path(dockerfile).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        where = path.parent
    root = Path(context).expanduser() if context else where
    try:
        plan = convert(parse(text), args, ready_cmd=ready_cmd)
        ctx = BuildContext(root) if plan.copies or context else None
        files = [ctx.collect(c) for c in plan.copies] if ctx else []
    except DockerfileError as e:
        raise CliError(str(e)) from None
    return PreparedBuild(plan, ctx, files)


def _registry(args: argparse.Namespace) -> dict[str, str] | None:
    if not args.registry_username:
        if args.registry_password_stdin:
            raise CliError("--registry-password-stdin needs --registry-username")
        return None
    if not args.registry_password_stdin:
        raise CliError("--registry-username needs --registry-password-stdin")
    if args.file == "-":
        raise CliError("the Dockerfile and the registry password cannot both come from stdin")
    password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise CliError("empty registry password on stdin")
    return {"username": args.registry_username, "password": password}


@dataclass
class BuildDisplay:
    """Log lines on ``out``; on a terminal also a status line under them (the current
    step n/N, what it is, the time since the start), redrawn as the build goes."""

    prepared: PreparedBuild
    out: TextIO = field(default_factory=lambda: sys.stderr)
    started: float = field(default_factory=time.monotonic)
    phase: str = "starting"
    _drawn: bool = False

    def __post_init__(self) -> None:
        self.tty = self.out.isatty()
        self.total = len(self.prepared.plan.steps)

    def log(self, text: str) -> None:
        self._clear()
        self.out.write(text + "\n")
        self._draw()

    def entry(self, entry: dict[str, Any]) -> None:
        step = str(entry.get("step") or "")
        if step:
            what = self.prepared.describe(step)
            label = f"step {step}/{self.total}" if step.isdigit() else step
            self.phase = f"{label}{': ' + what if what else ''}"
        self.log(log_line(entry, self.total))

    def set_phase(self, text: str) -> None:
        self.phase = text
        self._draw()

    def tick(self, _status: dict[str, Any] | None = None) -> None:
        self._draw()

    def close(self) -> None:
        self._clear()
        self.out.flush()

    def _clear(self) -> None:
        if self._drawn:
            self.out.write("\r\033[K")
            self._drawn = False

    def _draw(self) -> None:
        if self.tty:
            line = f"[{time.monotonic() - self.started:6.1f}s] {self.phase}"
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self._clear()
            self.out.write(line[:width])
            self._drawn = True
        self.out.flush()


def upload(api: ApiClient, url: str, body: BinaryIO, size: int, headers: dict[str, str],
           on_bytes: Callable[[int], None]) -> None:
    """PUT the tar to the upload URL the server gave (absolute, or relative to the API)."""
    target = urllib.parse.urljoin(api.url + "/", url)
    p = urllib.parse.urlsplit(target)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise CliError(f"the server gave an unusable upload URL {url!r}", 1)
    base = urllib.parse.urlsplit(api.url)
    send = {k: v for k, v in headers.items() if k.lower() != "content-length"}
    send.update({"Content-Length": str(size), "Content-Type": "application/octet-stream"})
    if (p.scheme, p.hostname, p.port) == (base.scheme, base.hostname, base.port):
        send.setdefault("X-API-Key", api.api_key)   # never to another host: an upload URL carries its own grant
    cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
    conn = cls(p.hostname, p.port, timeout=api.timeout)

    def chunks() -> Iterator[bytes]:
        while chunk := body.read(1 << 20):
            on_bytes(len(chunk))
            yield chunk
    try:
        conn.request("PUT", p.path + (f"?{p.query}" if p.query else ""), body=chunks(), headers=send)
        resp = conn.getresponse()
        api.check(resp, resp.read(), (200, 201, 204))
    except (OSError, http.client.HTTPException) as e:
        raise CliError(f"upload to {p.hostname}:{p.port or ''} failed: {e}", 1) from None
    finally:
        conn.close()


def _upload_files(api: ApiClient, prepared: PreparedBuild, template_id: str, display: BuildDisplay,
                  force_upload: bool) -> dict[str, int]:
    """Ask for each COPY's files, upload those the server lacks; returns {uploaded, cached, bytes}."""
    counts = {"uploaded": 0, "cached": 0, "bytes": 0}
    seen: set[str] = set()
    assert prepared.context is not None or not prepared.files
    for files in prepared.files:
        if files.files_hash in seen:
            continue
        seen.add(files.files_hash)
        src = files.copy.src
        info = api.call("GET", f"/templates/{quote(template_id)}/files/{files.files_hash}", expect=(200, 201))
        if info.get("present") and not force_upload:
            counts["cached"] += 1
            display.log(f"files of {src} (line {files.copy.line}) already on the server")
            continue
        if not info.get("url"):
            raise CliError(f"the server gave no upload URL for {src}", 1)
        with tempfile.TemporaryFile() as tar:
            display.set_phase(f"packing {src}")
            assert prepared.context is not None
            prepared.context.write_tar(files, tar)
            size = tar.tell()
            tar.seek(0)
            sent = 0

            def progress(n: int, size: int = size, src: str = src) -> None:
                nonlocal sent
                sent += n
                display.set_phase(f"uploading {src}: {human_bytes(sent)}/{human_bytes(size)}")
            upload(api, str(info["url"]), tar, size, dict(info.get("headers") or {}), progress)
        counts["uploaded"] += 1
        counts["bytes"] += size
        display.log(f"uploaded {src} (line {files.copy.line}): {len(files.paths)} paths, {human_bytes(size)}")
    return counts


def plan_text(plan: BuildPlan) -> str:
    """The steps as `--dry-run` shows them: one line each (a multi-line RUN by its first
    line), with the Dockerfile line it came from or "default"."""
    lines = [f"     FROM {plan.from_image}"]
    for i, step in enumerate(plan.steps):
        text = step.describe()
        first, _, more = text.partition("\n")
        text = first + (" ..." if more.strip() else "")
        text = text if len(text) <= 72 else text[:69] + "..."
        lines.append(f"{i + 1:>3}  {text:<74} {('line ' + str(step.line)) if step.line else 'default'}")
    if plan.start_cmd:
        lines.append(f"     start: {plan.start_cmd}")
    if plan.ready_cmd:
        lines.append(f"     ready: {plan.ready_cmd}")
    return "\n".join(lines)


def check_options(args: argparse.Namespace) -> None:
    local_only = [o for o, v in (("--memory-mib", args.memory_mib), ("--vcpus", args.vcpus),
                                 ("--disk-mib", args.disk_mib)) if v is not None]
    if local_only:
        raise CliError(f"{local_only[0]} is for the local build (without -f); a Dockerfile build takes "
                       "--cpu-count and --memory-mb")
    if not args.name and not args.dry_run:
        raise CliError("a Dockerfile build needs --name NAME[:TAG]")
    if args.name is not None and not (0 < len(args.name) <= 128):
        raise CliError("--name must be 1..128 characters")
    for opt, value in (("--cpu-count", args.cpu_count), ("--memory-mb", args.memory_mb)):
        if value is not None and value < 1:
            raise CliError(f"{opt} must be >= 1")


def cmd_build(args: argparse.Namespace) -> int:
    check_options(args)
    prepared = prepare(args.file, args.target, build_args(args.build_arg), args.ready_cmd)
    registry = _registry(args)
    display = BuildDisplay(prepared)
    for notice in prepared.plan.warnings:
        display.log(f"warning: {notice}")
    body = prepared.body(force=args.skip_cache, registry=registry)
    if args.dry_run:
        shown = {**body, **({"fromImageRegistry": {**body["fromImageRegistry"], "password": "***"}}
                            if "fromImageRegistry" in body else {})}
        emit(args, {"build": shown, "files": [{"src": f.copy.src, "dest": f.copy.dest, "line": f.copy.line,
                                                "filesHash": f.files_hash, "paths": len(f.paths),
                                                "bytes": f.data_bytes} for f in prepared.files]},
             text=plan_text(prepared.plan))
        return 0
    api = ApiClient.from_args(args)
    request: dict[str, Any] = {"name": args.name}
    if args.tag:
        request["tags"] = list(args.tag)
    if args.cpu_count is not None:
        request["cpuCount"] = args.cpu_count
    if args.memory_mb is not None:
        request["memoryMB"] = args.memory_mb
    display.set_phase("requesting the build")
    created = api.call("POST", "/v3/templates", request, expect=(200, 201, 202))
    template_id, build_id = str(created["templateID"]), str(created["buildID"])
    display.log(f"template {args.name}: id {template_id}, build {build_id}")
    counts = _upload_files(api, prepared, template_id, display, args.force_upload)
    display.set_phase("starting the build")
    api.call("POST", f"/v2/templates/{quote(template_id)}/builds/{quote(build_id)}", body,
             expect=(200, 201, 202, 204))
    result: dict[str, Any] = {"templateID": template_id, "buildID": build_id, "names": created.get("names"),
                              "tags": created.get("tags"), "aliases": created.get("aliases"),
                              "steps": len(prepared.plan.steps), "files": counts}
    if args.no_wait:
        display.close()
        emit(args, {**result, "status": "building"}, text=template_id)
        return 0
    display.set_phase("waiting for the build")
    try:
        status = poll_build(api, template_id, build_id, display.entry, on_poll=display.tick)
    except KeyboardInterrupt:
        display.close()
        raise CliError(f"interrupted: the build goes on on the server (follow it with "
                       f"`aenv template logs {template_id} {build_id} -f`)", 130) from None
    display.close()
    result.update(status=status.get("status"), seconds=round(time.monotonic() - display.started, 1))
    if status.get("status") != "ready":
        message = failure_message(status, prepared.describe)
        if args.output == "json":
            emit(args, {**result, "reason": status.get("reason")})
        raise CliError(f"build {build_id} of {args.name} failed: {message}", 1)
    print(f"built {args.name}: template {template_id}, build {build_id}, in {result['seconds']}s", file=sys.stderr)
    emit(args, result, text=template_id)
    return 0
