"""The code interpreter's template, ``code-interpreter-v1``, made by the node itself
(``[server] code_interpreter``): E2B serves it without a step from the user, so
``from e2b_code_interpreter import Sandbox; Sandbox.create()`` works on a fresh node.

At start the node builds ``codeint/Dockerfile`` (the steps docs/code-interpreter.md
gives for the CLI) through its own template builds, in the background, when the
template is missing or was made by an older node from other sources: the build's
``default`` tag then also carries ``aenv-<key>``, the hash of its steps, their files
and the base template it starts from. A ``code-interpreter-v1`` the user built himself
(its default build has no ``aenv-`` tag) is left alone. While the first build runs, a
create from it waits a little, then answers 503 with Retry-After (templates_api.py),
never 404."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import codeint
from aenv_vm.builds import records
from aenv_vm.builds.template_builds import BuildRun, TemplateBuilds
from aenv_wire.builds import BuildResources, parse_build_spec

from .template_build import PreparedBuild, prepare

log = logging.getLogger("aenv.node")

NAME = "code-interpreter-v1"
# the server answers /health once its default Python kernel is started and warmed
READY_CMD = "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:49999/health', timeout=5)\""
CPU_COUNT = 2
MEMORY_MB = 1024
TAG_PREFIX = "aenv-"


@dataclass(frozen=True)
class Decision:
    """What the node does about the template at start: ``build`` it or not, and why."""
    build: bool
    why: str
    key: str


def source_dir() -> Path:
    """The ``codeint`` package: its Dockerfile and the server's sources it copies."""
    return Path(codeint.__file__).resolve().parent


def prepared_build() -> PreparedBuild:
    src = source_dir()
    return prepare(str(src / "Dockerfile"), str(src), {}, READY_CMD)


def source_key(prepared: PreparedBuild, base_template: str) -> str:
    """Names this build exactly: its steps with their files' hashes, and the base."""
    body = json.dumps({"build": prepared.body(), "base": base_template, "cpu": CPU_COUNT, "memory": MEMORY_MB},
                      sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def decide(tdef: records.TemplateDef | None, key: str) -> Decision:
    """Build when the template is missing or is a node's build of other sources; leave a
    current one, and one the user made, alone."""
    if tdef is None or records.DEFAULT_TAG not in tdef.tags:
        return Decision(True, "missing", key)
    default_build = tdef.tags[records.DEFAULT_TAG][0]
    ours = [t for t, v in tdef.tags.items() if t.startswith(TAG_PREFIX) and v[0] == default_build]
    if f"{TAG_PREFIX}{key}" in ours:
        return Decision(False, "current", key)
    if not ours:
        return Decision(False, "built by a user (its default build has no aenv- tag): left as it is", key)
    return Decision(True, "made from other sources or another base", key)


async def begin(builds: TemplateBuilds, base_template: str, report: Callable[[str], None]) -> BuildRun | None:
    """Check the template and, when it must be made, request and start its build (the
    files uploaded into the store first); the running build, or None. Quick: the build
    itself goes on in the background (``finish``)."""
    prepared = await asyncio.to_thread(prepared_build)
    key = source_key(prepared, base_template)
    tdef = await asyncio.to_thread(records.load_def, builds.store, NAME)
    decision = decide(tdef, key)
    if not decision.build:
        report(f"template {NAME!r} ready (built before, current)" if decision.why == "current"
               else f"template {NAME!r}: {decision.why}")
        return None
    settings = builds.settings
    resources = BuildResources(min(CPU_COUNT, settings.max_vcpus), min(MEMORY_MB, settings.max_memory_mib))
    run = await builds.request(NAME, [records.DEFAULT_TAG, f"{TAG_PREFIX}{key}"], resources,
                               notes=("made by the node at start ([server] code_interpreter)",))
    with tempfile.TemporaryDirectory(prefix="codeint-", dir=settings.data_dir) as work:
        for files in prepared.files:
            if builds.files_present(files.files_hash):
                continue
            tar = Path(work) / f"{files.files_hash}.tar.gz"
            assert prepared.context is not None     # files come from a context
            with open(tar, "wb") as out:
                prepared.context.write_tar(files, out)
            await builds.accept_files(files.files_hash, tar)
    spec = parse_build_spec(prepared.body())
    await builds.start_build(NAME, run.build_id, spec)
    report(f"template {NAME!r} ({decision.why}): building in the background, build {run.build_id} "
           f"(a few minutes under TCG; creates from it wait, then get 503 with Retry-After)")
    return run


async def finish(builds: TemplateBuilds, run: BuildRun, report: Callable[[str], None]) -> bool:
    """Wait for the build ``begin`` started; make the template public (every team's, like
    ``base``). Whether it is ready."""
    if run.task is not None:
        await asyncio.shield(run.task)
    if run.status != "ready":
        message, step = run.reason or ("unknown", None)
        report(f"template {NAME!r}: the build {run.build_id} failed at step {step or '?'}: {message} "
               f"(`aenv template logs {NAME} {run.build_id}`; it is tried again at the next start)")
        return False
    await builds.set_public(NAME, True)
    report(f"template {NAME!r} ready (build {run.build_id})")
    return True
