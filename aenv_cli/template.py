"""`aenv template build|ls|rm|logs`: sandbox templates (a booted guest frozen once:
disk layer + memory image + device state in the store; see docs/guest.md and
docs/templates.md).

`build -f Dockerfile` builds on a server through E2B's template API
(template_build.py); `build` without -f boots the base guest on this node. `ls`,
`rm` and `logs` go through the server's API (template_api.py); `ls --local` and
`rm --local` read and change this node's store directly, for a node without a
running server."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from typing import TYPE_CHECKING, Callable

from .common import CliError, Subcommands, config_from_args, open_store, print_json, print_table

if TYPE_CHECKING:
    from aenv_vm.templates.template import Template


def register(subparsers: Subcommands) -> None:
    from .apiclient import client_options

    p = subparsers.add_parser("template", help="build, list and remove sandbox templates")
    sub = p.add_subparsers(dest="template_command", metavar="COMMAND", required=True)
    b = sub.add_parser("build", parents=[client_options()],
                       help="build a template: from a Dockerfile on a server (-f), or the base guest locally",
                       description="With -f: build the Dockerfile on an aenv server (its E2B template API; "
                                   "--url/--api-key) from CONTEXT (default: the Dockerfile's directory). "
                                   "Without -f: boot the base guest on this node and commit it as template "
                                   "ALIAS (default base).")
    b.add_argument("target", nargs="?", default=None, metavar="ALIAS|CONTEXT",
                   help="without -f: the alias to give the template (default base); with -f: the build context")
    b.add_argument("--json", action="store_true", help="same as --output json")
    local = b.add_argument_group("local build (without -f)")
    local.add_argument("--memory-mib", type=int, default=None, help="guest memory in MiB (default: [vm] memory_mib, 256)")
    local.add_argument("--vcpus", type=int, default=None, help="guest vCPUs (default: [vm] vcpus, 1)")
    local.add_argument("--disk-mib", type=int, default=None,
                       help="root disk size in MiB, at least the guest image's (default: [vm] disk_mib; 0 = the image's)")
    remote = b.add_argument_group("Dockerfile build (-f)")
    remote.add_argument("-f", "--file", default=None, metavar="DOCKERFILE", help="the Dockerfile (- for stdin)")
    remote.add_argument("--name", default=None, metavar="NAME[:TAG]", help="template name, optionally with a tag")
    remote.add_argument("--tag", action="append", metavar="TAG", help="another tag for this build (repeatable)")
    remote.add_argument("--cpu-count", type=int, default=None, help="sandbox vCPUs (server default if not given)")
    remote.add_argument("--memory-mb", type=int, default=None, help="sandbox memory in MiB (server default if not given)")
    remote.add_argument("--build-arg", action="append", metavar="NAME[=VALUE]", help="set an ARG (repeatable)")
    remote.add_argument("--ready-cmd", default=None,
                        help="ready check run after the start command (default with CMD/ENTRYPOINT: sleep 20, "
                             "as E2B; '' for none)")
    remote.add_argument("--skip-cache", action="store_true", help="build every step again (force)")
    remote.add_argument("--force-upload", action="store_true", help="upload COPY files even if the server has them")
    remote.add_argument("--registry-username", default=None, help="user for a private FROM image's registry")
    remote.add_argument("--registry-password-stdin", action="store_true", help="read that registry's password from stdin")
    remote.add_argument("--no-wait", action="store_true", help="start the build and return (see `template logs -f`)")
    remote.add_argument("--dry-run", action="store_true",
                        help="print the build steps (and -o json: the request body and files) without a server")
    b.set_defaults(handler=cmd_build)

    ls = sub.add_parser("ls", parents=[client_options()], help="list templates (of the server; --local: this node's store)")
    ls.add_argument("--local", action="store_true", help="read this node's store directly (no server needed)")
    ls.add_argument("--json", action="store_true", help="same as --output json")
    ls.set_defaults(handler=cmd_ls)
    rm = sub.add_parser("rm", parents=[client_options()], help="remove a template by id or name")
    rm.add_argument("template")
    rm.add_argument("--local", action="store_true", help="remove it from this node's store directly")
    rm.set_defaults(handler=cmd_rm)
    lg = sub.add_parser("logs", parents=[client_options()], help="the log of a template build")
    lg.add_argument("template", help="template id or name")
    lg.add_argument("build", nargs="?", default=None, help="build id (default: the template's latest build)")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the build ends")
    lg.add_argument("--offset", type=int, default=0, help="skip this many log entries")
    lg.set_defaults(handler=cmd_logs)


_REMOTE_ONLY = ("name", "tag", "cpu_count", "memory_mb", "build_arg", "ready_cmd", "registry_username")
_REMOTE_FLAGS = ("skip_cache", "force_upload", "registry_password_stdin", "no_wait", "dry_run")


def cmd_build(args: argparse.Namespace) -> int:
    if args.json:
        args.output = "json"
    if args.file is not None:
        from .template_build import cmd_build as build_dockerfile

        return build_dockerfile(args)
    given = [k for k in _REMOTE_ONLY if getattr(args, k) is not None] + [k for k in _REMOTE_FLAGS if getattr(args, k)]
    if given:
        raise CliError(f"--{given[0].replace('_', '-')} is for a Dockerfile build: add -f DOCKERFILE")
    return cmd_build_local(args)


def cmd_ls(args: argparse.Namespace) -> int:
    if args.json:
        args.output = "json"
    if args.local:
        return cmd_ls_local(args)
    from .template_api import cmd_ls as ls_remote

    return _hint_local(ls_remote, args, "ls")


def cmd_rm(args: argparse.Namespace) -> int:
    if args.local:
        return cmd_rm_local(args)
    from .template_api import cmd_rm as rm_remote

    return _hint_local(rm_remote, args, "rm")


def _hint_local(command: Callable[[argparse.Namespace], int], args: argparse.Namespace, name: str) -> int:
    """A node without a running server still has its store: say so when the API is unreachable."""
    try:
        return command(args)
    except CliError as e:
        if str(e).startswith("cannot reach"):
            raise CliError(f"{e}; `aenv template {name} --local` works on this node's store without one",
                           e.exit_code) from None
        raise


def cmd_logs(args: argparse.Namespace) -> int:
    if args.offset < 0:
        raise CliError("--offset must be >= 0")
    from .template_api import cmd_logs as logs_remote

    return logs_remote(args)


def _row(tpl: Template, aliases: list[str]) -> dict[str, object]:
    return {"id": tpl.id, "aliases": ",".join(aliases), "memory_mib": tpl.memory_mib, "vcpus": tpl.vcpus,
            "disk_mib": tpl.disk_mib,
            "accel": tpl.accel, "guest": tpl.guest_key,
            "created": datetime.datetime.fromtimestamp(tpl.created).isoformat(timespec="seconds")}


def cmd_build_local(args: argparse.Namespace) -> int:
    from aenv_vm.errors import VmError
    from aenv_vm.guest import ensure_guest

    from .base_template import build_base_template, choose_accel

    alias = args.target or "base"
    cfg = config_from_args(args)
    vm = cfg.vm
    memory_mib = vm.memory_mib if args.memory_mib is None else args.memory_mib
    vcpus = vm.vcpus if args.vcpus is None else args.vcpus
    disk_mib = vm.disk_mib if args.disk_mib is None else args.disk_mib
    if memory_mib < 64 or vcpus < 1 or disk_mib < 0:
        raise CliError("--memory-mib must be >= 64, --vcpus >= 1 and --disk-mib >= 0")
    host_ca = vm.host_ca()           # [vm] trust_host_ca: a bad bundle is an error before any boot
    confinement = vm.confinement()   # the build VM and the probe are confined as [vm] confine says
    try:
        guest = ensure_guest()
        accel, reason = asyncio.run(choose_accel(vm, guest, confinement))
        print(f"template: accelerator {reason}", file=sys.stderr)
        with open_store(args, create=True) as store:
            cfg.data_dir.mkdir(parents=True, exist_ok=True)
            tpl = asyncio.run(build_base_template(store, guest, cfg.data_dir, alias=alias, memory_mib=memory_mib,
                                                  vcpus=vcpus, disk_mib=disk_mib, accel=accel,
                                                  confinement=confinement, ca_bundle=host_ca))
    except VmError as e:
        raise CliError(str(e), 1) from None
    finally:
        confinement.close()
    row = _row(tpl, [alias])
    print_json(row, out=sys.stdout) if args.output == "json" else print(tpl.id)
    return 0


def cmd_ls_local(args: argparse.Namespace) -> int:
    from aenv_vm.templates.template import list_templates

    with open_store(args) as store:
        rows = [_row(t, aliases) for t, aliases in list_templates(store)]
    if args.output == "json":
        print_json(rows, out=sys.stdout)
    else:
        print_table(rows, ["id", "aliases", "memory_mib", "vcpus", "disk_mib", "accel", "guest", "created"], out=sys.stdout)
    return 0


def cmd_rm_local(args: argparse.Namespace) -> int:
    from aenv_vm.errors import VmError
    from aenv_vm.templates.template import remove_template

    with open_store(args) as store:
        try:
            tpl = remove_template(store, args.template)
        except VmError as e:
            raise CliError(str(e), 1) from None
    print(f"removed {tpl.id} (its data is freed by `aenv repo gc`)")
    return 0
