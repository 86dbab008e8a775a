"""Which start and ready commands a build's finalize runs (docs/templates.md, "Start and
ready commands").

E2B's template manager (its finalize phase) decides by what the request gives:

* ``startCmd`` (with or without ``readyCmd``): that command, then the ready check.
* neither, and the build is ``fromTemplate``: the parent template's start and ready
  commands, run again in the new build VM (the child's sandboxes run what the parent's
  ran). From an image: nothing is started.
* ``readyCmd`` alone: E2B starts nothing and polls the ready command. aenv also starts
  what the base would have running, so the ready command has something to wait for:
  from a template, the parent's start command; from an image, the image's
  ``ENTRYPOINT`` + ``CMD`` as Docker runs them (as the image's ``USER``, root when unset,
  in its ``WORKDIR``, ``/`` when unset). AgentENV's compatibility flow builds
  ``Template().from_image(img).set_ready_cmd(wait_for_url(...))`` expecting exactly
  that. Such an inherited start that exits does not fail the build (on E2B it would
  not run at all): the ready command decides.

A start command the request asked for fails the build when it exits non-zero before
the template is ready; so does the parent's, inherited when neither command is given
(it passed in the parent's own build). Pure functions over the records the executor
hands in.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Mapping

from aenv_wire.builds import BuildSpec

ROOT = "root"


@dataclass(frozen=True)
class BaseStart:
    """What a build's base starts: a parent template's start and ready commands, or an
    image's ENTRYPOINT + CMD (no ready command), and the user and directory it runs in."""
    cmd: str | None
    ready_cmd: str | None
    user: str
    workdir: str
    source: str                  # "template NAME" or "image REF", for the build log


@dataclass(frozen=True)
class StartPlan:
    cmd: str | None              # None: nothing is started
    ready_cmd: str | None
    user: str | None             # None: the build's last state's user and workdir
    workdir: str | None
    required: bool               # the start command exiting non-zero fails the build
    source: str                  # "asked", or where the command was inherited from

    @property
    def inherited(self) -> bool:
        return self.source != "asked"


NOTHING = StartPlan(None, None, None, None, True, "asked")


def image_start(runtime: Mapping[str, Any], ref: str) -> BaseStart | None:
    """The image config's start, as ``docker run`` would run it (None: it has none). An
    OCI config holds both ENTRYPOINT and CMD as argument lists (a Dockerfile's shell form
    is stored as ``/bin/sh -c …``): the command is the entrypoint followed by CMD."""
    words: list[str] = []
    for key in ("Entrypoint", "Cmd"):
        value = runtime.get(key)
        if isinstance(value, list):
            words += [str(w) for w in value]
    if not words:
        return None
    user = str(runtime.get("User") or "").split(":", 1)[0] or ROOT
    workdir = str(runtime.get("WorkingDir") or "") or "/"
    return BaseStart(shlex.join(words), None, user, workdir, f"image {ref}")


def plan_start(spec: BuildSpec, base: BaseStart | None) -> StartPlan:
    """What the finalize of ``spec`` runs, given what its base starts (module doc)."""
    asked = spec.start
    if asked is not None and asked.cmd:
        return StartPlan(asked.cmd, asked.ready_cmd, None, None, True, "asked")
    if asked is not None and asked.ready_cmd:
        if base is not None and base.cmd:
            return StartPlan(base.cmd, asked.ready_cmd, base.user, base.workdir, False, base.source)
        return StartPlan(None, asked.ready_cmd, None, None, True, "asked")
    if spec.from_template is not None and base is not None and (base.cmd or base.ready_cmd):
        return StartPlan(base.cmd, base.ready_cmd, base.user, base.workdir, True, base.source)
    return NOTHING
