"""`aenv template build|ls|rm`: sandbox templates (a booted guest frozen once:
disk layer + memory image + device state in the store; see docs/guest.md)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import tempfile
from pathlib import Path

from .common import CliError, Subcommands, common_options, config_from_args, print_json, print_table


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("template", help="build, list and remove sandbox templates")
    sub = p.add_subparsers(dest="template_command", metavar="COMMAND", required=True)
    b = sub.add_parser("build", parents=[common_options()],
                       help="boot the base guest once and commit it as a template")
    b.add_argument("alias", nargs="?", default="base", help="alias to give the template (default: base)")
    b.add_argument("--memory-mib", type=int, default=None, help="guest memory in MiB (default: [vm] memory_mib, 256)")
    b.add_argument("--vcpus", type=int, default=None, help="guest vCPUs (default: [vm] vcpus, 1)")
    b.add_argument("--disk-mib", type=int, default=None,
                   help="root disk size in MiB, at least the guest image's (default: [vm] disk_mib; 0 = the image's)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(handler=cmd_build)
    ls = sub.add_parser("ls", parents=[common_options()], help="list templates")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=cmd_ls)
    rm = sub.add_parser("rm", parents=[common_options()], help="remove a template (by id or alias)")
    rm.add_argument("template")
    rm.set_defaults(handler=cmd_rm)


def _open_store(args: argparse.Namespace, create: bool = False):  # type: ignore[no-untyped-def]
    from aenv_store.assembly import open_node_store

    return open_node_store(config_from_args(args).store_settings(), create=create)


def _row(tpl, aliases: list[str]) -> dict:  # type: ignore[no-untyped-def]
    return {"id": tpl.id, "aliases": ",".join(aliases), "memory_mib": tpl.memory_mib, "vcpus": tpl.vcpus,
            "disk_mib": tpl.disk_mib,
            "accel": tpl.accel, "guest": tpl.guest_key,
            "created": datetime.datetime.fromtimestamp(tpl.created).isoformat(timespec="seconds")}


def cmd_build(args: argparse.Namespace) -> int:
    from aenv_vm.errors import VmError
    from aenv_vm.guest import ensure_guest
    from aenv_vm.qemu.accel import probe_accel
    from aenv_vm.templates.build import build_template

    cfg = config_from_args(args)
    vm = cfg.section("vm")
    memory_mib = vm.memory_mib if args.memory_mib is None else args.memory_mib
    vcpus = vm.vcpus if args.vcpus is None else args.vcpus
    disk_mib = vm.disk_mib if args.disk_mib is None else args.disk_mib
    if memory_mib < 64 or vcpus < 1 or disk_mib < 0:
        raise CliError("--memory-mib must be >= 64, --vcpus >= 1 and --disk-mib >= 0")
    host_ca = vm.host_ca()           # [vm] trust_host_ca: a bad bundle is an error before any boot
    confinement = vm.confinement()   # the build VM and the probe are confined as [vm] confine says
    try:
        guest = ensure_guest()
        if vm.accel == "auto":
            choice = asyncio.run(probe_accel(guest.kernel, guest.initrd,
                                             cache_file=guest.kernel.parent.parent / "accel.json",
                                             confinement=confinement))
            accel, reason = choice.accel, choice.reason
        else:
            accel, reason = vm.accel, f"{vm.accel} (forced by [vm] accel)"
        print(f"template: accelerator {reason}", file=sys.stderr)
        with _open_store(args, create=True) as store:
            cfg.data_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="template-build-", dir=cfg.data_dir) as work:
                tpl = asyncio.run(build_template(store, guest, Path(work), alias=args.alias,
                                                 memory_mib=memory_mib, vcpus=vcpus, accel=accel,
                                                 disk_mib=disk_mib or None, confinement=confinement,
                                                 ca_bundle=host_ca))
    except VmError as e:
        raise CliError(str(e), 1) from None
    finally:
        confinement.close()
    row = _row(tpl, [args.alias])
    print_json(row, out=sys.stdout) if args.json else print(tpl.id)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from aenv_vm.templates.template import list_templates

    with _open_store(args) as store:
        rows = [_row(t, aliases) for t, aliases in list_templates(store)]
    if args.json:
        print_json(rows, out=sys.stdout)
    else:
        print_table(rows, ["id", "aliases", "memory_mib", "vcpus", "disk_mib", "accel", "guest", "created"], out=sys.stdout)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from aenv_vm.errors import VmError
    from aenv_vm.templates.template import remove_template

    with _open_store(args) as store:
        try:
            tpl = remove_template(store, args.template)
        except VmError as e:
            raise CliError(str(e), 1) from None
    print(f"removed {tpl.id} (its data is freed by `aenv repo gc`)")
    return 0
