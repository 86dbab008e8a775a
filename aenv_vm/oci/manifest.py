"""Image manifests, indexes and configs (OCI image spec, Docker schema 2): parsed
into typed records with every field a pull relies on checked, and the pick of
one platform's manifest from an index / manifest list."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import BadImage, PlatformNotFound
from .reference import check_digest

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
# the parts of an image config a template build uses (OCI: config.*)
RUNTIME_KEYS = ("Env", "Entrypoint", "Cmd", "WorkingDir", "User", "ExposedPorts", "StopSignal", "Labels")
DEFAULT_PLATFORM = "linux/amd64"


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: str | None = None          # "os/arch[/variant]" in an index

    @classmethod
    def parse(cls, doc: Any, what: str) -> "Descriptor":
        if not isinstance(doc, dict):
            raise BadImage(f"{what}: descriptor is not an object")
        digest, size = doc.get("digest"), doc.get("size")
        if not isinstance(digest, str):
            raise BadImage(f"{what}: descriptor without a digest")
        check_digest(digest, f"{what} digest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadImage(f"{what}: descriptor {digest} has no valid size")
        plat = doc.get("platform")
        platform = None
        if isinstance(plat, dict) and isinstance(plat.get("os"), str) and isinstance(plat.get("architecture"), str):
            platform = f"{plat['os']}/{plat['architecture']}"
            if isinstance(plat.get("variant"), str) and plat["variant"]:
                platform += f"/{plat['variant']}"
        return cls(str(doc.get("mediaType", "")), digest, size, platform)


@dataclass(frozen=True)
class ImageManifest:
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageConfig:
    platform: str
    diff_ids: tuple[str, ...]
    runtime: dict[str, Any]              # Env, Entrypoint, Cmd, WorkingDir, User, ExposedPorts, ...

    def runtime_json(self) -> str:
        return json.dumps(self.runtime, sort_keys=True, separators=(",", ":"))


def _load(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise BadImage(f"{what} is not JSON") from None
    if not isinstance(doc, dict):
        raise BadImage(f"{what} is not a JSON object")
    return doc


def is_index(media_type: str, data: bytes) -> bool:
    if media_type in INDEX_TYPES:
        return True
    if media_type in MANIFEST_TYPES:
        return False
    # no or unknown media type (OCI allows its omission): an index has "manifests"
    return "manifests" in _load(data, "manifest")


def parse_index(data: bytes, what: str = "image index") -> list[Descriptor]:
    doc = _load(data, what)
    items = doc.get("manifests")
    if not isinstance(items, list):
        raise BadImage(f"{what} has no manifests list")
    return [Descriptor.parse(d, f"{what} entry") for d in items]


def normalise_platform(text: str) -> str:
    """``linux/amd64``; ``amd64`` alone means linux; ``x86_64`` is amd64."""
    parts = text.strip().lower().split("/")
    if len(parts) == 1 and parts[0] not in ("linux", "windows", "darwin", "freebsd", ""):
        parts = ["linux"] + parts
    if len(parts) not in (2, 3) or not all(parts):
        raise BadImage(f"bad platform {text!r} (expected OS/ARCH[/VARIANT], e.g. linux/amd64)")
    if parts[0] != "linux":
        raise BadImage(f"bad platform {text!r}: sandboxes run Linux, so only linux/… images can be used")
    parts[1] = {"x86_64": "amd64", "aarch64": "arm64"}.get(parts[1], parts[1])
    return "/".join(parts)


def pick_platform(entries: list[Descriptor], platform: str, what: str) -> Descriptor:
    """The entry for ``platform`` (a variant-less request matches any variant; amd64
    has none that matter). Attestation manifests (platform unknown/unknown) never match."""
    want = normalise_platform(platform)
    exact = [e for e in entries if e.platform == want and e.media_type not in INDEX_TYPES]
    loose = [e for e in entries if e.platform and e.platform.rsplit("/", 1)[0] == want
             and e.platform.count("/") == 2]
    found = exact or (loose if want.count("/") == 1 else [])
    if not found:
        have = sorted({e.platform for e in entries if e.platform and not e.platform.startswith("unknown")})
        raise PlatformNotFound(f"{what} has no {want} image (it has: {', '.join(have) or 'no platforms'})")
    return found[0]


def parse_manifest(data: bytes, what: str = "image manifest") -> ImageManifest:
    doc = _load(data, what)
    if doc.get("schemaVersion") != 2:
        raise BadImage(f"{what}: schemaVersion {doc.get('schemaVersion')!r} is not supported (only 2)")
    if "config" not in doc or not isinstance(doc.get("layers"), list):
        raise BadImage(f"{what} has no config or layers")
    config = Descriptor.parse(doc["config"], f"{what} config")
    layers = tuple(Descriptor.parse(d, f"{what} layer") for d in doc["layers"])
    for layer in layers:
        if "foreign" in layer.media_type or "nondistributable" in layer.media_type:
            raise BadImage(f"{what}: layer {layer.digest} is a foreign (non-distributable) layer: not supported")
    return ImageManifest(config, layers)


def parse_config(data: bytes, what: str = "image config") -> ImageConfig:
    doc = _load(data, what)
    os_, arch = doc.get("os"), doc.get("architecture")
    platform = f"{os_}/{arch}" if isinstance(os_, str) and isinstance(arch, str) else "unknown"
    if isinstance(doc.get("variant"), str) and doc["variant"]:
        platform += f"/{doc['variant']}"
    rootfs = doc.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) for d in diff_ids):
        raise BadImage(f"{what} has no rootfs.diff_ids")
    for d in diff_ids:
        check_digest(d, f"{what} diff_id")
    raw = doc.get("config")
    cfg: dict[str, Any] = raw if isinstance(raw, dict) else {}
    runtime = {k: cfg[k] for k in RUNTIME_KEYS if cfg.get(k) not in (None, "", [], {})}
    return ImageConfig(platform, tuple(diff_ids), runtime)
