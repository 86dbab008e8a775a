"""Images from a file: `docker save` tarballs and OCI image layouts (a directory,
or a tar of one: ``oci-layout``, ``index.json``, ``blobs/sha256/…``).

Nothing in an archive is trusted more than a registry: the archive is never
extracted by its own paths. Blobs are copied out by name into the node's layer
cache while hashing (an OCI blob must hash to its name and its descriptor's
size), a `docker save` layer is checked against the config's DiffID while it is
applied, and member names are only looked up, never written to. An archive
that is both (Docker ≥ 25 writes an OCI layout plus manifest.json) is read as
the OCI layout.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable

from aenv_store.admin.progress import ProgressFactory, no_progress

from .cache import LayerCache
from .config import OciConfig
from ..tools import ToolsTree
from .disk import (DiskImage, ImageIdentity, LayerFile, build_disk_image, check_name_free, find_image, reuse,
                   tools_current)
from .errors import BadImage, ImageNotFound
from .manifest import (DEFAULT_PLATFORM, Descriptor, is_index, normalise_platform, parse_config, parse_index,
                       parse_manifest, pick_platform)
from .reference import check_digest

if TYPE_CHECKING:
    from aenv_store.store import Store

REF_NAME = "org.opencontainers.image.ref.name"
FULL_NAME = "io.containerd.image.name"          # what `docker save` (Docker >= 25) puts there
MAX_JSON = 16 << 20
COPY = 1 << 20


class _Source:
    """Read access to the members of an archive: a directory or a tar."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tar: tarfile.TarFile | None = None
        self.members: dict[str, tarfile.TarInfo] = {}
        if path.is_dir():
            return
        try:
            self.tar = tarfile.open(path, "r:*")
            for m in self.tar.getmembers():
                name = os.path.normpath(m.name.lstrip("/")).removeprefix("./")
                if m.isfile():
                    self.members[name] = m
        except tarfile.ReadError:
            raise BadImage(f"{path}: not a tar archive (plain, gzip, bzip2 or xz) nor an OCI layout "
                           "directory") from None
        except (tarfile.TarError, EOFError, OSError) as e:
            raise BadImage(f"{path}: cannot read the archive: {e}") from None

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()

    def has(self, name: str) -> bool:
        if self.tar is None:
            p = self.path / name
            return p.is_file() and not p.is_symlink() and self.path.resolve() in p.resolve().parents
        return name in self.members

    def open(self, name: str) -> IO[bytes]:
        if not self.has(name):
            raise BadImage(f"{self.path}: {name} is missing from the archive")
        if self.tar is None:
            return open(self.path / name, "rb")
        f = self.tar.extractfile(self.members[name])
        assert f is not None
        return f

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size if self.tar is None else self.members[name].size

    def read_json(self, name: str) -> object:
        if self.size(name) > MAX_JSON:
            raise BadImage(f"{self.path}: {name} is too large")
        with self.open(name) as f:
            try:
                return json.loads(f.read())
            except (ValueError, UnicodeDecodeError):
                raise BadImage(f"{self.path}: {name} is not JSON") from None

    def read_bytes(self, name: str) -> bytes:
        if self.size(name) > MAX_JSON:
            raise BadImage(f"{self.path}: {name} is too large")
        with self.open(name) as f:
            return f.read()

    def copy_out(self, name: str, dest: Path, digest: str | None, size: int | None,
                 on_bytes: Callable[[int], None] | None = None) -> str:
        """Copy member ``name`` to ``dest`` (via a .part file), checking digest and size
        when given; returns its sha256 digest."""
        part = dest.with_name(dest.name + f".part{os.getpid()}-{secrets.token_hex(4)}")
        sha = hashlib.sha256()
        n = 0
        try:
            with self.open(name) as src, open(part, "wb") as out:
                while buf := src.read(COPY):
                    sha.update(buf)
                    out.write(buf)
                    n += len(buf)
                    if on_bytes:
                        on_bytes(len(buf))
            got = "sha256:" + sha.hexdigest()
            if (digest is not None and got != digest) or (size is not None and n != size):
                raise BadImage(f"{self.path}: {name} is corrupt ({n} bytes hashing to {got}, "
                               f"expected {size} bytes, {digest})")
            os.replace(part, dest)
            return got
        finally:
            part.unlink(missing_ok=True)


