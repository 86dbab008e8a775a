"""Dockerfile instructions → the steps of an E2B template build.

The mapping is the one E2B's SDK applies in ``Template.from_dockerfile``, so a
Dockerfile built here and there gives the same template:

- ``FROM image`` → ``fromImage``; then ``USER root`` and ``WORKDIR /`` (Docker's
  defaults, under which a Dockerfile's instructions run);
- ``RUN`` → a RUN step ``[command]`` (the exec form shell-quoted);
- ``COPY``/``ADD`` of local paths → one COPY step ``[src, dest, owner, mode]`` per
  source (a relative dest is taken from the current WORKDIR, as Docker does);
  a heredoc source becomes a RUN step as root that writes the file;
- ``ENV`` and ``ARG`` → ENV steps ``[k, v, …]`` (E2B keeps ARGs in the template's
  environment; ``--build-arg`` sets their values);
- ``WORKDIR``/``USER`` → their steps;
- ``ENTRYPOINT``/``CMD`` → ``startCmd`` with Docker's combination rules, and the
  ready command E2B gives a Dockerfile (``sleep 20``) unless one is asked for;
- at the end ``USER user`` and ``WORKDIR /home/user`` (E2B's defaults) unless the
  Dockerfile set them.

What a template has no equivalent for is ignored with a warning (EXPOSE, LABEL,
MAINTAINER, VOLUME, STOPSIGNAL, HEALTHCHECK, ONBUILD, RUN --mount/--network/…,
COPY --link); what would change the result is an error naming its line
(multi-stage builds, ``COPY --from``, ``ADD`` of a URL or an archive, ``SHELL``,
``COPY --exclude/--parents``, sources outside the context).
"""
from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import DockerfileError
from .syntax import Dockerfile, Heredoc, Instruction, Lexer, json_form, raw_words, split_flags

DEFAULT_USER = "user"                 # E2B's template defaults
DEFAULT_WORKDIR = "/home/user"
DOCKERFILE_READY_CMD = "sleep 20"     # what E2B's from_dockerfile sets with a start command

IGNORED = {
    "EXPOSE": "a sandbox's ports are all reachable through the proxy",
    "LABEL": "templates have no labels",
    "MAINTAINER": "templates have no labels",
    "VOLUME": "a template has one root filesystem",
    "STOPSIGNAL": "sandboxes are paused or killed, not stopped",
    "HEALTHCHECK": "use --ready-cmd for a readiness check",
    "ONBUILD": "it applies only to images built from this one",
}

# flag → None (supported) or the reason it is ignored with a warning; other flags are errors
_RUN_FLAGS = {"mount": "build mounts do not exist in a template build", "network": "the build VM's network is fixed",
              "security": "the build VM's security is fixed", "device": "no devices in a template build"}
_COPY_FLAGS: dict[str, str | None] = {"chown": None, "chmod": None, "link": "layers are always linked"}
_ADD_FLAGS: dict[str, str | None] = {**_COPY_FLAGS, "checksum": "it only applies to URLs",
                                     "keep-git-dir": "it only applies to git URLs"}
_FROM_FLAGS = {"platform": "the image's platform is the node's"}
_URL = re.compile(r"^(?:[a-z][a-z0-9+.\-]*://|git@)", re.IGNORECASE)
_CHMOD = re.compile(r"^[0-7]{3,4}$")


@dataclass(frozen=True)
class Step:
    """One E2B build step (type RUN, COPY, ENV, WORKDIR or USER) and where it came from."""

    type: str
    args: tuple[str, ...]
    line: int | None = None           # None: a default added around the Dockerfile's own steps

    def describe(self) -> str:
        if self.type == "ENV":
            return "ENV " + " ".join(f"{k}={v}" for k, v in zip(self.args[::2], self.args[1::2]))
        text = self.args[0] if self.type == "RUN" else " ".join(a for a in self.args if a)
        return f"{self.type} {text}"


@dataclass(frozen=True)
class CopySource:
    """A COPY step's local source: uploaded as a tar of the matching context files."""

    step: int                # index into BuildPlan.steps
    src: str                 # as the step names it (a path or glob relative to the context)
    dest: str
    line: int
    keyword: str             # COPY or ADD


