"""``aenv image pull``: reference → manifest (an index picked for the platform) →
config → layers (from the node's layer cache, else downloaded and verified) →
flattened rootfs → ext4 block image in the store → catalog record.

An image already in the catalog (same manifest digest) is reused: a second pull
of a tag fetches its manifest (a few KiB) and nothing else; a pull by digest of
an image the node has needs no registry at all.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from aenv_store.admin.progress import ProgressFactory, human_bytes, no_progress

from .auth import Credentials, credentials_from_file
from .cache import LayerCache
from .config import OciConfig
from .disk import (DiskImage, ImageIdentity, LayerFile, build_disk_image, check_name_free, find_image, reuse,
                   tools_current)
from .errors import BadImage, PlatformNotFound
from .manifest import (DEFAULT_PLATFORM, ImageConfig, ImageManifest, is_index, normalise_platform,
                       parse_config, parse_index, parse_manifest, pick_platform)
from ..tools import ToolsTree
from .reference import Reference, parse_reference
from .registry import RegistryClient

if TYPE_CHECKING:
    from aenv_store.store import Store


@dataclass(frozen=True)
class PullResult:
    image: DiskImage
    reference: str
    digest: str
    layers: int
    downloaded_bytes: int        # layer and config bytes fetched from a registry by this pull
    cached_layers: int           # layers found in the node's layer cache
    seconds: float


@dataclass
class _Resolved:
    ident: ImageIdentity
    manifest: ImageManifest | None = None
    config: ImageConfig | None = None
    existing: DiskImage | None = None
    layer_files: list[LayerFile] | None = None
    downloaded: int = 0
    cached: int = 0


def _check_platform(config: ImageConfig, platform: str, what: str) -> None:
    if config.platform != platform and config.platform.rsplit("/", 1)[0] != platform:
        raise PlatformNotFound(f"{what} is a {config.platform} image, not {platform}")


class Puller:
    """One pull; ``run()`` does it. Kept as an object so the template builder can
    drive the same steps with its own progress and logging."""

    def __init__(self, store: "Store", config: OciConfig, data_dir: Path, reference: str, *,
                 credentials: Credentials | None = None, platform: str = DEFAULT_PLATFORM,
                 name: str | None = None, size: int | None = None, replace: bool = False,
                 progress: ProgressFactory = no_progress,
                 log_line: Callable[[str], None] | None = None, tools: ToolsTree | None = None) -> None:
        """``tools``: the guest tools installed into the image (docs/tools.md); an image
        already here but converted with other tools is converted again."""
        self.store = store
        self.tools = tools
        self.reconvert = False
        self.config = config
        self.ref: Reference = parse_reference(reference)
        self.platform = normalise_platform(platform)
        self.name = name
        self.size = size
        self.replace = replace
        self.progress = progress
        self.say = log_line or (lambda _t: None)
        self.cache = LayerCache(config.cache_dir(data_dir), config.cache_capacity)
        if credentials is None and config.auth_file:
            credentials = credentials_from_file(Path(config.auth_file), self.ref.registry)
        self.credentials = credentials

    def run(self) -> PullResult:
        """The pull, from synchronous code (not from inside an event loop)."""
        t0 = time.perf_counter()
        early = self._already_here(t0)
        if early is not None:
            return early
        self.cache.prepare()
        return self._finish(asyncio.run(self._fetch()), t0)

    async def run_async(self) -> PullResult:
        """The pull from async code: the registry part on the loop, flattening and the
        import (CPU and disk work) on a worker thread."""
        t0 = time.perf_counter()
        early = self._already_here(t0)
        if early is not None:
            return early
        self.cache.prepare()
        resolved = await self._fetch()
        return await asyncio.to_thread(self._finish, resolved, t0)

    def _already_here(self, t0: float) -> PullResult | None:
        """A pull by digest of an image the node has needs no registry at all."""
        if self.ref.digest is None or self.replace:
            return None
        rec = find_image(self.store, self.ref.digest, self.platform)
        if rec is None or not tools_current(rec, self.tools):
            return None
        img = reuse(self.store, rec, self.name, self.replace)
        self.say(f"{self.ref.familiar()}: already pulled as image {rec.name}")
        return PullResult(img, str(self.ref), img.meta.get("oci.digest", self.ref.digest),
                          int(img.meta.get("oci.layers", "0")), 0, 0, time.perf_counter() - t0)

    def _finish(self, resolved: _Resolved, t0: float) -> PullResult:
        """Flatten and import (unless the image is already here), prune the layer cache."""
        if resolved.existing is not None:
            img = resolved.existing
        else:
            assert resolved.layer_files is not None and resolved.config is not None
            img = build_disk_image(self.store, self.config, resolved.layer_files, resolved.ident, resolved.config,
                                   self.name, self.size, self.replace or self.reconvert, self.progress, self.say,
                                   self.tools)
        if resolved.layer_files and resolved.manifest is not None:
            self.cache.prune({d.digest for d in resolved.manifest.layers})
        layers = len(resolved.manifest.layers) if resolved.manifest else int(img.meta.get("oci.layers", "0"))
        return PullResult(img, str(self.ref), resolved.ident.digest, layers, resolved.downloaded, resolved.cached,
                          time.perf_counter() - t0)

    async def _fetch(self) -> _Resolved:
        async with RegistryClient(self.ref, self.config, self.credentials, self.say) as client:
            top = await client.manifest(self.ref.target)
            index_digest = None
            fetched = top
            what = self.ref.familiar()
            if is_index(top.media_type, top.data):
                index_digest = top.digest
                entry = pick_platform(parse_index(top.data, f"image index of {what}"), self.platform, what)
                fetched = await client.manifest(entry.digest)
                if is_index(fetched.media_type, fetched.data):
                    raise BadImage(f"{what}: the {self.platform} entry of its index is another index")
            manifest = parse_manifest(fetched.data, f"manifest of {what}")
            ident = ImageIdentity(str(self.ref), fetched.digest, self.platform, manifest.config.digest, index_digest)
            if not self.replace:
                rec = find_image(self.store, fetched.digest)
                if rec is not None and tools_current(rec, self.tools):
                    self.say(f"{what}: {fetched.digest} already pulled as image {rec.name}")
                    return _Resolved(ident, manifest, existing=reuse(self.store, rec, self.name, self.replace))
                if rec is not None:
                    self.say(f"{what}: image {rec.name} has other guest tools; converting it again")
                    self.reconvert = True
                check_name_free(self.store, self.name, fetched.digest)
            config_bytes = await client.blob_bytes(manifest.config.digest, manifest.config.size)
            config = parse_config(config_bytes, f"config of {what}")
            _check_platform(config, self.platform, what)
            ident = ImageIdentity(str(self.ref), fetched.digest, config.platform, manifest.config.digest,
                                  index_digest)
            if len(config.diff_ids) != len(manifest.layers):
                raise BadImage(f"{what}: {len(manifest.layers)} layers but {len(config.diff_ids)} diff_ids")
            out = _Resolved(ident, manifest, config, downloaded=len(config_bytes))
            out.layer_files = await self._layers(client, manifest, config, out)
            return out

    async def _layers(self, client: RegistryClient, manifest: ImageManifest, config: ImageConfig,
                      out: _Resolved) -> list[LayerFile]:
        files: list[LayerFile] = []
        missing = []
        for i, (desc, diff_id) in enumerate(zip(manifest.layers, config.diff_ids)):
            files.append(LayerFile(self.cache.path(desc.digest), f"layer {i + 1}/{len(manifest.layers)} "
                                   f"{desc.digest}", diff_id, desc.size))
            if self.cache.lookup(desc.digest, desc.size) is None:
                missing.append(desc)
        out.cached = len(files) - len({d.digest for d in missing})
        unique = list({d.digest: d for d in missing}.values())
        total = sum(d.size for d in unique)
        if not unique:
            self.say(f"all {len(files)} layer(s) in the node's layer cache")
            return files
        self.say(f"downloading {len(unique)} of {len(files)} layer(s) ({human_bytes(total)})")
        gate = asyncio.Semaphore(self.config.parallel_downloads)
        with self.progress(f"pull {self.ref.familiar()}", total, "bytes") as bar:
            async def one(desc_digest: str, size: int) -> None:
                async with gate:
                    await client.blob_to_file(desc_digest, size, self.cache.path(desc_digest), bar.advance)
                    self.say(f"layer {desc_digest[:19]} done ({human_bytes(size)})")

            tasks = [asyncio.ensure_future(one(d.digest, d.size)) for d in unique]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        out.downloaded += total
        return files


def pull_image(store: "Store", config: OciConfig, data_dir: Path, reference: str, *,
               credentials: Credentials | None = None, platform: str = DEFAULT_PLATFORM, name: str | None = None,
               size: int | None = None, replace: bool = False, progress: ProgressFactory = no_progress,
               log_line: Callable[[str], None] | None = None, tools: ToolsTree | None = None) -> PullResult:
    """Pull ``reference`` into the store (the keyword arguments are ``Puller``'s)."""
    return Puller(store, config, data_dir, reference, credentials=credentials, platform=platform, name=name,
                  size=size, replace=replace, progress=progress, log_line=log_line, tools=tools).run()