def _blob_name(digest: str) -> str:
    return "blobs/sha256/" + check_digest(digest)[len("sha256:"):]


@dataclass
class _Found:
    reference: str
    manifest_digest: str
    index_digest: str | None
    config_bytes: bytes
    layers: list[tuple[str, str | None, int, str | None]]      # (member, digest or None, size, diff_id)


def _oci_layout(src: _Source, tag: str | None, platform: str, label: str) -> _Found:
    index = src.read_bytes("index.json")
    entries = parse_index(index, f"{label} index.json")
    if not entries:
        raise BadImage(f"{label}: index.json lists no image")
    raw = src.read_json("index.json")
    names = [(m.get("annotations") or {}).get(REF_NAME) if isinstance(m, dict) else None
             for m in raw.get("manifests", [])] if isinstance(raw, dict) else []
    if tag is not None:
        chosen = [e for e, n in zip(entries, names) if n == tag or (n and n.rsplit(":", 1)[-1] == tag)]
        if not chosen:
            raise ImageNotFound(f"{label}: no image tagged {tag!r} (tags: {', '.join(n for n in names if n) or 'none'})")
    elif len(set(names)) > 1 or (len(entries) > 1 and all(e.platform is None for e in entries)):
        raise BadImage(f"{label} holds {len(entries)} images: say which with --tag "
                       f"({', '.join(sorted({n for n in names if n})) or 'untagged'})")
    else:
        chosen = entries
    full_names = [(m.get("annotations") or {}).get(FULL_NAME) if isinstance(m, dict) else None
                  for m in raw.get("manifests", [])] if isinstance(raw, dict) else []
    full = next((n for e, n in zip(entries, full_names) if e is chosen[0] and isinstance(n, str) and n), None)
    ref_name = next((n for e, n in zip(entries, names) if e is chosen[0] and n), None)
    # a ref.name is a full reference or only a tag: then the layout's file name stands for the repository
    ref = full or (label if not ref_name else ref_name if "/" in ref_name or ":" in ref_name
                   else f"{label}:{ref_name}")
    entry = chosen[0] if len(chosen) == 1 and chosen[0].platform is None else pick_platform(chosen, platform, label)
    index_digest = None
    data = src.read_bytes(_blob_name(entry.digest))
    _verify(data, entry, label)
    depth = 0
    while is_index(entry.media_type, data):            # nested indexes (skopeo/buildx write them)
        depth += 1
        if depth > 4:
            raise BadImage(f"{label}: image indexes nested more than 4 deep")
        index_digest = entry.digest
        entry = pick_platform(parse_index(data, f"{label} index"), platform, label)
        data = src.read_bytes(_blob_name(entry.digest))
        _verify(data, entry, label)
    manifest = parse_manifest(data, f"{label} manifest")
    config = src.read_bytes(_blob_name(manifest.config.digest))
    _verify(config, manifest.config, label)
    layers: list[tuple[str, str | None, int, str | None]] = [
        (_blob_name(d.digest), d.digest, d.size, None) for d in manifest.layers]
    return _Found(ref, entry.digest, index_digest, config, layers)


def _verify(data: bytes, desc: Descriptor, label: str) -> None:
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    if got != desc.digest or len(data) != desc.size:
        raise BadImage(f"{label}: blob {desc.digest} is corrupt (hashes to {got})")


