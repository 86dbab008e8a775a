"""What builds keep in the store's catalog (docs/templates.md has the table):

``tdef-<name>``   (kind ``template-def``) one E2B template: its name, owner (team), its tags
                  (tag → the build's template record), its builds, cpu/memory
``template.<name>`` alias → the build of its ``default`` tag (what ``find_template`` and
                  so every create resolves), ``ttag-<h>`` alias → the build of ``name:tag``
``tpl-<hex>``     (kind ``template``) one finished build: the frozen VM
``bstep-<key>``   (kind ``build-step``) the build cache: the disk layer after a step and
                  the state (envs, user, workdir) the next step starts with
``bsnap-<key>``   alias → the template a whole build made (an unchanged rebuild reuses it)
``bfiles-<hash>`` (kind ``build-files``) an uploaded COPY context (a tar blob)

Every record is a GC root: a cached step keeps its layer, an uploaded context its
blob. Records are written last, after their artifacts (the store's commit order),
so a crash leaves at worst unreferenced packs for ``aenv repo gc``.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import blake3

from aenv_store.errors import StoreNotFound
from aenv_store.formats.catalog import ALIAS, CatalogRecord
from aenv_store.formats.ids import Digest
from aenv_store.store import Store

from ..blockimage.layer import DISK_ROLE
from ..errors import BadRequest, NotFound
from ..templates.template import ALIAS_PREFIX, tag_alias_name
from .steps import StepState

DEF_KIND = "template-def"
STEP_KIND = "build-step"
FILES_KIND = "build-files"
FILES_MEDIA = "application/x-tar"
DEFAULT_TAG = "default"
RESERVED = ("tags", "aliases")
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}\Z")
TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def split_name(ref: str) -> tuple[str, str | None]:
    """``name`` or ``name:tag`` → (name, tag or None); BadRequest when malformed."""
    name, sep, tag = ref.partition(":")
    name = name.lower()
    if name in RESERVED:
        raise BadRequest(f"{name!r} is not a template name here (the API has a path of that name)")
    if not NAME_RE.match(name):
        raise BadRequest(f"template name {name!r}: use 1-128 of a-z 0-9 . _ - (starting with a letter or digit)")
    if sep and not TAG_RE.match(tag):
        raise BadRequest(f"template tag {tag!r}: use 1-64 of A-Z a-z 0-9 . _ -")
    return name, (tag if sep else None)


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_RE.match(tag):
        raise BadRequest(f"template tag {tag!r}: use 1-64 of A-Z a-z 0-9 . _ -")
    return tag


@dataclass(frozen=True)
class BuildEntry:
    build_id: str
    template: str | None        # the tpl-… record once it finished
    status: str                 # building | ready | error
    created: float
    finished: float | None = None
    cpu_count: int = 0
    memory_mb: int = 0
    disk_mb: int = 0
    envd_version: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"build_id": self.build_id, "template": self.template, "status": self.status,
                "created": self.created, "finished": self.finished, "cpu_count": self.cpu_count,
                "memory_mb": self.memory_mb, "disk_mb": self.disk_mb, "envd_version": self.envd_version}

    @classmethod
    def from_json(cls, obj: dict) -> "BuildEntry":
        return cls(str(obj["build_id"]), obj.get("template"), str(obj.get("status", "ready")),
                   float(obj.get("created", 0)), obj.get("finished"), int(obj.get("cpu_count", 0)),
                   int(obj.get("memory_mb", 0)), int(obj.get("disk_mb", 0)), obj.get("envd_version"))


@dataclass(frozen=True)
class TemplateDef:
    name: str
    created: float
    updated: float
    tags: dict[str, tuple[str, str, float]] = field(default_factory=dict)   # tag -> (build id, tpl id, when)
    builds: tuple[BuildEntry, ...] = ()
    public: bool = False
    # who owns the template, its tags and builds (the API's team id); "" the deployment's
    # default team, as for every template recorded before teams existed
    owner: str = ""

    def record(self) -> CatalogRecord:
        meta = {"name": self.name, "updated": repr(self.updated), "public": "1" if self.public else "0",
                "tags": json.dumps({t: list(v) for t, v in sorted(self.tags.items())}),
                "builds": json.dumps([b.to_json() for b in self.builds])}
        if self.owner:
            meta["owner"] = self.owner
        return CatalogRecord(name=def_name(self.name), kind=DEF_KIND, meta=tuple(sorted(meta.items())),
                             created=self.created)

    @classmethod
    def from_record(cls, rec: CatalogRecord) -> "TemplateDef":
        meta = rec.meta_dict()
        tags = {t: (str(v[0]), str(v[1]), float(v[2])) for t, v in json.loads(meta.get("tags", "{}")).items()}
        builds = tuple(BuildEntry.from_json(b) for b in json.loads(meta.get("builds", "[]")))
        return cls(meta["name"], rec.created, float(meta.get("updated", rec.created)), tags, builds,
                   meta.get("public") == "1", meta.get("owner", ""))

    def build(self, build_id: str) -> BuildEntry | None:
        return next((b for b in self.builds if b.build_id == build_id), None)

    def latest_ready(self) -> BuildEntry | None:
        ready = [b for b in self.builds if b.status == "ready" and b.template]
        return max(ready, key=lambda b: b.finished or b.created) if ready else None


def def_name(name: str) -> str:
    return "tdef-" + name


def load_def(store: Store, name: str) -> TemplateDef | None:
    try:
        return TemplateDef.from_record(store.get_record(def_name(name)))
    except StoreNotFound:
        return None


def list_defs(store: Store) -> list[TemplateDef]:
    return [TemplateDef.from_record(r) for r in store.list_records(DEF_KIND)]


def ready_builds(tdef: TemplateDef) -> dict[str, str]:
    """build id -> template record of every finished build: E2B resolves ``name:<build id>``
    as it does a tag (Harbor creates its sandboxes from the exact build a tag pointed at,
    so a later rebuild under the same tag cannot change a running job's template)."""
    return {b.build_id: b.template for b in tdef.builds if b.status == "ready" and b.template}


def has_build_names(store: Store, tdef: TemplateDef) -> bool:
    """Whether every ready build of ``tdef`` has its ``name:<build id>`` alias."""
    for build_id in ready_builds(tdef):
        try:
            store.get_record(tag_alias_name(tdef.name, build_id))
        except StoreNotFound:
            return False
    return True


def save_def(store: Store, tdef: TemplateDef) -> None:
    """The definition and the aliases creates resolve: ``template.<name>`` (default tag),
    one ``ttag-…`` per tag and one per ready build (``name:<build id>``); aliases of tags
    and builds that went are removed. A tag spelled like a build id wins (written after)."""
    old = load_def(store, tdef.name)
    now = time.time()
    builds = ready_builds(tdef)
    for build_id, tid in builds.items():
        store.put_record(CatalogRecord(name=tag_alias_name(tdef.name, build_id), kind=ALIAS, target=tid,
                                       created=now), exclusive=False)
    for tag, (_bid, tid, _when) in tdef.tags.items():
        store.put_record(CatalogRecord(name=tag_alias_name(tdef.name, tag), kind=ALIAS, target=tid, created=now),
                         exclusive=False)
        if tag == DEFAULT_TAG:
            store.put_record(CatalogRecord(name=ALIAS_PREFIX + tdef.name, kind=ALIAS, target=tid, created=now),
                             exclusive=False)
    store.put_record(tdef.record(), exclusive=False)
    for tag in (old.tags if old else {}):
        if tag not in tdef.tags and tag not in builds:
            _delete_quietly(store, tag_alias_name(tdef.name, tag))
            if tag == DEFAULT_TAG:
                _delete_quietly(store, ALIAS_PREFIX + tdef.name)
    for build_id in (ready_builds(old) if old else {}):
        if build_id not in builds and build_id not in tdef.tags:
            _delete_quietly(store, tag_alias_name(tdef.name, build_id))


def delete_def(store: Store, tdef: TemplateDef) -> None:
    for tag in (*tdef.tags, *ready_builds(tdef)):
        _delete_quietly(store, tag_alias_name(tdef.name, tag))
    _delete_quietly(store, ALIAS_PREFIX + tdef.name)
    _delete_quietly(store, def_name(tdef.name))


def _delete_quietly(store: Store, name: str) -> None:
    try:
        store.delete_record(name)
    except StoreNotFound:
        pass


# ---------------------------------------------------------------- build cache

def cache_key(parent: str, identity: dict[str, object]) -> str:
    """The key of a step: its parent's key and what the step is (type, args, files)."""
    h = blake3.blake3(parent.encode() + b"\0" + json.dumps(identity, sort_keys=True).encode())
    return h.hexdigest()[:48]


@dataclass(frozen=True)
class CachedStep:
    layer: Digest
    state: StepState


def find_step(store: Store, key: str) -> CachedStep | None:
    try:
        rec = store.get_record("bstep-" + key)
        return CachedStep(rec.manifest(DISK_ROLE), StepState.from_json(rec.meta_dict()["state"]))
    except (StoreNotFound, KeyError, ValueError):
        return None


def put_step(store: Store, key: str, layer: Digest, state: StepState, what: str) -> None:
    store.put_record(CatalogRecord(name="bstep-" + key, kind=STEP_KIND, manifests=((DISK_ROLE, layer),),
                                   meta=(("state", state.to_json()), ("step", what[:500])),
                                   created=time.time()), exclusive=False)


def find_snapshot(store: Store, key: str) -> str | None:
    """The template an identical earlier build made (None: none, or it was deleted)."""
    try:
        return store.resolve("bsnap-" + key).name
    except (StoreNotFound, ValueError):
        return None


def put_snapshot(store: Store, key: str, tid: str) -> None:
    store.put_record(CatalogRecord(name="bsnap-" + key, kind=ALIAS, target=tid, created=time.time()),
                     exclusive=False)


# ---------------------------------------------------------------- COPY contexts

def files_name(files_hash: str) -> str:
    return "bfiles-" + files_hash


def has_files(store: Store, files_hash: str) -> bool:
    try:
        store.get_record(files_name(files_hash))
        return True
    except StoreNotFound:
        return False


def put_files(store: Store, files_hash: str, path: Path) -> None:
    """Commit the uploaded tar at ``path`` as the context of ``files_hash``."""
    size = path.stat().st_size
    with store.workspace() as ws:
        writer = ws.blob_writer(FILES_MEDIA, size=size, meta={"files_hash": files_hash})
        with open(path, "rb") as f:
            off = 0
            while True:
                data = f.read(writer.chunk_size)
                if not data:
                    break
                writer.write(off, data)
                off += len(data)
        blob = writer.close()
        ws.commit(CatalogRecord(name=files_name(files_hash), kind=FILES_KIND, manifests=(("files", blob),),
                                meta=(("files_hash", files_hash),), created=time.time()), exclusive=False)


def open_files(store: Store, files_hash: str) -> tuple[Callable[[int, int], bytes], int]:
    """``(read(offset, n), size)`` of the stored context: read a piece at a time, never
    whole (a context may be gigabytes)."""
    try:
        rec = store.get_record(files_name(files_hash))
    except StoreNotFound:
        raise NotFound(f"the files of hash {files_hash} were never uploaded") from None
    reader = store.open_blob(rec.manifest("files"))
    return reader.read, reader.size


def delete_files(store: Store, files_hash: str) -> None:
    """Forget the context of ``files_hash`` (its data goes at the next gc)."""
    try:
        store.delete_record(files_name(files_hash))
    except StoreNotFound:
        pass


def list_files(store: Store) -> list[tuple[str, float]]:
    """(files hash, created) of every stored context."""
    return [(r.meta_dict().get("files_hash", r.name.removeprefix("bfiles-")), r.created)
            for r in store.list_records(FILES_KIND)]
