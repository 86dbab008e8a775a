"""`aenv key ls|create|rm`: API keys of a team (docs/api.md "Teams and API keys"). With
an API key (--api-key / E2B_API_KEY, as every API command): that key's team's keys.
With ``--team TEAM_ID``: that team's, through the admin routes with the node's admin
credential (``--admin-token-file`` / ``$AENV_ADMIN_TOKEN``). A key's value is printed
once, when it is created; lists show it masked."""
from __future__ import annotations

import argparse
import urllib.parse
from typing import Any

from .apiclient import ApiClient, emit
from .common import Subcommands
from .team import admin_options

COLUMNS = ["id", "name", "mask", "createdAt"]


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("key", help="list, create and delete a team's API keys")
    sub = p.add_subparsers(dest="key_command", metavar="COMMAND", required=True)
    opts = argparse.ArgumentParser(add_help=False, parents=[admin_options()])
    opts.add_argument("--team", default=None, metavar="TEAM_ID",
                      help="this team's keys, with the admin credential (default: the API key's own team)")
    sub.add_parser("ls", parents=[opts], help="list the team's API keys (masked)").set_defaults(handler=cmd_ls)
    c = sub.add_parser("create", parents=[opts], help="create an API key; prints it (shown this once)")
    c.add_argument("name")
    c.set_defaults(handler=cmd_create)
    rm = sub.add_parser("rm", parents=[opts], help="delete an API key (it fails from now on)")
    rm.add_argument("key", help="the key's id (from `aenv key ls`)")
    rm.set_defaults(handler=cmd_rm)


def _client(args: argparse.Namespace) -> tuple[ApiClient, str]:
    """The client and the path of the team's keys."""
    if args.team:
        return ApiClient.as_admin(args), f"/admin/teams/{urllib.parse.quote(args.team, safe='')}/api-keys"
    return ApiClient.from_args(args), "/api-keys"


def _masked(k: dict[str, Any]) -> str:
    m = k.get("mask") or {}
    return f"{m.get('prefix', '')}{m.get('maskedValuePrefix', '')}…{m.get('maskedValueSuffix', '')}"


def cmd_ls(args: argparse.Namespace) -> int:
    api, path = _client(args)
    keys = api.call("GET", path)
    emit(args, keys, rows=[{**k, "mask": _masked(k)} for k in keys], columns=COLUMNS)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    api, path = _client(args)
    made = api.call("POST", path, {"name": args.name}, expect=(201,))
    emit(args, made, text=made["key"])
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    api, path = _client(args)
    api.call("DELETE", f"{path}/{urllib.parse.quote(args.key, safe='')}", expect=(204,))
    emit(args, {"id": args.key, "deleted": True}, text=f"deleted key {args.key}")
    return 0
