"""What a build is asked to do, checked: the SDK's step list (``TemplateBuildStartV2``)
as typed records, and the state the steps thread through (envs, user, workdir).

The SDK turns every builder call into one of five step types: RUN (``args = [cmd,
user?]``; ``apt_install``, ``pip_install``, ``npm_install``, ``git_clone``,
``make_dir``, ``make_symlink``, ``remove`` and ``rename`` are RUNs of the commands
they spell), COPY (``[src, dest, user?, mode?]`` plus ``filesHash``: the tar it
uploaded), ENV (``[k, v, k, v, …]``), WORKDIR (``[path]``) and USER (``[name]``).
Anything else, or a step of the wrong shape, is a ``BadRequest`` naming the step.
"""
from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import BadRequest

STEP_TYPES = ("RUN", "COPY", "ENV", "WORKDIR", "USER")
MAX_STEPS = 200                 # each disk-changing step is a layer; the image stack holds 255
DEFAULT_USER = "user"           # E2B's: steps and sandboxes run as `user` in /home/user unless set
DEFAULT_WORKDIR = "/home/user"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\Z|[0-9]{1,10}\Z")
_USER_GROUP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?\Z")
_FILES_HASH = re.compile(r"[A-Za-z0-9_-]{8,128}\Z")


@dataclass(frozen=True)
class StepState:
    """What a step runs with, and what the template's sandboxes start with."""
    envs: tuple[tuple[str, str], ...] = ()
    user: str = DEFAULT_USER
    workdir: str = DEFAULT_WORKDIR

    def env_dict(self) -> dict[str, str]:
        return dict(self.envs)

    def with_envs(self, more: dict[str, str]) -> "StepState":
        merged = dict(self.envs)
        merged.update(more)
        return replace(self, envs=tuple(sorted(merged.items())))

    def to_json(self) -> str:
        return json.dumps({"envs": dict(self.envs), "user": self.user, "workdir": self.workdir}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "StepState":
        obj = json.loads(text)
        return cls(tuple(sorted((str(k), str(v)) for k, v in obj.get("envs", {}).items())),
                   str(obj.get("user", DEFAULT_USER)), str(obj.get("workdir", DEFAULT_WORKDIR)))


@dataclass(frozen=True)
class Step:
    index: int                          # 1-based, as the SDK counts them in "step N"
    kind: str                           # RUN | COPY | ENV | WORKDIR | USER
    args: tuple[str, ...]
    force: bool = False
    files_hash: str | None = None       # COPY: the uploaded context's hash

    @property
    def label(self) -> str:
        """The step's name in logs and failure reasons: its number, as the SDK maps it
        back to the builder call that made it (``base`` and ``finalize`` are the others)."""
        return str(self.index)

    def describe(self) -> str:
        if self.kind == "RUN":
            return f"RUN {self.args[0]}" + (f" (as {self.args[1]})" if len(self.args) > 1 and self.args[1] else "")
        if self.kind == "ENV":
            return "ENV " + " ".join(f"{k}={v}" for k, v in zip(self.args[::2], self.args[1::2]))
        return f"{self.kind} {' '.join(a for a in self.args if a)}"

    def identity(self) -> dict[str, Any]:
        """What the cache key covers (docs/templates.md)."""
        return {"type": self.kind, "args": list(self.args), "filesHash": self.files_hash}

    @property
    def changes_disk(self) -> bool:
        return self.kind in ("RUN", "COPY", "WORKDIR")

    def next_state(self, state: StepState) -> StepState:
        """The state after this step (its effect on envs, user, workdir)."""
        if self.kind == "ENV":
            # values see the variables before this step, as in Docker (ENV PATH=/opt/bin:$PATH)
            envs = state.env_dict()
            return state.with_envs({k: expand(v, envs) for k, v in zip(self.args[::2], self.args[1::2])})
        if self.kind == "USER":
            return replace(state, user=self.args[0].split(":", 1)[0])
        if self.kind == "WORKDIR":
            return replace(state, workdir=resolve_path(state.workdir, self.args[0]))
        return state


@dataclass(frozen=True)
class Registry:
    username: str
    password: str

    def __repr__(self) -> str:     # never print a password
        return f"Registry(username={self.username!r}, password=***)"


@dataclass(frozen=True)
class BuildSpec:
    from_image: str | None
    from_template: str | None
    registry: Registry | None
    steps: tuple[Step, ...]
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def base(self) -> str:
        return f"template {self.from_template}" if self.from_template else f"image {self.from_image}"


# Docker's PATH for an image whose config sets none: what ``$PATH`` expands to then.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_VAR = re.compile(r"\\\$|\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<op>[-+])(?P<word>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def expand(value: str, envs: dict[str, str]) -> str:
    """``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:+alt}`` against ``envs`` (Docker's
    ENV substitution; ``\\$`` is a literal ``$``). An unset PATH is Docker's default."""
    def lookup(name: str) -> str:
        if name in envs:
            return envs[name]
        return DEFAULT_PATH if name == "PATH" else ""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group("braced") or m.group("bare")
        val = lookup(name)
        op = m.group("op")
        if op == "-":
            return val if val else m.group("word")
        if op == "+":
            return m.group("word") if val else ""
        return val
    return _VAR.sub(one, value)


def resolve_path(workdir: str, path: str) -> str:
    """``path`` against ``workdir`` as a shell in that directory sees it."""
    return posixpath.normpath(posixpath.join(workdir, path)) if path else workdir


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise BadRequest(f"{where}: args must be a list of strings")
    if any("\0" in a for a in value):
        raise BadRequest(f"{where}: args must not contain NUL bytes")
    return tuple(value)


def parse_step(index: int, raw: Any) -> Step:
    where = f"step {index}"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where}: a step is an object with type and args")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind.upper() not in STEP_TYPES:
        raise BadRequest(f"{where}: unknown step type {kind!r} (known: {', '.join(STEP_TYPES)})")
    kind = kind.upper()
    args = _strings(raw.get("args", []), where)
    force = raw.get("force") or False
    if not isinstance(force, bool):
        raise BadRequest(f"{where}: force must be a boolean")
    files_hash = raw.get("filesHash")
    if kind == "RUN":
        if not 1 <= len(args) <= 2 or not args[0].strip():
            raise BadRequest(f"{where}: RUN takes [command, user?]")
        if len(args) == 2 and args[1] and not _USER.match(args[1]):
            raise BadRequest(f"{where}: bad user name {args[1]!r}")
    elif kind == "COPY":
        if not 2 <= len(args) <= 4 or not args[0] or not args[1]:
            raise BadRequest(f"{where}: COPY takes [src, dest, user?, mode?]")
        if len(args) > 2 and args[2] and not _USER_GROUP.match(args[2]):    # Docker's --chown=user[:group]
            raise BadRequest(f"{where}: bad owner {args[2]!r} (user or user:group)")
        if len(args) > 3 and args[3] and not re.fullmatch(r"0?[0-7]{3,4}", args[3]):
            raise BadRequest(f"{where}: COPY mode must be octal, got {args[3]!r}")
        if not isinstance(files_hash, str) or not _FILES_HASH.match(files_hash):
            raise BadRequest(f"{where}: COPY needs the filesHash of its uploaded files")
        src = posixpath.normpath(args[0])
        if src.startswith("/") or src == ".." or src.startswith("../"):
            raise BadRequest(f"{where}: COPY source {args[0]!r} is outside the build context")
    elif kind == "ENV":
        if not args or len(args) % 2:
            raise BadRequest(f"{where}: ENV takes [name, value, name, value, ...]")
        for name in args[::2]:
            if not _ENV_NAME.match(name):
                raise BadRequest(f"{where}: bad environment variable name {name!r}")
    elif kind == "WORKDIR":
        if len(args) != 1 or not args[0]:
            raise BadRequest(f"{where}: WORKDIR takes [path]")
    elif kind == "USER":
        if len(args) != 1 or not _USER_GROUP.match(args[0]):
            raise BadRequest(f"{where}: USER takes [name] or [name:group]")
    if kind != "COPY":
        files_hash = None
    return Step(index, kind, args, force, files_hash)


