"""`aenv doctor`: can this host run aenv microVMs, and how (KVM or TCG)?"""
from __future__ import annotations

import argparse
import sys

from aenv_vm.doctor import Status, run_checks

from .common import Subcommands, common_options, config_from_args, print_json, print_table


def register(subparsers: Subcommands) -> None:
    p = subparsers.add_parser("doctor", parents=[common_options()],
                              help="check QEMU, the guest image, the accelerator, /dev/kvm, disk space, tap networking, "
                                   "network isolation and QEMU confinement")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--no-probe", action="store_true", help="do not boot a probe VM to test KVM")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    vm = cfg.vm
    checks = run_checks(cfg.data_dir, probe=not args.no_probe, network=vm.network, isolation=vm.isolation,
                        confinement=vm.confinement())
    if args.json:
        print_json([{"check": c.name, "status": c.status.value, "detail": c.detail} for c in checks], out=sys.stdout)
    else:
        print_table([{"check": c.name, "status": c.status.value, "detail": c.detail} for c in checks],
                    ["check", "status", "detail"], out=sys.stdout)
    return 1 if any(c.status is Status.FAIL for c in checks) else 0
