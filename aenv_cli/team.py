"""`aenv team ls|create|rm|quota`: a node's teams and their quotas, through its admin
routes (docs/api.md "Teams and API keys", "Quotas"). They take the node's admin
credential: ``--admin-token-file FILE`` or ``$AENV_ADMIN_TOKEN`` (apiclient.py); --url as
for every API command."""
from __future__ import annotations

import argparse
import urllib.parse
from typing import Any, Callable

from .apiclient import ApiClient, client_options, emit
from .common import CliError, Subcommands

COLUMNS = ["teamID", "name", "isDefault", "createdAt", "quota"]
# the flags of `aenv team quota`, the quota's wire field each sets, and what it shows as in the table
QUOTA_FLAGS = (("running", "runningSandboxes", "running"), ("paused", "pausedSandboxes", "paused"),
               ("creates_per_second", "createsPerSecond", "creates/s"), ("builds", "concurrentBuilds", "builds"),
               ("volume_bytes", "volumeBytes", "volume-bytes"), ("snapshot_bytes", "snapshotBytes", "snapshot-bytes"))
UNLIMITED = ("unlimited", "none")


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
    q = sub.add_parser("quota", parents=[opts],
                       help="show a team's quota, or change the values given ('unlimited' clears one)")
    q.add_argument("team", help="the team's id")
    q.add_argument("--running", type=_limit(int), default=None, metavar="N",
                   help="sandboxes of the team running at once")
    q.add_argument("--paused", type=_limit(int), default=None, metavar="N", help="sandboxes of the team paused")
    q.add_argument("--creates-per-second", type=_limit(float), default=None, metavar="R",
                   help="sandbox creates per second (a token bucket of one second's worth)")
    q.add_argument("--builds", type=_limit(int), default=None, metavar="N", help="template builds at once")
    q.add_argument("--volume-bytes", type=_limit(int), default=None, metavar="B",
                   help="bytes the team's volumes may hold (the sum of their maxBytes)")
    q.add_argument("--snapshot-bytes", type=_limit(int), default=None, metavar="B",
                   help="bytes the team's named snapshots may take")
    q.set_defaults(handler=cmd_quota)


def _limit(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """A quota flag's value: a number, or 'unlimited' (the wire's null)."""
    def parse(text: str) -> Any:
        if text.strip().lower() in UNLIMITED:
            return UNLIMITED[0]
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number nor 'unlimited': {text!r}") from None
    return parse


def quota_text(quota: dict[str, Any] | None) -> str:
    """A quota as the table shows it: ``running=3 creates/s=2.5``, or ``unlimited``."""
    values = quota or {}
    shown = [f"{label}={_number(values[wire])}" for _, wire, label in QUOTA_FLAGS if values.get(wire) is not None]
    return " ".join(shown) or "unlimited"


def _number(v: Any) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"     # a byte count whole, a rate short


def cmd_ls(args: argparse.Namespace) -> int:
    teams = ApiClient.as_admin(args).call("GET", "/admin/teams")
    emit(args, teams, rows=[{**t, "quota": quota_text(t.get("quota"))} for t in teams], columns=COLUMNS)
    return 0


def cmd_quota(args: argparse.Namespace) -> int:
    api = ApiClient.as_admin(args)
    path = f"/admin/teams/{urllib.parse.quote(args.team, safe='')}/quota"
    quota = api.call("GET", path)
    given = {wire: getattr(args, attr) for attr, wire, _ in QUOTA_FLAGS if getattr(args, attr) is not None}
    if given:
        if not isinstance(quota, dict):
            raise CliError(f"the server answered no quota for team {args.team}", 1)
        quota = api.call("PUT", path, {**quota, **{w: None if v == UNLIMITED[0] else v for w, v in given.items()}})
    emit(args, quota, text=quota_text(quota))
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