def _docker_save(src: _Source, tag: str | None, label: str) -> _Found:
    doc = src.read_json("manifest.json")
    if not isinstance(doc, list) or not doc or not all(isinstance(d, dict) for d in doc):
        raise BadImage(f"{label}: manifest.json is not a list of images")
    if tag is not None:
        items = [d for d in doc if any(t == tag or t.rsplit(":", 1)[-1] == tag for t in d.get("RepoTags") or [])]
        if not items:
            raise ImageNotFound(f"{label}: no image tagged {tag!r}")
    elif len(doc) > 1:
        raise BadImage(f"{label} holds {len(doc)} images: say which with --tag")
    else:
        items = doc
    item = items[0]
    cfg_name, layer_names = item.get("Config"), item.get("Layers")
    if not isinstance(cfg_name, str) or not isinstance(layer_names, list) \
            or not all(isinstance(n, str) for n in layer_names):
        raise BadImage(f"{label}: manifest.json entry without Config or Layers")
    cfg_name = os.path.normpath(cfg_name).removeprefix("./")
    config = src.read_bytes(cfg_name)
    digest = "sha256:" + hashlib.sha256(config).hexdigest()    # Docker's image ID
    tags = item.get("RepoTags") or []
    ref = tag if tag else (tags[0] if tags and isinstance(tags[0], str) else label)
    diff_ids = parse_config(config, f"{label} config").diff_ids
    if len(diff_ids) != len(layer_names):
        raise BadImage(f"{label}: {len(layer_names)} layers but {len(diff_ids)} diff_ids in the config")
    layers: list[tuple[str, str | None, int, str | None]] = []
    for n, d in zip(layer_names, diff_ids):
        member = os.path.normpath(n).removeprefix("./")
        layers.append((member, None, src.size(member) if src.has(member) else 0, d))
    return _Found(ref, digest, None, config, layers)


def load_archive(store: "Store", config: OciConfig, data_dir: Path, path: Path, *, tag: str | None = None,
                 platform: str = DEFAULT_PLATFORM, name: str | None = None, size: int | None = None,
                 replace: bool = False, progress: ProgressFactory = no_progress,
                 log_line: Callable[[str], None] | None = None, tools: ToolsTree | None = None) -> DiskImage:
    """The image in archive ``path`` as a block image (reused if its digest is already here
    with the same ``tools``: the guest tools installed into it, docs/tools.md)."""
    path = Path(path)
    label = path.name
    want = normalise_platform(platform)
    src = _Source(path)
    cache = LayerCache(config.cache_dir(data_dir), config.cache_capacity)
    try:
        if src.has("oci-layout") and src.has("index.json"):
            found = _oci_layout(src, tag, want, label)
        elif src.has("manifest.json"):
            found = _docker_save(src, tag, label)
        else:
            raise BadImage(f"{path}: neither an OCI image layout (oci-layout, index.json) nor a "
                           "`docker save` archive (manifest.json)")
        image_config = parse_config(found.config_bytes, f"{label} config")
        if image_config.platform != want and image_config.platform.rsplit("/", 1)[0] != want:
            raise BadImage(f"{label} is a {image_config.platform} image, not {want}")
        reconvert = False
        if not replace:
            rec = find_image(store, found.manifest_digest)
            if rec is not None and tools_current(rec, tools):
                return reuse(store, rec, name, replace)
            reconvert = rec is not None          # converted with other guest tools: again
            check_name_free(store, name, found.manifest_digest)
        config_digest = "sha256:" + hashlib.sha256(found.config_bytes).hexdigest()
        ident = ImageIdentity(found.reference, found.manifest_digest, image_config.platform, config_digest,
                              found.index_digest, source="archive")
        cache.prepare()
        files: list[LayerFile] = []
        with tempfile.TemporaryDirectory(dir=cache.root, prefix="load-") as td:
            for i, ((member, digest, lsize, _), diff_id) in enumerate(zip(found.layers, image_config.diff_ids)):
                lbl = f"layer {i + 1}/{len(found.layers)} of {label}"
                if digest is not None:
                    dest = cache.lookup(digest, lsize)
                    if dest is None:
                        dest = cache.path(digest)
                        src.copy_out(member, dest, digest, lsize)
                else:                        # docker save: no digest until copied; DiffID checked on apply
                    dest = Path(td) / f"layer{i}"
                    src.copy_out(member, dest, None, None)
                files.append(LayerFile(dest, lbl, diff_id, lsize or dest.stat().st_size))
            image = build_disk_image(store, config, files, ident, image_config, name, size, replace or reconvert,
                                     progress, log_line, tools)
        cache.prune({d for _, d, _, _ in found.layers if d is not None})
        return image
    finally:
        src.close()
