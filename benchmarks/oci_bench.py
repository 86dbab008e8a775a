"""`aenv image pull` timings with a real tree: a Debian root filesystem (by default the
guest's debootstrap minbase tree from the guest cache) cut into two layers (/usr as
gzip, the rest as zstd), a sibling image sharing the /usr layer, pushed with skopeo
into Debian's docker-registry on loopback, then pulled with the `aenv` CLI:

1. cold pull (download, flatten, mkfs.ext4 -d, import into the store);
2. the same tag again (manifest only: the image is reused);
3. the sibling (its /usr layer comes from the node's layer cache);
4. the first image rebuilt (--force: layers cached, flatten + import only).

    .venv/bin/python benchmarks/oci_bench.py [--tree DIR] [--json]

Numbers go to docs/images.md ("Measured")."""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import dir_bytes, human_bytes, machine_info, print_table  # noqa: E402

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _registry_module() -> Any:
    spec = importlib.util.spec_from_file_location("aenv_tests_registryproc", ROOT / "tests" / "oci" / "registryproc.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def default_tree() -> Path | None:
    cache = Path(os.environ.get("AENV_GUEST_CACHE", ROOT / ".cache" / "guest"))
    trees = sorted(cache.glob("base-*/tree"))
    return trees[0] if trees else None


def layer_tar(tree: Path, keep: Callable[[str], bool]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(tree):
            dirs.sort()
            for name in dirs + sorted(files):
                p = Path(root) / name
                rel = str(p.relative_to(tree))
                if keep(rel):
                    tar.add(p, arcname=rel, recursive=False)
    return buf.getvalue()


class Layout:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs" / "sha256"
        self.blobs.mkdir(parents=True)
        (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        self.index: list[dict[str, Any]] = []

    def blob(self, data: bytes) -> str:
        d = hashlib.sha256(data).hexdigest()
        (self.blobs / d).write_bytes(data)
        return "sha256:" + d

    def image(self, tag: str, layers: list[tuple[bytes, bytes, str]]) -> None:
        descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar" + suffix, "digest": self.blob(comp),
                  "size": len(comp)} for _tar, comp, suffix in layers]
        cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/bin/bash"]},
                          "rootfs": {"type": "layers", "diff_ids": [
                              "sha256:" + hashlib.sha256(t).hexdigest() for t, _c, _s in layers]}}).encode()
        manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                               "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                          "digest": self.blob(cfg), "size": len(cfg)},
                               "layers": descs}).encode()
        self.index.append({"mediaType": OCI_MANIFEST, "digest": self.blob(manifest), "size": len(manifest),
                           "annotations": {"org.opencontainers.image.ref.name": tag}})
        (self.root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": self.index}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=None, help="root filesystem to make the image of")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tree = args.tree or default_tree()
    if tree is None or not tree.is_dir():
        print("oci_bench: no tree (give --tree, or build the guest first: aenv template build)", file=sys.stderr)
        return 2
    reg_mod = _registry_module()
    work = Path(tempfile.mkdtemp(prefix="oci-bench-"))
    try:
        in_usr = lambda rel: rel == "usr" or rel.startswith("usr/")  # noqa: E731
        usr, rest = layer_tar(tree, in_usr), layer_tar(tree, lambda rel: not in_usr(rel))
        extra = layer_tar(tree, lambda rel: rel in ("etc", "etc/hostname"))
        usr_layer = (usr, gzip.compress(usr, 6), "+gzip")
        layout = Layout(work / "layout")
        layout.image("v1", [usr_layer, (rest, zstandard.ZstdCompressor(level=3).compress(rest), "+zstd")])
        layout.image("sibling", [usr_layer, (extra, gzip.compress(extra), "+gzip")])
        reg = reg_mod.Registry.start(work / "registry")
        rows, results = [], []
        try:
            for tag in ("v1", "sibling"):
                reg.push(layout.root, tag, f"bench/debian:{tag}")
            steps = [("cold pull", "v1", []), ("same tag again", "v1", []), ("sibling (shared /usr)", "sibling", []),
                     ("rebuild, layers cached", "v1", ["--force", "--name", "rebuilt"])]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            for label, tag, extra_args in steps:
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "aenv_cli.main", "--data-dir", str(work / "data"),
                                       "image", "pull", f"{reg.host}/bench/debian:{tag}", "--output", "json",
                                       *extra_args], capture_output=True, text=True, env=env)
                seconds = time.perf_counter() - t0
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                r = json.loads(proc.stdout)
                results.append({"step": label, "seconds": round(seconds, 2), **{k: r[k] for k in (
                    "downloaded_bytes", "cached_layers", "reused", "size", "chunks_added", "chunks_deduped")}})
                rows.append([label, f"{seconds:.2f}", human_bytes(r["downloaded_bytes"]), r["cached_layers"],
                             r["reused"], r["chunks_added"], r["chunks_deduped"]])
        finally:
            reg.stop()
        info = {"machine": machine_info(), "tree": str(tree), "tree_bytes": dir_bytes(tree),
                "layers": {"usr": [len(usr), len(usr_layer[1])], "rest": len(rest)},
                "repo_bytes": dir_bytes(work / "data" / "repo"), "results": results}
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print(f"tree {tree}: {human_bytes(info['tree_bytes'])}; /usr layer {human_bytes(len(usr))} tar, "
                  f"{human_bytes(len(usr_layer[1]))} gzip; rest {human_bytes(len(rest))} tar")
            print_table(rows, ["step", "seconds (CLI wall)", "downloaded", "cached layers", "reused",
                               "chunks added", "chunks deduped"])
            print(f"repository after all steps: {human_bytes(info['repo_bytes'])}")
        return 0
    finally:
        subprocess.run(["rm", "-rf", str(work)])


if __name__ == "__main__":
    sys.exit(main())
