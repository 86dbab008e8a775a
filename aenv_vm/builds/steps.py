"""The state a build's steps thread through (envs, user, workdir) and what each step
does to it. The step list itself is E2B's wire format, parsed into typed records by
``aenv_wire.builds`` (``BuildSpec``, ``Step``) before it reaches this layer.
"""
from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, replace

from aenv_wire.builds import Step, StepKind

DEFAULT_USER = "user"           # E2B's: steps and sandboxes run as `user` in /home/user unless set
DEFAULT_WORKDIR = "/home/user"


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


def next_state(step: Step, state: StepState) -> StepState:
    """The state after ``step`` (its effect on envs, user, workdir)."""
    if step.kind == StepKind.ENV:
        # values see the variables before this step, as in Docker (ENV PATH=/opt/bin:$PATH)
        envs = state.env_dict()
        return state.with_envs({k: expand(v, envs) for k, v in zip(step.args[::2], step.args[1::2])})
    if step.kind == StepKind.USER:
        return replace(state, user=step.args[0].split(":", 1)[0])
    if step.kind == StepKind.WORKDIR:
        return replace(state, workdir=resolve_path(state.workdir, step.args[0]))
    return state
