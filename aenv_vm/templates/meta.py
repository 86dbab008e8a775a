"""The meta of a template record, typed: every key a template (or snapshot) record
carries, read and written only through ``TemplateMeta`` (docs/templates.md has the
table of keys: type, writer, readers, meaning).

A record's meta is a string map in the store (``CatalogRecord.meta``).
``TemplateMeta.from_meta`` parses it: the machine keys every restore needs are
required (``MetaError`` names a missing or malformed one); every other key is
optional (None: the record does not have it; the readers' defaults are the
properties of ``Template``); keys this version does not know are kept in
``extra`` and written back unchanged, so a record written by a newer aenv loads
and a snapshot of it keeps them. ``to_meta`` writes exactly the keys that are set,
in their canonical text (``str(int)``, ``json.dumps``), so a record read and
written again is byte-for-byte the record it was.

Who writes which keys: the base template (templates/base.py: the machine keys and
``base_layer``, ``host_ca``), a template build (builds/: the machine keys and the
``build`` keys), a snapshot (sandboxes/snapshots.py: its parent's meta with the
``snapshot`` keys set). All three commit through templates/freeze.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, get_args

from aenv_store.formats.ids import Digest

from ..qemu.launcher import Accel

HIDDEN_FORK = "fork"    # ``hidden`` of a fork's snapshot: not listed, dropped with its last child
# ``hidden`` of a paused sandbox's pause named as a snapshot (a batch from its id): not
# listed, dropped once the batch is made and its last sandbox is gone
HIDDEN_PAUSE = "pause"
HIDDEN_KINDS = (HIDDEN_FORK, HIDDEN_PAUSE)   # a node's hidden snapshots (``fork_node`` made it)


class MetaError(ValueError):
    """A template record's meta lacks a required key or has a malformed value."""


@dataclass(frozen=True)
class TemplateMeta:
    # -- the machine: what every clone must be (required) -------------------------------
    memory_mib: int
    vcpus: int
    accel: Accel
    guest_key: str                  # the guest build (kernel, initramfs, envd) the memory image holds
    kernel_cmdline: str             # the booted kernel's command line (a cold boot boots it again)
    # -- the machine: optional --------------------------------------------------------
    kernel_release: str | None = None   # `uname -r` of the guest kernel (informational)
    disk_mib: int | None = None         # root disk size (None: a record from before sizes were recorded)
    base_layer: Digest | None = None    # the base template's boot layer (the guest image's or a given one)
    envd_version: str | None = None     # what the guest's envd reported at build
    envd_token: str | None = None       # the access token the frozen envd demands (restores re-key with it)
    host_ca: str | None = None          # fingerprint of the host CA certificates the guest trusts
    # -- a template build (builds/executor.py) ------------------------------------------
    build_state: str | None = None      # JSON of the build's last StepState: {"envs", "user", "workdir"}
    build_id: str | None = None
    e2b_template: str | None = None     # the E2B template name the build was for
    default_user: str | None = None
    start_cmd: str | None = None
    ready_cmd: str | None = None
    start_user: str | None = None       # who the start command runs as (None: the build state's user)
    start_workdir: str | None = None    # where (None: the build state's workdir)
    # -- a snapshot (sandboxes/snapshots.py) --------------------------------------------
    snapshot_of: str | None = None      # the sandbox it was taken of
    parent_template: str | None = None  # the template (or snapshot) that sandbox ran
    hidden: str | None = None           # HIDDEN_FORK: a fork's snapshot; HIDDEN_PAUSE: a pause's
    fork_node: str | None = None        # the node that made a hidden snapshot ("": before nodes were named)
    metadata: tuple[tuple[str, str], ...] | None = None   # the sandbox's metadata, sorted by key
    volume_paths: tuple[str, ...] | None = None           # volumes mounted in the frozen guest
    # the API team that owns a named snapshot: on the record, so every node sharing the
    # repository knows it (None: a hidden snapshot, or one recorded before teams travelled)
    team: str | None = None
    # what the snapshot takes on its own (sandboxes/snapshots.py ``own_bytes``; a team's
    # snapshotBytes quota sums them): None before snapshots carried it
    snapshot_bytes: int | None = None
    # -- keys this version does not know, kept as they are (sorted) ---------------------
    extra: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_meta(cls, meta: Mapping[str, str]) -> "TemplateMeta":
        """Parse a record's meta (MetaError: a required key missing, a value malformed)."""
        rest = dict(meta)
        values: dict[str, object] = {}
        for name in _KNOWN:
            if name not in rest:
                if name in _REQUIRED:
                    raise MetaError(f"missing {name!r}")
                continue
            text = rest.pop(name)
            try:
                values[name] = _PARSE.get(name, _text)(text)
            except (ValueError, TypeError) as e:
                raise MetaError(f"{name!r} is malformed ({text[:80]!r}): {e}") from None
        if values["accel"] not in get_args(Accel):
            raise MetaError(f"'accel' must be one of {', '.join(get_args(Accel))}, got {values['accel']!r}")
        return cls(**values, extra=tuple(sorted(rest.items())))  # type: ignore[arg-type]  # parsed per field above

    def to_meta(self) -> dict[str, str]:
        """The record's meta: every key that is set, in its canonical text."""
        out = dict(self.extra)
        for name in _KNOWN:
            value = getattr(self, name)
            if value is not None:
                out[name] = _FORMAT.get(name, str)(value)
        return out


@dataclass(frozen=True)
class GuestSettings:
    """What a template's build told its envd (env vars, default user and workdir) and its
    start command: what a guest booted cold from the template's disk is told again."""
    env_vars: dict[str, str]
    user: str | None
    workdir: str | None
    start_cmd: str | None
    start_user: str | None = None       # the start command's own user and workdir (an image's start)
    start_workdir: str | None = None

    @classmethod
    def of(cls, meta: TemplateMeta) -> "GuestSettings | None":
        """The settings ``meta`` records (None: it records none: not a build, or a record
        written before snapshots carried them; templates/template.py then asks its parent)."""
        if meta.build_state is None and meta.start_cmd is None:
            return None
        state = json.loads(meta.build_state) if meta.build_state is not None else {}
        return cls({str(k): str(v) for k, v in state.get("envs", {}).items()}, state.get("user"),
                   state.get("workdir"), meta.start_cmd, meta.start_user, meta.start_workdir)


NO_SETTINGS = GuestSettings({}, None, None, None)


def _text(text: str) -> str:
    return text


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return tuple(sorted((str(k), str(v)) for k, v in obj.items()))


def _paths(text: str) -> tuple[str, ...]:
    obj = json.loads(text)
    if not isinstance(obj, list):
        raise ValueError("not a JSON list")
    return tuple(str(p) for p in obj)


_KNOWN = tuple(f.name for f in fields(TemplateMeta) if f.name != "extra")
_REQUIRED = frozenset(("memory_mib", "vcpus", "accel", "guest_key", "kernel_cmdline"))
# the keys whose value is not plain text (the rest: ``str`` both ways); a formatter takes
# what its parser made (Any: the value types differ per key)
_PARSE: dict[str, Callable[[str], object]] = {
    "memory_mib": int, "vcpus": int, "disk_mib": int, "base_layer": Digest.from_hex, "metadata": _pairs,
    "volume_paths": _paths, "snapshot_bytes": int}
_FORMAT: dict[str, Callable[[Any], str]] = {
    "base_layer": lambda d: d.hex(), "metadata": lambda pairs: json.dumps(dict(pairs), sort_keys=True),
    "volume_paths": lambda paths: json.dumps(list(paths))}
