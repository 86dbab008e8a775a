"""`aenv sandbox create|ls|info|exec|logs|pause|resume|snapshot|fork|kill|timeout`:
sandboxes of a running `aenv server` (local or remote, through its E2B API;
see apiclient.py for --url / --api-key)."""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import urllib.parse

from .apiclient import ApiClient, client_options, emit
from .common import CliError, Subcommands

COLUMNS = ["sandboxID", "alias", "templateID", "state", "startedAt", "endAt", "cpuCount", "memoryMB", "metadata"]


def key_values(values: list[str] | None, what: str) -> dict[str, str]:
    """Repeated KEY=VALUE options as a dict; CliError naming the option otherwise."""
    out: dict[str, str] = {}
    for v in values or []:
        key, sep, value = v.partition("=")
        if not sep or not key:
            raise CliError(f"{what} must be KEY=VALUE, got {v!r}")
        out[key] = value
    return out


def _sid(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("sandbox", help="create, list, run in, pause, snapshot, fork and kill sandboxes "
                                              "(through an aenv server's API)")
    sub = p.add_subparsers(dest="sandbox_command", metavar="COMMAND", required=True)
    opts = client_options()

    c = sub.add_parser("create", parents=[opts], help="create a sandbox; prints its id")
    c.add_argument("template", nargs="?", default="base", help="template id, alias or snapshot id (default: base)")
    c.add_argument("--timeout", type=int, default=None, help="time to live in seconds (server default: 300)")
    c.add_argument("--metadata", "-m", action="append", metavar="KEY=VALUE")
    c.add_argument("--env", "-e", action="append", metavar="KEY=VALUE", help="environment of every process")
    c.add_argument("--auto-pause", action="store_true", help="pause instead of kill when the timeout expires")
    c.add_argument("--auto-resume", action="store_true", help="resume a paused sandbox on its next request")
    c.set_defaults(handler=cmd_create)

    ls = sub.add_parser("ls", parents=[opts], help="list sandboxes")
    ls.add_argument("--state", action="append", choices=("running", "paused"))
    ls.add_argument("--metadata", "-m", action="append", metavar="KEY=VALUE", help="filter (all must match)")
    ls.add_argument("--limit", type=int, default=None, help="at most this many (default: all)")
    ls.set_defaults(handler=cmd_ls)

    for name, fn, helptext in (("info", cmd_info, "details of a sandbox"), ("pause", cmd_pause, "pause a sandbox"),
                               ("kill", cmd_kill, "kill a sandbox")):
        s = sub.add_parser(name, parents=[opts], help=helptext)
        s.add_argument("sandbox")
        s.set_defaults(handler=fn)

    r = sub.add_parser("resume", parents=[opts], help="resume a paused sandbox (connect)")
    r.add_argument("sandbox")
    r.add_argument("--timeout", type=int, default=None, help="time to live from now in seconds")
    r.set_defaults(handler=cmd_resume)

    e = sub.add_parser("exec", parents=[opts], help="run a command in a sandbox (bash -l -c), streaming its output")
    e.add_argument("sandbox")
    e.add_argument("command", nargs="+", help="the command; put it after -- when it has options of its own")
    e.add_argument("--user", default="user", help="guest user (default: user)")
    e.add_argument("--cwd", default=None)
    e.add_argument("--env", "-e", action="append", metavar="KEY=VALUE")
    e.set_defaults(handler=cmd_exec)

    s = sub.add_parser("snapshot", parents=[opts], help="snapshot a running sandbox (usable as a template)")
    s.add_argument("sandbox")
    s.add_argument("--name", default=None)
    s.set_defaults(handler=cmd_snapshot)

    f = sub.add_parser("fork", parents=[opts], help="fork a running sandbox into N children")
    f.add_argument("sandbox")
    f.add_argument("--count", "-n", type=int, default=1)
    f.add_argument("--timeout", type=int, default=None, help="children's time to live in seconds")
    f.set_defaults(handler=cmd_fork)

    lg = sub.add_parser("logs", parents=[opts], help="a sandbox's log: lifecycle events and guest console")
    lg.add_argument("sandbox")
    lg.add_argument("--level", choices=("debug", "info", "warn", "error"), default=None, help="minimum level")
    lg.add_argument("--search", default=None, help="only entries whose message contains this")
    lg.add_argument("--limit", type=int, default=1000, help="at most this many entries (1..1000, default 1000)")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing new entries until interrupted")
    lg.set_defaults(handler=cmd_logs)

    t = sub.add_parser("timeout", parents=[opts], help="set a sandbox's time to live from now")
    t.add_argument("sandbox")
    t.add_argument("seconds", type=int)
    t.set_defaults(handler=cmd_timeout)


def _row(s: dict) -> dict:
    return {**s, "alias": s.get("alias", ""),
            "metadata": ",".join(f"{k}={v}" for k, v in sorted((s.get("metadata") or {}).items()))}


def cmd_create(args: argparse.Namespace) -> int:
    api = ApiClient.from_args(args)
    body: dict = {"templateID": args.template, "metadata": key_values(args.metadata, "--metadata"),
                  "envVars": key_values(args.env, "--env")}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    if args.auto_pause:
        body["autoPause"] = True
    if args.auto_resume:
        body["autoResume"] = {"enabled": True}
    sbx = api.call("POST", "/v2/sandboxes", body, expect=(201,))
    emit(args, sbx, text=sbx["sandboxID"])
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    api = ApiClient.from_args(args)
    query: dict[str, str] = {}
    if args.state:
        query["state"] = ",".join(args.state)
    meta = key_values(args.metadata, "--metadata")
    if meta:
        query["metadata"] = urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v)
                                                    for k, v in meta.items()})
    items: list[dict] = []
    token = None
    while True:
        q = dict(query, limit="100", **({"nextToken": token} if token else {}))
        items += api.call("GET", "/v2/sandboxes?" + urllib.parse.urlencode(q))
        token = api.last_headers.get("X-Next-Token") or api.last_headers.get("x-next-token")
        if not token or (args.limit is not None and len(items) >= args.limit):
            break
    if args.limit is not None:
        items = items[:args.limit]
    emit(args, items, rows=[_row(s) for s in items], columns=COLUMNS)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    info = ApiClient.from_args(args).call("GET", f"/sandboxes/{_sid(args.sandbox)}")
    info.pop("envdAccessToken", None) if args.output != "json" else None
    emit(args, info, rows=[_row(info)], columns=COLUMNS)
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    ApiClient.from_args(args).call("POST", f"/sandboxes/{_sid(args.sandbox)}/pause", expect=(204,))
    emit(args, {"sandboxID": args.sandbox, "state": "paused"}, text=f"paused {args.sandbox}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    body = {"timeout": args.timeout} if args.timeout is not None else {"timeout": 300}
    sbx = ApiClient.from_args(args).call("POST", f"/v2/sandboxes/{_sid(args.sandbox)}/connect", body,
                                         expect=(200, 201))
    emit(args, sbx, text=f"running {sbx['sandboxID']}")
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    ApiClient.from_args(args).call("DELETE", f"/sandboxes/{_sid(args.sandbox)}", expect=(204,))
    emit(args, {"sandboxID": args.sandbox, "killed": True}, text=f"killed {args.sandbox}")
    return 0


def cmd_timeout(args: argparse.Namespace) -> int:
    if args.seconds < 0:
        raise CliError("seconds must be >= 0")
    ApiClient.from_args(args).call("POST", f"/sandboxes/{_sid(args.sandbox)}/timeout", {"timeout": args.seconds},
                                   expect=(204,))
    emit(args, {"sandboxID": args.sandbox, "timeout": args.seconds},
         text=f"{args.sandbox} expires in {args.seconds} s")
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    body = {"name": args.name} if args.name else {}
    snap = ApiClient.from_args(args).call("POST", f"/sandboxes/{_sid(args.sandbox)}/snapshots", body,
                                          expect=(201,))
    emit(args, snap, text=snap["snapshotID"])
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise CliError("--count must be >= 1")
    body: dict = {"count": args.count}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    results = ApiClient.from_args(args).call("POST", f"/sandboxes/{_sid(args.sandbox)}/fork", body, expect=(201,))
    return emit_fork_results(args, results)


def emit_fork_results(args: argparse.Namespace, results: list[dict]) -> int:
    """A fork's answer (E2B's SandboxForkResult list) as rows; exit status 1 if any failed."""
    rows = [{"sandboxID": r["sandbox"]["sandboxID"], "error": ""} if "sandbox" in r
            else {"sandboxID": "", "error": r["error"]["message"]} for r in results]
    emit(args, results, rows=rows, columns=["sandboxID", "error"])
    return 0 if all("sandbox" in r for r in results) else 1


def cmd_exec(args: argparse.Namespace) -> int:
    argv = [a for a in args.command]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise CliError("no command given (aenv sandbox exec ID -- CMD ...)")
    import shlex

    command = argv[0] if len(argv) == 1 else shlex.join(argv)
    api = ApiClient.from_args(args)
    out: dict = {"stdout": b"", "stderr": b""}
    code = 1
    for kind, value in api.run(args.sandbox, command, user=args.user, cwd=args.cwd, env=key_values(args.env, "--env")):
        if kind == "exit":
            code = value
        elif args.output == "json":
            out[kind] += value
        else:
            stream = sys.stdout if kind == "stdout" else sys.stderr
            stream.buffer.write(value)
            stream.flush()
    if args.output == "json":
        emit(args, {"exitCode": code, "stdout": out["stdout"].decode(errors="replace"),
                    "stderr": out["stderr"].decode(errors="replace")})
        return 0
    return code


def _log_line(e: dict) -> str:
    fields = " ".join(f"{k}={v}" for k, v in sorted(e.get("fields", {}).items()))
    return f"{e['timestamp']} {e['level'].upper():5} {e['message']}" + (f"  [{fields}]" if fields else "")


def cmd_logs(args: argparse.Namespace) -> int:
    """One page of entries (v2 logs endpoint); with --follow, poll for newer ones from
    the last timestamp on (entries of that same millisecond are not repeated)."""
    import time

    if not 1 <= args.limit <= 1000:
        raise CliError("--limit must be in 1..1000")
    api = ApiClient.from_args(args)
    query: dict[str, str] = {"limit": str(args.limit)}
    for key in ("level", "search"):
        if getattr(args, key) is not None:
            query[key] = getattr(args, key)
    seen: set[str] = set()
    cursor: int | None = None
    try:
        while True:
            q = dict(query, **({"cursor": str(cursor)} if cursor is not None else {}))
            page = api.call("GET", f"/v2/sandboxes/{_sid(args.sandbox)}/logs?" + urllib.parse.urlencode(q))["logs"]
            fresh = []
            for e in page:
                key = f"{e['timestamp']}|{e['message']}|{sorted(e.get('fields', {}).items())}"
                if key not in seen:
                    seen.add(key)
                    fresh.append(e)
            if args.output == "json" and not args.follow:
                emit(args, page)
                return 0
            for e in fresh:
                print(_log_line(e) if args.output != "json" else json.dumps(e), flush=True)
            if not args.follow:
                return 0
            if page:
                last = page[-1]["timestamp"]
                cursor = int(datetime.datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp() * 1000)
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