@dataclass(frozen=True)
class Notice:
    line: int | None
    message: str

    def __str__(self) -> str:
        return f"Dockerfile line {self.line}: {self.message}" if self.line else f"Dockerfile: {self.message}"


@dataclass(frozen=True)
class BuildPlan:
    from_image: str
    steps: tuple[Step, ...]
    copies: tuple[CopySource, ...]
    start_cmd: str | None = None
    ready_cmd: str | None = None
    warnings: tuple[Notice, ...] = ()

    def request(self, files_hashes: Mapping[int, str] | None = None, force: bool = False,
                registry: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The ``TemplateBuildStartV2`` body; ``files_hashes`` maps COPY step index → hash."""
        hashes = files_hashes or {}
        steps: list[dict[str, Any]] = []
        for i, step in enumerate(self.steps):
            item: dict[str, Any] = {"type": step.type, "args": list(step.args), "force": False}
            if i in hashes:
                item["filesHash"] = hashes[i]
            steps.append(item)
        body: dict[str, Any] = {"fromImage": self.from_image, "steps": steps, "force": force}
        if registry:
            body["fromImageRegistry"] = {"type": "registry", **registry}
        if self.start_cmd is not None:
            body["startCmd"] = self.start_cmd
        if self.ready_cmd is not None:
            body["readyCmd"] = self.ready_cmd
        return body


def convert(dockerfile: Dockerfile, build_args: Mapping[str, str] | None = None,
            ready_cmd: str | None = None) -> BuildPlan:
    """The build plan of a parsed Dockerfile. ``ready_cmd`` replaces the default one."""
    return _Converter(dockerfile, dict(build_args or {})).run(ready_cmd)


def shell_join(words: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


@dataclass
class _StartCommand:
    exec_form: bool
    words: list[str]


@dataclass
class _Converter:
    dockerfile: Dockerfile
    build_args: dict[str, str]
    steps: list[Step] = field(default_factory=list)
    copies: list[CopySource] = field(default_factory=list)
    warnings: list[Notice] = field(default_factory=list)
    global_args: dict[str, str] = field(default_factory=dict)   # ARGs before FROM: FROM's scope only
    vars: dict[str, str] = field(default_factory=dict)          # ARG and ENV values declared so far
    used_args: set[str] = field(default_factory=set)
    workdir: str = "/"
    user_set: bool = False
    workdir_set: bool = False
    from_image: str | None = None
    cmd: _StartCommand | None = None
    entrypoint: _StartCommand | None = None

    def __post_init__(self) -> None:
        self.lex = Lexer(self.dockerfile.escape)

    # --- driving ----------------------------------------------------------

    def run(self, ready_cmd: str | None) -> BuildPlan:
        for ins in self.dockerfile.instructions:
            if self.from_image is None and ins.keyword not in ("FROM", "ARG"):
                raise DockerfileError(f"{ins.keyword} before FROM: a Dockerfile starts with FROM "
                                      "(only ARG may come before it)", ins.line)
            handler = getattr(self, f"do_{ins.keyword.lower()}", None)
            if handler is not None:
                handler(ins)
            elif ins.keyword in IGNORED:
                self.warn(ins, f"{ins.keyword} ignored: {IGNORED[ins.keyword]}")
            elif ins.keyword == "SHELL":
                raise DockerfileError("SHELL is not supported: RUN steps run in the build VM's shell "
                                      "(write `RUN bash -c '…'` instead)", ins.line)
            else:
                raise DockerfileError(f"unknown instruction {ins.keyword}", ins.line)
        if self.from_image is None:
            raise DockerfileError("no FROM instruction")
        unused = sorted(set(self.build_args) - self.used_args)
        if unused:
            self.warnings.append(Notice(None, f"build args not used by any ARG: {', '.join(unused)}"))
        start = self.start_command()
        if not self.user_set:
            self.steps.append(Step("USER", (DEFAULT_USER,)))
        if not self.workdir_set:
            self.steps.append(Step("WORKDIR", (DEFAULT_WORKDIR,)))
        ready = ready_cmd if ready_cmd is not None else (DOCKERFILE_READY_CMD if start else None)
        return BuildPlan(self.from_image, tuple(self.steps), tuple(self.copies), start, ready or None,
                         tuple(self.warnings))

    def warn(self, ins: Instruction, message: str) -> None:
        self.warnings.append(Notice(ins.line, message))

    def resolve(self, name: str) -> str | None:
        return self.vars.get(name)

    def strict(self, ins: Instruction) -> Any:
        """A resolver for what must be known here (COPY sources): unknown names are errors."""
        def get(name: str) -> str:
            if name not in self.vars:
                raise DockerfileError(f"${name} is not set by an ARG or ENV before this {ins.keyword} "
                                      "(a COPY source is resolved before the build)", ins.line)
            return self.vars[name]
        return get

    def flags(self, ins: Instruction, allowed: Mapping[str, str | None]) -> tuple[dict[str, str], str]:
        found, rest = split_flags(ins.text, self.dockerfile.escape)
        values: dict[str, str] = {}
        for name, value, _raw in found:
            if name not in allowed:
                raise DockerfileError(f"{ins.keyword} --{name} is not supported", ins.line)
            if name in values:
                raise DockerfileError(f"{ins.keyword} --{name} given twice", ins.line)
            reason = allowed[name]
            if reason is not None:
                self.warn(ins, f"{ins.keyword} --{name} ignored: {reason}")
                continue
            if value is None:
                raise DockerfileError(f"{ins.keyword} --{name} needs a value (--{name}=…)", ins.line)
            values[name] = value
        return values, rest

    def step(self, ins: Instruction, type_: str, *args: str) -> int:
        self.steps.append(Step(type_, tuple(args), ins.line))
        return len(self.steps) - 1

    # --- instructions -----------------------------------------------------

    def do_from(self, ins: Instruction) -> None:
        if self.from_image is not None:
            raise DockerfileError("multi-stage builds are not supported: a second FROM "
                                  "(a template is built from one image)", ins.line)
        _flags, rest = self.flags(ins, _FROM_FLAGS)
        words = self.lex.words(rest, self.global_args.get, ins.line)
        if len(words) == 3 and words[1].lower() == "as":
            words = words[:1]        # a stage name means nothing in a single-stage build
        if len(words) != 1 or not words[0]:
            raise DockerfileError("FROM takes an image and optionally AS NAME", ins.line)
        image = words[0]
        if "$" in image:
            raise DockerfileError(f"FROM {image}: its variable is not set by an ARG before FROM", ins.line)
        if image == "scratch":
            raise DockerfileError("FROM scratch is not supported: a template runs in the image's "
                                  "filesystem and needs a shell", ins.line)
        self.from_image = image
        # Docker's defaults, under which a Dockerfile's instructions run
        self.steps += [Step("USER", ("root",)), Step("WORKDIR", ("/",))]

    def do_arg(self, ins: Instruction) -> None:
        words = self.lex.words(ins.text, self.resolve if self.from_image else self.global_args.get, ins.line)
        if not words:
            raise DockerfileError("ARG needs a name", ins.line)
        pairs: dict[str, str] = {}
        for word in words:
            name, sep, default = word.partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise DockerfileError(f"bad ARG name {name!r}", ins.line)
            if name in self.build_args:
                value = self.build_args[name]
                self.used_args.add(name)
            elif sep:
                value = default
            else:        # a redeclared global ARG keeps its default, as in Docker
                value = self.global_args.get(name, "")
            pairs[name] = value
        if self.from_image is None:
            self.global_args.update(pairs)
            return
        self.vars.update(pairs)
        self.step(ins, "ENV", *[x for kv in pairs.items() for x in kv])

    def do_env(self, ins: Instruction) -> None:
        pairs = self.name_values(ins)
        self.vars.update(pairs)
        self.step(ins, "ENV", *[x for kv in pairs.items() for x in kv])

    def name_values(self, ins: Instruction) -> dict[str, str]:
        raw = raw_words(ins.text, self.dockerfile.escape)
        if not raw:
            raise DockerfileError(f"{ins.keyword} needs NAME=VALUE", ins.line)
        pairs: dict[str, str] = {}
        if "=" not in raw[0]:        # the legacy form: ENV NAME the rest of the line
            if len(raw) < 2:
                raise DockerfileError(f"{ins.keyword} {raw[0]} has no value (ENV NAME=VALUE)", ins.line)
            value_text = ins.text[len(raw[0]):].strip()
            pairs[self.lex.word(raw[0], self.resolve, ins.line)] = self.lex.word(value_text, self.resolve, ins.line)
        else:
            for word in raw:
                name, sep, value = word.partition("=")
                if not sep:
                    raise DockerfileError(f"{word!r} is not NAME=VALUE", ins.line)
                # values see the variables from before this instruction, not their neighbours
                # on the same line (Docker: `ENV abc=bye def=$abc` gives def the old abc)
                pairs[self.lex.word(name, self.resolve, ins.line)] = self.lex.word(value, self.resolve, ins.line)
        for key in pairs:
            if not key or "=" in key or any(c in key for c in " \t\n"):
                raise DockerfileError(f"bad {ins.keyword} name {key!r}", ins.line)
        return pairs

    def do_workdir(self, ins: Instruction) -> None:
        path = self.lex.word(ins.text, self.resolve, ins.line).strip()
        if not path:
            raise DockerfileError("WORKDIR needs a path", ins.line)
        self.workdir = posixpath.normpath(posixpath.join(self.workdir, path))
        self.workdir_set = True
        self.step(ins, "WORKDIR", self.workdir)

    def do_user(self, ins: Instruction) -> None:
        user = self.lex.word(ins.text, self.resolve, ins.line).strip()
        if not user or any(c in user for c in " \t"):
            raise DockerfileError("USER takes one argument: USER NAME[:GROUP]", ins.line)
        self.user_set = True
        self.step(ins, "USER", user)

    def do_run(self, ins: Instruction) -> None:
        _flags, rest = self.flags(ins, _RUN_FLAGS)
        words = json_form(rest)
        if words is not None:
            command = shell_join(words)
        elif ins.heredocs:
            command = self.run_heredocs(rest, ins.heredocs)
        else:
            command = rest
        if not command.strip():
            raise DockerfileError("RUN needs a command", ins.line)
        self.step(ins, "RUN", command)

    @staticmethod
    def run_heredocs(line: str, heredocs: tuple[Heredoc, ...]) -> str:
        if len(heredocs) == 1 and re.fullmatch(r"<<-?\S+", line.strip()):
            body = heredocs[0].content
            if not body.startswith("#!"):
                return body          # `RUN <<EOF`: the body is the script
            # a script with its own interpreter: write it out and run it
            script = shlex.quote(f"/tmp/{heredocs[0].name}")
            term = _terminator(heredocs[0].name, body)
            return (f"cat <<'{term}' >{script}\n{body}{term}\nchmod +x {script} && {script}\n"
                    f"rc=$?; rm -f {script}; exit $rc")
        # heredocs inside a longer command (`cat <<EOF >f`): the shell reads them
        return line + "".join(f"\n{h.content}{h.name}" for h in heredocs)

    def do_cmd(self, ins: Instruction) -> None:
        self.cmd = self.start_form(ins)

    def do_entrypoint(self, ins: Instruction) -> None:
        self.entrypoint = self.start_form(ins)

    @staticmethod
    def start_form(ins: Instruction) -> _StartCommand:
        words = json_form(ins.text)
        return _StartCommand(True, words) if words is not None else _StartCommand(False, [ins.text] if ins.text else [])

    def start_command(self) -> str | None:
        """Docker's rules: an exec-form ENTRYPOINT gets CMD appended (a shell-form CMD as
        ``/bin/sh -c CMD``); a shell-form ENTRYPOINT ignores CMD; else CMD alone."""
        cmd, ep = self.cmd, self.entrypoint
        if ep is not None:
            if not ep.exec_form:
                command = ep.words[0] if ep.words else ""
            else:
                words = list(ep.words)
                if cmd is not None:
                    words += cmd.words if cmd.exec_form else (["/bin/sh", "-c", cmd.words[0]] if cmd.words else [])
                command = shell_join(words)
        elif cmd is not None:
            command = shell_join(cmd.words) if cmd.exec_form else (cmd.words[0] if cmd.words else "")
        else:
            return None
        return command if command.strip() else None

    def do_copy(self, ins: Instruction) -> None:
        self.copy(ins, _COPY_FLAGS)

    def do_add(self, ins: Instruction) -> None:
        self.copy(ins, _ADD_FLAGS)

    def copy(self, ins: Instruction, allowed: Mapping[str, str | None]) -> None:
        found, _rest = split_flags(ins.text, self.dockerfile.escape)
        for name, _value, _raw in found:
            if name == "from":
                raise DockerfileError(f"{ins.keyword} --from is not supported (multi-stage builds are "
                                      "not supported)", ins.line)
            if name in ("exclude", "parents"):
                raise DockerfileError(f"{ins.keyword} --{name} is not supported", ins.line)
        flags, rest = self.flags(ins, allowed)
        words = json_form(rest)
        if words is not None:
            raw_srcs, raw_dest = words[:-1], (words[-1] if words else "")
        else:
            raw_srcs, raw_dest = raw_words(rest, self.dockerfile.escape), ""
            if raw_srcs:
                raw_dest = raw_srcs.pop()
        if not raw_srcs or not raw_dest:
            raise DockerfileError(f"{ins.keyword} needs a source and a destination", ins.line)
        owner = self.lex.word(flags["chown"], self.resolve, ins.line) if "chown" in flags else ""
        mode = ""
        if "chmod" in flags:
            chmod = self.lex.word(flags["chmod"], self.resolve, ins.line)
            if not _CHMOD.match(chmod):
                raise DockerfileError(f"--chmod={chmod}: expected an octal mode such as 0755", ins.line)
            mode = f"{int(chmod, 8):04o}"
        dest = self.dest(self.lex.substitute(raw_dest, self.resolve, ins.line) if words is not None
                         else self.lex.word(raw_dest, self.resolve, ins.line))
        heredocs = {h.name: h for h in ins.heredocs}
        if len(raw_srcs) > 1 and not dest.endswith("/"):
            raise DockerfileError(f"{ins.keyword} of several sources needs a directory destination "
                                  f"ending in / (got {dest})", ins.line)
        for raw in raw_srcs:
            marker = re.fullmatch(r"""<<-?["']?([^"']+)["']?""", raw) if words is None else None
            if marker and marker.group(1) in heredocs:
                self.copy_heredoc(ins, heredocs[marker.group(1)], dest, owner, mode)
                continue
            src = (self.lex.substitute(raw, self.strict(ins), ins.line) if words is not None
                   else self.lex.word(raw, self.strict(ins), ins.line))
            if ins.keyword == "ADD" and _URL.match(src):
                raise DockerfileError(f"ADD of a URL is not supported ({src}): download it in a RUN step "
                                      "(curl/wget) instead", ins.line)
            check_source(src, ins.line)
            index = self.step(ins, "COPY", src, dest, owner, mode)
            self.copies.append(CopySource(index, src, dest, ins.line, ins.keyword))

    def dest(self, dest: str) -> str:
        """A relative destination is under the current WORKDIR; a trailing / (a directory)
        is kept, and ``.`` means the WORKDIR itself."""
        is_dir = dest.endswith("/") or dest in (".", "..") or dest.endswith(("/.", "/.."))
        path = posixpath.normpath(posixpath.join(self.workdir, dest))
        if path.startswith("//"):
            path = "/" + path.lstrip("/")
        return path + "/" if is_dir and path != "/" else path

    def copy_heredoc(self, ins: Instruction, doc: Heredoc, dest: str, owner: str, mode: str) -> None:
        """``COPY <<EOF /path``: a RUN step as root that writes the body to the file."""
        body = self.lex.substitute(doc.content, self.resolve, ins.line) if doc.expand else doc.content
        target = dest + doc.name if dest.endswith("/") else dest
        term = _terminator(doc.name, body)
        command = (f"mkdir -p {shlex.quote(posixpath.dirname(target) or '/')} && "
                   f"cat <<'{term}' >{shlex.quote(target)}\n{body}{term}")
        if owner:
            command += f"\nchown {shlex.quote(owner)} {shlex.quote(target)}"
        if mode:
            command += f"\nchmod {mode} {shlex.quote(target)}"
        self.step(ins, "RUN", command, "root")


def _terminator(name: str, body: str) -> str:
    term = "AENV_EOF_" + re.sub(r"\W", "_", name)
    while term in body:
        term += "_"
    return term


def check_source(src: str, line: int) -> None:
    """A COPY source must name something inside the context: relative, no way out by ``..``."""
    if src.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", src):
        raise DockerfileError(f"COPY source {src} is an absolute path: sources are relative to the "
                              "build context", line)
    norm = posixpath.normpath(src)
    if norm == ".." or norm.startswith("../"):
        raise DockerfileError(f"COPY source {src} is outside the build context", line)
