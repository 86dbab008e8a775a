"""E2B's template build request as typed records: ``TemplateBuildStartV2`` (the base,
the SDK's step list, the start and ready commands) checked into a ``BuildSpec``, and
the VM a build asks for (``BuildResources``, from ``TemplateBuildRequestV3``).

The SDK turns every builder call into one of five step types: RUN (``args = [cmd,
user?]``; ``apt_install``, ``pip_install``, ``npm_install``, ``git_clone``,
``make_dir``, ``make_symlink``, ``remove`` and ``rename`` are RUNs of the commands
they spell), COPY (``[src, dest, user?, mode?]`` plus ``filesHash``: the tar it
uploaded), ENV (``[k, v, k, v, …]``), WORKDIR (``[path]``) and USER (``[name]``).
Anything else, or a step of the wrong shape, is ``MalformedBuild`` naming the step;
``parse_build_spec`` raises nothing else, whatever JSON it is given. What the steps do
in a build VM is aenv_vm/builds' (steps.py threads their state, executor.py runs them).
"""
from __future__ import annotations

import enum
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from .errors import MalformedBuild


class StepKind(enum.StrEnum):
    RUN = "RUN"
    COPY = "COPY"
    ENV = "ENV"
    WORKDIR = "WORKDIR"
    USER = "USER"


MAX_STEPS = 200                 # each disk-changing step is a layer; the image stack holds 255
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\Z|[0-9]{1,10}\Z")
_USER_GROUP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?\Z")
_FILES_HASH = re.compile(r"[A-Za-z0-9_-]{8,128}\Z")
_MODE = re.compile(r"0?[0-7]{3,4}\Z")


@dataclass(frozen=True)
class Step:
    index: int                          # 1-based, as the SDK counts them in "step N"
    kind: StepKind
    args: tuple[str, ...]
    force: bool = False
    files_hash: str | None = None       # COPY: the uploaded context's hash

    @property
    def label(self) -> str:
        """The step's name in logs and failure reasons: its number, as the SDK maps it
        back to the builder call that made it (``base`` and ``finalize`` are the others)."""
        return str(self.index)

    def describe(self) -> str:
        if self.kind == StepKind.RUN:
            return f"RUN {self.args[0]}" + (f" (as {self.args[1]})" if len(self.args) > 1 and self.args[1] else "")
        if self.kind == StepKind.ENV:
            return "ENV " + " ".join(f"{k}={v}" for k, v in zip(self.args[::2], self.args[1::2]))
        return f"{self.kind.value} {' '.join(a for a in self.args if a)}"

    def identity(self) -> dict[str, Any]:
        """The step as the SDK sent it (type, args, files hash): what a build cache key covers."""
        return {"type": self.kind.value, "args": list(self.args), "filesHash": self.files_hash}

    @property
    def changes_disk(self) -> bool:
        """RUN and COPY change files; WORKDIR creates its directory. ENV and USER only
        change what later steps run with."""
        return self.kind in (StepKind.RUN, StepKind.COPY, StepKind.WORKDIR)


@dataclass(frozen=True)
class Registry:
    """``fromImageRegistry`` of type ``registry``: credentials of a private registry."""
    username: str
    password: str

    def __repr__(self) -> str:     # never print a password
        return f"Registry(username={self.username!r}, password=***)"


@dataclass(frozen=True)
class StartCommand:
    """``startCmd``, left running in every sandbox of the template, and ``readyCmd``,
    polled until it exits 0 before the template is frozen. A ready command alone
    (``cmd`` None) checks what the base starts: aenv_vm/builds/start.py."""
    cmd: str | None
    ready_cmd: str | None = None


@dataclass(frozen=True)
class BuildSpec:
    from_image: str | None              # exactly one of from_image and from_template
    from_template: str | None
    registry: Registry | None           # with from_image only
    steps: tuple[Step, ...]
    start: StartCommand | None = None
    force: bool = False                 # the SDK's skip_cache: no cache hit from the first step on

    @property
    def base(self) -> str:
        return f"template {self.from_template}" if self.from_template else f"image {self.from_image}"


@dataclass(frozen=True)
class BuildResources:
    """The build VM a request asks for (``cpuCount``, ``memoryMB``, ``minFreeDiskMb`` of
    ``TemplateBuildRequestV3``); None: the node's default. The node checks them against
    its own limits."""
    cpu_count: int | None = None
    memory_mb: int | None = None
    min_free_disk_mb: int | None = None


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise MalformedBuild(f"{where}: args must be a list of strings")
    if any("\0" in a for a in value):
        raise MalformedBuild(f"{where}: args must not contain NUL bytes")
    return tuple(value)


