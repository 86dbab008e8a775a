"""`aenv image import|export|ls|inspect|rm|serve` (and pull|load: image_oci.py): layered block images.

Images are catalog records of kind "image" whose "disk" role names the top
layer; see docs/block-image.md."""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from aenv_store.errors import StoreNotFound

from .common import (CliError, Subcommands, common_options, config_from_args, human_bytes, open_store, parse_size,
                     print_json, print_table)


def _meta(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise CliError(f"bad --meta {item!r}: expected KEY=VALUE")
        out[k] = v
    return out


def _resolve_image(store: Any, name: str) -> Any:
    from aenv_vm.blockimage.layer import image_top

    try:
        record = store.resolve(name)
    except StoreNotFound:
        raise CliError(f"no image named {name!r} (see `aenv image ls`)", 1) from None
    return record, image_top(record)


def cmd_import(args: argparse.Namespace) -> int:
    from aenv_vm.blockimage.importer import import_raw, import_tree

    src = Path(args.source).expanduser()
    if not src.exists():
        raise CliError(f"{src}: no such file or directory")
    store = open_store(args, create=args.init)
    try:
        if src.is_dir():
            res = import_tree(store, src, args.name, size=parse_size(args.size) if args.size else None,
                              meta=_meta(args.meta), exclusive=not args.force)
        else:
            if args.size:
                raise CliError("--size applies to directory imports only")
            res = import_raw(store, src, args.name, meta=_meta(args.meta), exclusive=not args.force)
    finally:
        store.close()
    if args.json:
        print_json({"name": res.name, "layer": res.layer_id.hex(), "size": res.size, "data_bytes": res.data_bytes,
                    "zero_bytes": res.zero_bytes, "chunks_added": res.chunks_added,
                    "chunks_deduped": res.chunks_deduped, "seconds": round(res.seconds, 3)}, out=sys.stdout)
    else:
        print(f"imported {src} as image {res.name}: layer {res.layer_id.short()}, {human_bytes(res.size)} "
              f"({human_bytes(res.data_bytes)} data, {res.chunks_added} new chunks, "
              f"{res.chunks_deduped} deduplicated) in {res.seconds:.2f}s")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from aenv_vm.blockimage.importer import export_raw

    out = Path(args.output).expanduser()
    if out.exists() and not args.force:
        raise CliError(f"{out} exists (use --force to overwrite)")
    existed = out.exists()
    store = open_store(args)
    try:
        _record, top = _resolve_image(store, args.name)
        try:
            size = export_raw(store, top, out)
        except OSError as e:
            if not existed:   # a partial file of ours: nothing the user had is lost
                out.unlink(missing_ok=True)
            raise CliError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        store.close()
    print(f"exported image {args.name} ({human_bytes(size)}) to {out}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from aenv_vm.blockimage.layer import IMAGE_KIND, image_top

    store = open_store(args)
    try:
        rows: list[dict[str, Any]] = []
        for rec in sorted(store.list_records(IMAGE_KIND), key=lambda r: r.name):
            top = image_top(rec)
            m = store.load_manifest(top)
            depth = 1
            parent = m.parent
            while parent is not None and depth < 256:
                parent = store.load_manifest(parent).parent
                depth += 1
            rows.append({"name": rec.name, "size": m.size, "layers": depth, "top": top.hex(),
                         "meta": dict(rec.meta), "created": rec.created,
                         "reference": dict(rec.meta).get("oci.reference") or dict(rec.meta).get("source", "")})
    finally:
        store.close()
    if args.json:
        print_json(rows, out=sys.stdout)
    else:
        print_table([{**r, "size": human_bytes(r["size"]), "top": r["top"][:12]} for r in rows],
                    ["name", "size", "layers", "top", "reference"], out=sys.stdout)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Delete image records; their data goes at the next `aenv repo gc` unless something
    else (another name, a template) still uses it."""
    from aenv_vm.blockimage.layer import IMAGE_KIND

    store = open_store(args)
    try:
        for name in args.names:
            try:
                rec = store.get_record(name)
            except StoreNotFound:
                raise CliError(f"no image named {name!r} (see `aenv image ls`)", 1) from None
            if rec.kind != IMAGE_KIND:
                raise CliError(f"{name!r} is a {rec.kind} record, not an image", 1)
            store.delete_record(name)
            print(f"removed image {name}")
    finally:
        store.close()
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from aenv_vm.blockimage.extent_map import ExtentMap
    from aenv_vm.blockimage.layer import load_stack

    store = open_store(args)
    try:
        record, top = _resolve_image(store, args.name)
        layers = load_stack(store, top)
    finally:
        store.close()
    flat = ExtentMap.from_layers(layers[-1].size, [m.extents for m in layers])
    info = {
        "name": record.name, "kind": record.kind, "top": top.hex(), "size": layers[-1].size,
        "chunk_size": layers[-1].chunk_size, "meta": dict(record.meta),
        "flattened": flat.stats(),
        "layers": [{"index": i, "id": m.id.hex(), "extents": len(m.extents),
                    "data_bytes": m.stored_bytes(),
                    "zero_bytes": sum(e.length for e in m.extents if e.chunk is None),
                    "meta": dict(m.meta)} for i, m in enumerate(layers)],
    }
    if args.json:
        print_json(info, out=sys.stdout)
        return 0
    print(f"image {info['name']}: {human_bytes(info['size'])}, {len(layers)} layer(s), top {top.hex()}")
    fs = info["flattened"]
    print(f"flattened: {fs['segments']} segments, {human_bytes(fs['data_bytes'])} data in {fs['chunks']} chunks, "
          f"{human_bytes(fs['zero_bytes'])} zeros")
    print_table([{**l, "id": l["id"][:12], "data_bytes": human_bytes(l["data_bytes"]),
                  "zero_bytes": human_bytes(l["zero_bytes"])} for l in info["layers"]],
                ["index", "id", "extents", "data_bytes", "zero_bytes"], out=sys.stdout)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve images over NBD until interrupted (writes go to a per-image upper
    layer under <data-dir>/images/<name>/upper, flushed on exit)."""
    from aenv_vm.blockimage.image import BlockImage
    from aenv_vm.blockimage.nbd_server import NbdServer

    cfg = config_from_args(args)
    store = open_store(args)
    images = []
    try:
        for name in args.names:
            _record, top = _resolve_image(store, name)
            upper = None if args.read_only else cfg.data_dir / "images" / name / "upper"
            images.append(BlockImage.open(store, top, name, upper_dir=upper))

        async def run() -> None:
            server = NbdServer(Path(args.socket).expanduser())
            for img in images:
                server.add_export(img)
            await server.start()
            print(f"serving {', '.join(args.names)} on {server.socket_path} (Ctrl-C to stop)", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            await server.close()

        asyncio.run(run())
    finally:
        for img in images:
            img.close()
        store.close()
    return 0


def register(subparsers: Subcommands) -> None:
    common = common_options()
    from . import image_oci

    p = subparsers.add_parser("image", help="layered block images (pull, load, import, export, ls, inspect, rm, serve)")
    sub = p.add_subparsers(dest="image_command", metavar="SUBCOMMAND")
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])

    imp = sub.add_parser("import", parents=[common], help="import a raw/ext4 image file or a directory tree")
    imp.add_argument("source", help="raw image file, or a directory (made into ext4 with mkfs.ext4 -d)")
    imp.add_argument("name", help="image name (catalog record of kind image)")
    imp.add_argument("--size", help="filesystem size for a directory import (default: 1.5x content + 64M)")
    imp.add_argument("--meta", action="append", metavar="KEY=VALUE", help="metadata (repeatable)")
    imp.add_argument("--force", action="store_true", help="replace an existing record of that name")
    imp.add_argument("--init", action="store_true", help="create the repository if it does not exist")
    imp.add_argument("--json", action="store_true")
    imp.set_defaults(handler=cmd_import)

    exp = sub.add_parser("export", parents=[common], help="flatten an image into a raw file")
    exp.add_argument("name")
    exp.add_argument("output")
    exp.add_argument("--force", action="store_true", help="overwrite the output file")
    exp.set_defaults(handler=cmd_export)

    ls = sub.add_parser("ls", parents=[common], help="list images")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=cmd_ls)

    ins = sub.add_parser("inspect", parents=[common], help="layers and extent statistics of an image")
    ins.add_argument("name")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(handler=cmd_inspect)

    rm = sub.add_parser("rm", parents=[common], help="remove images (their data goes at the next repo gc)")
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.set_defaults(handler=cmd_rm)

    image_oci.register(sub)

    srv = sub.add_parser("serve", parents=[common], help="serve images over NBD on a Unix socket")
    srv.add_argument("names", nargs="+", metavar="NAME")
    srv.add_argument("--socket", required=True, help="Unix socket path")
    srv.add_argument("--read-only", action="store_true")
    srv.set_defaults(handler=cmd_serve)
