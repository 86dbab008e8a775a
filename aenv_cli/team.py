"""`aenv team ls|create|rm`: a node's teams, through its admin routes (docs/api.md "Teams
and API keys"). They take the node's admin credential: ``--admin-token-file FILE`` or
``$AENV_ADMIN_TOKEN`` (apiclient.py); --url as for every API command."""
from __future__ import annotations

import argparse
import urllib.parse

from .apiclient import ApiClient, client_options, emit
from .common import Subcommands

COLUMNS = ["teamID", "name", "isDefault", "createdAt"]


def admin_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False, parents=[client_options()])
    parent.add_argument("--admin-token-file", default=None, metavar="FILE",
                        help="file holding the node's admin credential (env AENV_ADMIN_TOKEN)")
    return parent


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("team", help="list, create and delete teams (the node's admin credential)")
    sub = p.add_subparsers(dest="team_command", metavar="COMMAND", required=True)
    opts = admin_options()
    sub.add_parser("ls", parents=[opts], help="list the node's teams").set_defaults(handler=cmd_ls)
    c = sub.add_parser("create", parents=[opts], help="create a team; prints its id")
    c.add_argument("name")
    c.set_defaults(handler=cmd_create)
    rm = sub.add_parser("rm", parents=[opts], help="delete a team and its API keys (it must hold no sandbox)")
    rm.add_argument("team", help="the team's id")
    rm.set_defaults(handler=cmd_rm)


def cmd_ls(args: argparse.Namespace) -> int:
    teams = ApiClient.as_admin(args).call("GET", "/admin/teams")
    emit(args, teams, rows=teams, columns=COLUMNS)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    team = ApiClient.as_admin(args).call("POST", "/admin/teams", {"name": args.name}, expect=(201,))
    emit(args, team, text=team["teamID"])
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    ApiClient.as_admin(args).call("DELETE", f"/admin/teams/{urllib.parse.quote(args.team, safe='')}",
                                  expect=(204,))
    emit(args, {"teamID": args.team, "deleted": True}, text=f"deleted team {args.team}")
    return 0
