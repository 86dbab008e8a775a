"""Images the tests make themselves: tar layers from entry lists, OCI image layouts
(with image indexes), and docker-save tarballs. Written in plain Python from the
OCI image spec, so the code under test does not check itself."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass
class Entry:
    """One tar entry: kind f(ile) d(ir) l(symlink) h(ardlink) c(har device) p(fifo)."""

    name: str
    kind: str = "f"
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    link: str = ""
    mtime: int = 1_700_000_000
    xattrs: dict[str, str] = field(default_factory=dict)


def F(name: str, data: bytes | str = b"", mode: int = 0o644, **kw: Any) -> Entry:
    return Entry(name, "f", data.encode() if isinstance(data, str) else data, mode, **kw)


def D(name: str, mode: int = 0o755, **kw: Any) -> Entry:
    return Entry(name, "d", mode=mode, **kw)


def L(name: str, target: str, **kw: Any) -> Entry:
    return Entry(name, "l", link=target, mode=0o777, **kw)


def H(name: str, target: str, **kw: Any) -> Entry:
    return Entry(name, "h", link=target, **kw)


def make_tar(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            ti = tarfile.TarInfo(e.name)
            ti.mode, ti.uid, ti.gid, ti.mtime = e.mode, e.uid, e.gid, e.mtime
            if e.xattrs:
                ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            payload = None
            if e.kind == "f":
                ti.type, ti.size, payload = tarfile.REGTYPE, len(e.data), io.BytesIO(e.data)
            elif e.kind == "d":
                ti.type = tarfile.DIRTYPE
            elif e.kind == "l":
                ti.type, ti.linkname = tarfile.SYMTYPE, e.link
            elif e.kind == "h":
                ti.type, ti.linkname = tarfile.LNKTYPE, e.link
            elif e.kind == "c":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
            elif e.kind == "p":
                ti.type = tarfile.FIFOTYPE
            tar.addfile(ti, payload)
    return buf.getvalue()


def compress(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Layer:
    entries: list[Entry]
    compression: str = "gzip"       # gzip, zstd or none


class OciLayout:
    """An OCI image layout directory being written (index.json, oci-layout, blobs/)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        self.index: list[dict[str, Any]] = []

    def blob(self, data: bytes) -> str:
        d = sha(data)
        (self.root / "blobs" / "sha256" / d[7:]).write_bytes(data)
        return d

    def image(self, layers: list[Layer], config: dict[str, Any] | None = None,
              arch: str = "amd64") -> tuple[dict[str, Any], bytes]:
        """Write one image's blobs; returns (descriptor of its manifest, manifest bytes)."""
        descs, diff_ids = [], []
        for layer in layers:
            tar = make_tar(layer.entries)
            diff_ids.append(sha(tar))
            data = compress(tar, layer.compression)
            suffix = {"gzip": "+gzip", "zstd": "+zstd", "none": ""}[layer.compression]
            descs.append({"mediaType": OCI_LAYER + suffix, "digest": self.blob(data), "size": len(data)})
        cfg = {"architecture": arch, "os": "linux", "config": config or {},
               "rootfs": {"type": "layers", "diff_ids": diff_ids}}
        cfg_bytes = json.dumps(cfg).encode()
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": OCI_CONFIG, "digest": self.blob(cfg_bytes), "size": len(cfg_bytes)},
                    "layers": descs}
        mbytes = json.dumps(manifest).encode()
        return ({"mediaType": OCI_MANIFEST, "digest": self.blob(mbytes), "size": len(mbytes),
                 "platform": {"architecture": arch, "os": "linux"}}, mbytes)

    def tag(self, tag: str, desc: dict[str, Any]) -> None:
        self.index.append({**desc, "annotations": {"org.opencontainers.image.ref.name": tag}})
        self.write_index()

    def multi(self, tag: str, descs: list[dict[str, Any]]) -> dict[str, Any]:
        """An image index over ``descs`` (one per platform), tagged ``tag``."""
        idx = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descs}).encode()
        desc = {"mediaType": OCI_INDEX, "digest": self.blob(idx), "size": len(idx)}
        self.tag(tag, desc)
        return desc

    def write_index(self) -> None:
        (self.root / "index.json").write_text(json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX,
                                                          "manifests": self.index}))


def docker_save_tar(out: Path, layers: list[Layer], config: dict[str, Any], repo_tag: str) -> None:
    """A `docker save` style tarball: manifest.json, <config>.json, <id>/layer.tar."""
    buf = io.BytesIO()
    diff_ids, paths = [], []
    members: list[tuple[str, bytes]] = []
    for i, layer in enumerate(layers):
        tar = make_tar(layer.entries)
        diff_ids.append(sha(tar))
        path = f"{i:064x}/layer.tar"
        paths.append(path)
        members.append((path, compress(tar, layer.compression)))
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                      "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    cfg_name = sha(cfg)[7:] + ".json"
    members.append((cfg_name, cfg))
    members.append(("manifest.json", json.dumps([{"Config": cfg_name, "RepoTags": [repo_tag],
                                                   "Layers": paths}]).encode()))
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    out.write_bytes(buf.getvalue())
