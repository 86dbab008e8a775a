"""`aenv template ls|rm|logs` through a server's E2B template API, and the build
status polling that `aenv template build -f` shares with `logs --follow`.

Endpoints (as the e2b SDK speaks them): ``GET /templates``, ``GET /templates/{id}``
(its builds), ``GET /templates/aliases/{name}``, ``DELETE /templates/{id}``,
``GET /templates/{id}/builds/{buildID}/status?logsOffset=N`` (at most 100 log
entries per answer, so a finished build's tail is read until an empty page).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import urllib.parse
from typing import Any, Callable, TextIO

from .apiclient import ApiClient, emit
from .common import CliError

TERMINAL = ("ready", "error")
POLL_SECONDS = 0.5


def quote(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def resolve_template(api: ApiClient, ref: str) -> str:
    """A template id for an id or a name (``name`` or ``name:tag``)."""
    conn, resp = api.open("GET", f"/templates/aliases/{quote(ref.split(':', 1)[0])}", None,
                          {"X-API-Key": api.api_key})
    try:
        raw = resp.read()
        if resp.status == 200:
            info = json.loads(raw or b"{}")
            if info.get("templateID"):
                return str(info["templateID"])
        elif resp.status not in (404, 400, 403):
            api.check(resp, raw, (200,))
    finally:
        conn.close()
    return ref


def latest_build(api: ApiClient, template_id: str) -> str:
    info = api.call("GET", f"/templates/{quote(template_id)}")
    builds = info.get("builds") or []
    if not builds:
        raise CliError(f"template {template_id} has no builds", 1)
    return str(max(builds, key=lambda b: b.get("createdAt") or "")["buildID"])


def poll_build(api: ApiClient, template_id: str, build_id: str, on_entry: Callable[[dict[str, Any]], None],
               offset: int = 0, follow: bool = True, on_poll: Callable[[dict[str, Any]], None] | None = None,
               sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Poll the build's status, handing every new log entry to ``on_entry``, until it is
    ready or failed (or, without ``follow``, until the logs so far are read). Returns the
    last status answer."""
    path = f"/templates/{quote(template_id)}/builds/{quote(build_id)}/status"
    while True:
        status = api.call("GET", f"{path}?logsOffset={offset}")
        entries = status.get("logEntries") or []
        offset += len(entries)
        for entry in entries:
            on_entry(entry)
        if on_poll:
            on_poll(status)
        done = status.get("status") in TERMINAL
        if entries and (done or not follow or len(entries) >= 100):
            continue           # a full page: there may be more entries before the end
        if done or not follow:
            status["logsOffset"] = offset
            return status
        sleep(POLL_SECONDS)


def entry_time(entry: dict[str, Any]) -> str:
    stamp = str(entry.get("timestamp") or "")
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone().strftime("%H:%M:%S")
    except ValueError:
        return stamp[:19]


def log_line(entry: dict[str, Any], total_steps: int | None = None) -> str:
    step = str(entry.get("step") or "")
    if step.isdigit() and total_steps:
        step = f"{step}/{total_steps}"
    level = str(entry.get("level") or "info")
    tag = f" [{step}]" if step else ""
    lvl = "" if level == "info" else f" {level.upper()}"
    return f"{entry_time(entry)}{lvl}{tag} {entry.get('message', '')}".rstrip()


def failure_message(status: dict[str, Any], describe: Callable[[str], str] | None = None) -> str:
    reason = status.get("reason") or {}
    message = reason.get("message") or "the build failed"
    step = str(reason.get("step") or "")
    if step:
        where = describe(step) if describe else ""
        message = f"step {step}{' (' + where + ')' if where else ''} failed: {message}"
    return message


# --- commands ---------------------------------------------------------------

def cmd_ls(args: argparse.Namespace) -> int:
    api = ApiClient.from_args(args)
    items = api.call("GET", "/templates") or []
    rows = [{"templateID": t.get("templateID"), "names": ",".join(t.get("names") or t.get("aliases") or []),
             "status": t.get("buildStatus", ""), "cpuCount": t.get("cpuCount", ""),
             "memoryMB": t.get("memoryMB", ""), "diskSizeMB": t.get("diskSizeMB", ""),
             "builds": t.get("buildCount", ""), "createdAt": t.get("createdAt", "")} for t in items]
    emit(args, items, rows=rows, columns=["templateID", "names", "status", "cpuCount", "memoryMB", "diskSizeMB",
                                          "builds", "createdAt"])
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    api = ApiClient.from_args(args)
    template_id = resolve_template(api, args.template)
    api.call("DELETE", f"/templates/{quote(template_id)}", expect=(200, 202, 204))
    emit(args, {"templateID": template_id, "deleted": True}, text=f"deleted template {template_id}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    api = ApiClient.from_args(args)
    template_id = resolve_template(api, args.template)
    build_id = args.build or latest_build(api, template_id)
    collected: list[dict[str, Any]] = []
    out: TextIO = sys.stdout

    def on_entry(entry: dict[str, Any]) -> None:
        if args.output == "json" and not args.follow:
            collected.append(entry)
        elif args.output == "json":
            out.write(json.dumps(entry) + "\n")
        else:
            out.write(log_line(entry) + "\n")
        out.flush()

    try:
        status = poll_build(api, template_id, build_id, on_entry, offset=args.offset, follow=args.follow)
    except KeyboardInterrupt:
        return 0
    if args.output == "json" and not args.follow:
        emit(args, {"templateID": template_id, "buildID": build_id, "status": status.get("status"),
                    "reason": status.get("reason"), "logEntries": collected})
    elif status.get("status") == "error":
        print(f"aenv: build {build_id} failed: {failure_message(status)}", file=sys.stderr)
    return 1 if status.get("status") == "error" else 0
