"""`aenv image pull|load`: OCI images from a registry or from a file (a `docker
save` tarball, an OCI image layout directory or tar) into block images
(aenv_vm/oci, docs/images.md)."""
from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path
from typing import Any

from .common import (CliError, Progress, Subcommands, common_options, config_from_args, human_bytes, parse_size,
                     print_json)


def _say(text: str) -> None:
    # on a terminal a progress bar may be on the current line: clear it first
    prefix = "\r\033[K" if sys.stderr.isatty() else ""
    sys.stderr.write(f"{prefix}{text}\n")
    sys.stderr.flush()


def _credentials(args: argparse.Namespace) -> Any:
    from aenv_vm.oci.auth import Credentials

    if args.password_stdin and not args.username:
        raise CliError("--password-stdin needs --username")
    if not args.username:
        return None
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    elif sys.stdin.isatty():
        password = getpass.getpass(f"password for {args.username}: ")
    else:
        raise CliError("--username needs --password-stdin (or a terminal to ask on)")
    if not password:
        raise CliError("empty password")
    return Credentials(args.username, password)


def _tools() -> Any:
    """The guest tools every converted image gets (docs/tools.md): built with the guest
    on first use, at once when cached."""
    from aenv_vm.guest import ensure_guest

    return ensure_guest(quiet=True).tools_tree


def _size(args: argparse.Namespace) -> int | None:
    return parse_size(args.size) if args.size else None


def _report(args: argparse.Namespace, what: str, img: Any, extra: dict[str, Any]) -> int:
    info = {"name": img.name, "layer": img.layer_id.hex(), "size": img.size, "reused": img.reused,
            "reference": img.meta.get("oci.reference"), "digest": img.meta.get("oci.digest"),
            "platform": img.meta.get("oci.platform"), "config": img.runtime, "notes": list(img.notes),
            "chunks_added": img.chunks_added, "chunks_deduped": img.chunks_deduped, **extra}
    if args.output == "json":
        print_json(info, out=sys.stdout)
    elif img.reused:
        print(f"{what}: already present as image {img.name} ({info['digest']})")
    else:
        print(f"{what}: image {img.name} ({info['digest']}, {info['platform']}), {human_bytes(img.size)} disk, "
              f"layer {img.layer_id.short()}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from aenv_store.assembly import open_node_store
    from aenv_vm.oci.pull import pull_image

    cfg = config_from_args(args)
    credentials = _credentials(args)
    size = _size(args)
    store = open_node_store(cfg.store_settings(), create=True)
    try:
        res = pull_image(store, cfg.oci, cfg.data_dir, args.reference, credentials=credentials,
                         platform=args.platform, name=args.name, size=size, replace=args.force,
                         progress=Progress, log_line=_say, tools=_tools())
    finally:
        store.close()
    return _report(args, res.reference, res.image, {
        "reference": res.reference, "layers": res.layers, "cached_layers": res.cached_layers, "downloaded_bytes": res.downloaded_bytes,
        "seconds": round(res.seconds, 3)})


def cmd_load(args: argparse.Namespace) -> int:
    from aenv_store.assembly import open_node_store
    from aenv_vm.oci.archive import load_archive

    path = Path(args.path).expanduser()
    if not path.exists():
        raise CliError(f"{path}: no such file or directory")
    cfg = config_from_args(args)
    size = _size(args)
    store = open_node_store(cfg.store_settings(), create=True)
    try:
        img = load_archive(store, cfg.oci, cfg.data_dir, path, tag=args.tag, platform=args.platform,
                           name=args.name, size=size, replace=args.force, progress=Progress, log_line=_say,
                           tools=_tools())
    finally:
        store.close()
    return _report(args, str(path), img, {})


def register(sub: Subcommands) -> None:
    common = common_options()

    def shared(p: argparse.ArgumentParser) -> None:
        p.add_argument("--platform", default="linux/amd64", help="OS/ARCH to pick from a multi-platform image "
                                                                 "(default linux/amd64)")
        p.add_argument("--name", help="catalog name of the image (default oci-<digest prefix>)")
        p.add_argument("--size", help="disk size (default: the tree + [oci] headroom; e.g. 2G)")
        p.add_argument("--force", action="store_true", help="build it again / replace a record of that name")
        p.add_argument("--output", choices=("text", "json"), default="text", help="output format (default text)")

    pull = sub.add_parser("pull", parents=[common], help="pull an OCI/Docker image from a registry")
    pull.add_argument("reference", help="image reference: alpine, python:3.12, host:port/ns/name:tag, name@sha256:…")
    pull.add_argument("--username", "-u", help="registry user name")
    pull.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    shared(pull)
    pull.set_defaults(handler=cmd_pull)

    load = sub.add_parser("load", parents=[common],
                          help="load an image from a `docker save` tar or an OCI layout (directory or tar)")
    load.add_argument("path")
    load.add_argument("--tag", help="which image of an archive holding several (its tag or ref name)")
    shared(load)
    load.set_defaults(handler=cmd_load)