def parse_step(index: int, raw: Any) -> Step:
    """Step ``index`` (1-based) of a step list; MalformedBuild naming it if malformed."""
    where = f"step {index}"
    if not isinstance(raw, dict):
        raise MalformedBuild(f"{where}: a step is an object with type and args")
    kind_name = raw.get("type")
    known = ", ".join(k.value for k in StepKind)
    if not isinstance(kind_name, str) or kind_name.upper() not in StepKind.__members__:
        raise MalformedBuild(f"{where}: unknown step type {kind_name!r} (known: {known})")
    kind = StepKind(kind_name.upper())
    args = _strings(raw.get("args", []), where)
    force = raw.get("force") or False
    if not isinstance(force, bool):
        raise MalformedBuild(f"{where}: force must be a boolean")
    files_hash = raw.get("filesHash")
    if kind == StepKind.RUN:
        if not 1 <= len(args) <= 2 or not args[0].strip():
            raise MalformedBuild(f"{where}: RUN takes [command, user?]")
        if len(args) == 2 and args[1] and not _USER.match(args[1]):
            raise MalformedBuild(f"{where}: bad user name {args[1]!r}")
    elif kind == StepKind.COPY:
        if not 2 <= len(args) <= 4 or not args[0] or not args[1]:
            raise MalformedBuild(f"{where}: COPY takes [src, dest, user?, mode?]")
        if len(args) > 2 and args[2] and not _USER_GROUP.match(args[2]):    # Docker's --chown=user[:group]
            raise MalformedBuild(f"{where}: bad owner {args[2]!r} (user or user:group)")
        if len(args) > 3 and args[3] and not _MODE.match(args[3]):
            raise MalformedBuild(f"{where}: COPY mode must be octal, got {args[3]!r}")
        if not isinstance(files_hash, str) or not _FILES_HASH.match(files_hash):
            raise MalformedBuild(f"{where}: COPY needs the filesHash of its uploaded files")
        src = posixpath.normpath(args[0])
        if src.startswith("/") or src == ".." or src.startswith("../"):
            raise MalformedBuild(f"{where}: COPY source {args[0]!r} is outside the build context")
    elif kind == StepKind.ENV:
        if not args or len(args) % 2:
            raise MalformedBuild(f"{where}: ENV takes [name, value, name, value, ...]")
        for name in args[::2]:
            if not _ENV_NAME.match(name):
                raise MalformedBuild(f"{where}: bad environment variable name {name!r}")
    elif kind == StepKind.WORKDIR:
        if len(args) != 1 or not args[0]:
            raise MalformedBuild(f"{where}: WORKDIR takes [path]")
    elif kind == StepKind.USER:
        if len(args) != 1 or not _USER_GROUP.match(args[0]):
            raise MalformedBuild(f"{where}: USER takes [name] or [name:group]")
    return Step(index, kind, args, force, files_hash if kind == StepKind.COPY else None)


def parse_build_spec(body: Any) -> BuildSpec:
    """``TemplateBuildStartV2`` (a JSON object; absent and null fields alike) →
    ``BuildSpec``; MalformedBuild on anything malformed."""
    if not isinstance(body, dict):
        raise MalformedBuild("a build request is a JSON object")
    from_image, from_template = body.get("fromImage"), body.get("fromTemplate")
    start_cmd, ready_cmd = body.get("startCmd"), body.get("readyCmd")
    for name, value in (("fromImage", from_image), ("fromTemplate", from_template), ("startCmd", start_cmd),
                        ("readyCmd", ready_cmd)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise MalformedBuild(f"{name} must be a non-empty string")
    if bool(from_image) == bool(from_template):
        raise MalformedBuild("give exactly one of fromImage and fromTemplate")
    registry = None
    reg = body.get("fromImageRegistry")
    if reg is not None:
        if not isinstance(reg, dict):
            raise MalformedBuild("fromImageRegistry must be an object")
        if reg.get("type") != "registry":
            raise MalformedBuild(f"fromImageRegistry type {reg.get('type')!r} is not supported here (only "
                                 f"'registry': username and password; AWS and GCP registries need their cloud's "
                                 f"token service)")
        user, password = reg.get("username"), reg.get("password")
        if not isinstance(user, str) or not isinstance(password, str):
            raise MalformedBuild("fromImageRegistry needs username and password strings")
        if from_template:
            raise MalformedBuild("fromImageRegistry goes with fromImage, not fromTemplate")
        registry = Registry(user, password)
    raw_steps = body.get("steps") or []
    if not isinstance(raw_steps, list):
        raise MalformedBuild("steps must be a list")
    if len(raw_steps) > MAX_STEPS:
        raise MalformedBuild(f"a build has at most {MAX_STEPS} steps, got {len(raw_steps)}")
    steps = tuple(parse_step(i + 1, s) for i, s in enumerate(raw_steps))
    force = body.get("force") or False
    if not isinstance(force, bool):
        raise MalformedBuild("force must be a boolean")
    start = StartCommand(start_cmd, ready_cmd) if (start_cmd or ready_cmd) else None
    return BuildSpec(from_image, from_template, registry, steps, start, force)