def parse_build(body: dict[str, Any]) -> BuildSpec:
    """``TemplateBuildStartV2`` → ``BuildSpec`` (BadRequest on anything malformed)."""
    from_image, from_template = body.get("fromImage"), body.get("fromTemplate")
    for name, value in (("fromImage", from_image), ("fromTemplate", from_template),
                        ("startCmd", body.get("startCmd")), ("readyCmd", body.get("readyCmd"))):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise BadRequest(f"{name} must be a non-empty string")
    if bool(from_image) == bool(from_template):
        raise BadRequest("give exactly one of fromImage and fromTemplate")
    registry = None
    reg = body.get("fromImageRegistry")
    if reg is not None:
        if not isinstance(reg, dict):
            raise BadRequest("fromImageRegistry must be an object")
        if reg.get("type") != "registry":
            raise BadRequest(f"fromImageRegistry type {reg.get('type')!r} is not supported here (only 'registry': "
                             f"username and password; AWS and GCP registries need their cloud's token service)")
        user, password = reg.get("username"), reg.get("password")
        if not isinstance(user, str) or not isinstance(password, str):
            raise BadRequest("fromImageRegistry needs username and password strings")
        if from_template:
            raise BadRequest("fromImageRegistry goes with fromImage, not fromTemplate")
        registry = Registry(user, password)
    raw_steps = body.get("steps") or []
    if not isinstance(raw_steps, list):
        raise BadRequest("steps must be a list")
    if len(raw_steps) > MAX_STEPS:
        raise BadRequest(f"a build has at most {MAX_STEPS} steps, got {len(raw_steps)}")
    steps = tuple(parse_step(i + 1, s) for i, s in enumerate(raw_steps))
    force = body.get("force") or False
    if not isinstance(force, bool):
        raise BadRequest("force must be a boolean")
    if body.get("readyCmd") and not body.get("startCmd"):
        raise BadRequest("readyCmd needs a startCmd")
    return BuildSpec(from_image, from_template, registry, steps, body.get("startCmd"), body.get("readyCmd"), force)
